"""``bagua.torch_api.algorithms.base``."""

from bagua_algos.runtime.algorithm import Algorithm, AlgorithmImpl, GlobalAlgorithmRegistry  # noqa: F401

__all__ = ["Algorithm", "AlgorithmImpl"]
