"""``bagua.torch_api.algorithms.bytegrad`` (needs the MinMaxUInt8 codec: not available yet)."""

from bagua_algos.algorithms.unavailable import ByteGradAlgorithm  # noqa: F401
