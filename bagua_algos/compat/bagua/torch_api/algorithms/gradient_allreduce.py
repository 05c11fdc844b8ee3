"""``bagua.torch_api.algorithms.gradient_allreduce``."""

from bagua_algos.algorithms.gradient_allreduce import (  # noqa: F401
    GradientAllReduceAlgorithm,
    GradientAllReduceAlgorithmImpl,
)
