"""``bagua.torch_api.algorithms.bytegrad``."""

from bagua_algos.algorithms.bytegrad import ByteGradAlgorithm, ByteGradAlgorithmImpl  # noqa: F401
