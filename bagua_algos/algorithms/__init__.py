"""The algorithms; importing this package registers each under its Bagua name."""

from .allreduce_average import AllreduceAverageAlgorithm, AllreduceAverageAlgorithmImpl
from .async_model_average import AsyncModelAverageAlgorithm, AsyncModelAverageAlgorithmImpl
from .atomo import AtomoAlgorithm
from .bytegrad import ByteGradAlgorithm, ByteGradAlgorithmImpl
from .d2 import D2Algorithm, D2AlgorithmImpl
from .decentralized import DecentralizedAlgorithm, DecentralizedAlgorithmImpl, shift_one_peer
from .demo import DeMoAlgorithm, DeMoAlgorithmImpl
from .diloco import DiLoCoAlgorithm, DiLoCoAlgorithmImpl
from .gradient_allreduce import GradientAllReduceAlgorithm, GradientAllReduceAlgorithmImpl
from .gradient_tracking import GradientTrackingAlgorithm, GradientTrackingAlgorithmImpl
from .low_precision_decentralized import LowPrecisionDecentralizedAlgorithm, LowPrecisionDecentralizedAlgorithmImpl
from .q_adam import QAdamAlgorithm, QAdamAlgorithmImpl, QAdamOptimizer
from .powersgd import PowerSGDAlgorithm, PowerSGDAlgorithmImpl
from .random_block import RandomBlockAlgorithm
from .random_k import RandomKAlgorithm
from .random_sketch import RandomSketchAlgorithm, RandomSketchAlgorithmImpl
from .relay import RelayAlgorithm, RelayAlgorithmImpl
from .relaysum_grad import RelaySumGradAlgorithm, RelaySumGradAlgorithmImpl
from .sgp import SGPAlgorithm, SGPAlgorithmImpl
from .sign_norm import SignNormAlgorithm
from .sparseloco import SparseLoCoAlgorithm, SparseLoCoAlgorithmImpl
from .sparta import SpartaAlgorithm, SpartaAlgorithmImpl
from .signum import SignumAlgorithm
from .terngrad import TernGradAlgorithm, TernGradAlgorithmImpl
from .unbiased_low_rank import UnbiasedLowRankAlgorithm
from .top_k import TopKAlgorithm

__all__ = [
    "AllreduceAverageAlgorithm",
    "AllreduceAverageAlgorithmImpl",
    "AsyncModelAverageAlgorithm",
    "AsyncModelAverageAlgorithmImpl",
    "AtomoAlgorithm",
    "ByteGradAlgorithm",
    "ByteGradAlgorithmImpl",
    "D2Algorithm",
    "D2AlgorithmImpl",
    "DecentralizedAlgorithm",
    "DeMoAlgorithm",
    "DeMoAlgorithmImpl",
    "DiLoCoAlgorithm",
    "DiLoCoAlgorithmImpl",
    "DecentralizedAlgorithmImpl",
    "GradientAllReduceAlgorithm",
    "GradientAllReduceAlgorithmImpl",
    "GradientTrackingAlgorithm",
    "GradientTrackingAlgorithmImpl",
    "LowPrecisionDecentralizedAlgorithm",
    "LowPrecisionDecentralizedAlgorithmImpl",
    "QAdamAlgorithm",
    "QAdamAlgorithmImpl",
    "QAdamOptimizer",
    "PowerSGDAlgorithm",
    "PowerSGDAlgorithmImpl",
    "RandomBlockAlgorithm",
    "RandomKAlgorithm",
    "RandomSketchAlgorithm",
    "RandomSketchAlgorithmImpl",
    "RelayAlgorithm",
    "RelayAlgorithmImpl",
    "RelaySumGradAlgorithm",
    "RelaySumGradAlgorithmImpl",
    "SGPAlgorithm",
    "SGPAlgorithmImpl",
    "SignNormAlgorithm",
    "SignumAlgorithm",
    "SparseLoCoAlgorithm",
    "SparseLoCoAlgorithmImpl",
    "SpartaAlgorithm",
    "SpartaAlgorithmImpl",
    "TernGradAlgorithm",
    "TernGradAlgorithmImpl",
    "UnbiasedLowRankAlgorithm",
    "TopKAlgorithm",
    "shift_one_peer",
]
