"""``bagua.torch_api.algorithms.async_model_average``."""

from bagua_algos.algorithms.async_model_average import (  # noqa: F401
    AsyncModelAverageAlgorithm,
    AsyncModelAverageAlgorithmImpl,
)
