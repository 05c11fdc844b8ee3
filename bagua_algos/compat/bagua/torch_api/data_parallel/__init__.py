"""``bagua.torch_api.data_parallel``."""

from .bagua_distributed import BaguaDistributedDataParallel  # noqa: F401
