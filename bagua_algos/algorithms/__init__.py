"""The algorithms; importing this package registers each under its Bagua name."""

from .allreduce_average import AllreduceAverageAlgorithm, AllreduceAverageAlgorithmImpl
from .async_model_average import AsyncModelAverageAlgorithm, AsyncModelAverageAlgorithmImpl
from .decentralized import DecentralizedAlgorithm, DecentralizedAlgorithmImpl, shift_one_peer
from .gradient_allreduce import GradientAllReduceAlgorithm, GradientAllReduceAlgorithmImpl
from .powersgd import PowerSGDAlgorithm, PowerSGDAlgorithmImpl
from .relay import RelayAlgorithm, RelayAlgorithmImpl

__all__ = [
    "AllreduceAverageAlgorithm",
    "AllreduceAverageAlgorithmImpl",
    "AsyncModelAverageAlgorithm",
    "AsyncModelAverageAlgorithmImpl",
    "DecentralizedAlgorithm",
    "DecentralizedAlgorithmImpl",
    "GradientAllReduceAlgorithm",
    "GradientAllReduceAlgorithmImpl",
    "PowerSGDAlgorithm",
    "PowerSGDAlgorithmImpl",
    "RelayAlgorithm",
    "RelayAlgorithmImpl",
    "shift_one_peer",
]
