"""``bagua.torch_api.algorithms``: Bagua's algorithm classes and registry."""

from .base import Algorithm, AlgorithmImpl, GlobalAlgorithmRegistry  # noqa: F401
from . import async_model_average, bytegrad, decentralized, gradient_allreduce, q_adam  # noqa: F401
