"""Bagua's contract (algorithms, hooks, tensors, buckets, communication) on
torch.distributed."""

from . import comm
from . import tensor as _tensor  # noqa: F401  (patches Bagua's tensor methods onto torch.Tensor)
from .algorithm import Algorithm, AlgorithmImpl, GlobalAlgorithmRegistry
from .backend import BaguaBackend, CommOpError, get_backend
from .bucket import BaguaBucket
from .ddp import BaguaDistributedDataParallel, with_bagua
from .tensor import BaguaTensor

__all__ = [
    "comm",
    "Algorithm",
    "AlgorithmImpl",
    "GlobalAlgorithmRegistry",
    "BaguaBackend",
    "CommOpError",
    "get_backend",
    "BaguaBucket",
    "BaguaTensor",
    "BaguaDistributedDataParallel",
    "with_bagua",
]
