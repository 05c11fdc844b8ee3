"""``bagua.torch_api.algorithms.q_adam``."""

from bagua_algos.algorithms.q_adam import QAdamAlgorithm, QAdamAlgorithmImpl, QAdamOptimizer  # noqa: F401
