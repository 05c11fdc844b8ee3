"""``bagua.torch_api.algorithms.q_adam`` (needs the MinMaxUInt8 codec: not available yet)."""

from bagua_algos.algorithms.unavailable import QAdamAlgorithm, QAdamOptimizer  # noqa: F401
