"""``bagua.torch_api.env``: this worker's place in the job, from the environment."""

import os

from bagua_algos.runtime.comm import get_local_rank, get_local_size, get_rank, get_world_size  # noqa: F401
# under torchft, the replica's slot among the job's (runtime/comm/fault_tolerance.py)
from bagua_algos.runtime.comm.fault_tolerance import job_rank as get_rank  # noqa: F401,F811
from bagua_algos.runtime.comm.fault_tolerance import job_world_size as get_world_size  # noqa: F401,F811
from bagua_algos.runtime.bucket import default_bucket_size as get_default_bucket_size  # noqa: F401


def get_node_rank() -> int:
    """NODE_RANK when the launcher set it (static rendezvous), else torchrun's GROUP_RANK
    (c10d numbers the nodes at each rendezvous), else the global rank over the local size."""
    for name in ("NODE_RANK", "GROUP_RANK"):
        if name in os.environ:
            return int(os.environ[name])
    return get_rank() // get_local_size()


def get_autotune_level() -> int:
    """Bagua's autotune service is not part of bagua-algos: always 0 (off)."""
    return 0


def get_master_addr() -> str:
    return os.environ.get("MASTER_ADDR", "127.0.0.1")
