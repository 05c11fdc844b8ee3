"""Bagua's contract (algorithms, hooks, communication, launcher) on torch.distributed."""

from . import comm
from .algorithm import Algorithm, AlgorithmImpl, GlobalAlgorithmRegistry
from .bucket import BaguaBucket, BaguaTensor
from .ddp import BaguaDistributedDataParallel, with_bagua

__all__ = [
    "comm",
    "Algorithm",
    "AlgorithmImpl",
    "GlobalAlgorithmRegistry",
    "BaguaBucket",
    "BaguaTensor",
    "BaguaDistributedDataParallel",
    "with_bagua",
]
