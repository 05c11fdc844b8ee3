"""``bagua.torch_api.data_parallel``: Bagua's torch-DDP-like wrapper."""

from .bagua_distributed import BaguaDistributedDataParallel  # noqa: F401
from .distributed import DistributedDataParallel, DistributedDataParallel_V1_9_0  # noqa: F401
from . import functional  # noqa: F401
