"""``bagua.torch_api.data_parallel.bagua_distributed``."""

from bagua_algos.runtime.ddp import BaguaDistributedDataParallel  # noqa: F401
