"""``bagua.torch_api.algorithms.decentralized``."""

from bagua_algos.algorithms.decentralized import DecentralizedAlgorithm, DecentralizedAlgorithmImpl  # noqa: F401
from bagua_algos.algorithms.low_precision_decentralized import (  # noqa: F401
    LowPrecisionDecentralizedAlgorithm,
    LowPrecisionDecentralizedAlgorithmImpl,
)
