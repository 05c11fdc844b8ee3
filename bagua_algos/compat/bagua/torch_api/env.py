"""``bagua.torch_api.env``: this worker's place in the job, from the environment."""

import os

from bagua_algos.runtime.comm import get_local_rank, get_local_size, get_rank, get_world_size  # noqa: F401
from bagua_algos.runtime.bucket import DEFAULT_BUCKET_SIZE


def get_node_rank() -> int:
    """NODE_RANK when the launcher set it, else the global rank over the local size."""
    if "NODE_RANK" in os.environ:
        return int(os.environ["NODE_RANK"])
    return get_rank() // get_local_size()


def get_default_bucket_size() -> int:
    """BAGUA_DEFAULT_BUCKET_SIZE, else 10 MiB."""
    return int(os.environ.get("BAGUA_DEFAULT_BUCKET_SIZE", DEFAULT_BUCKET_SIZE))


def get_autotune_level() -> int:
    """Bagua's autotune service is not part of bagua-algos: always 0 (off)."""
    return 0


def get_master_addr() -> str:
    return os.environ.get("MASTER_ADDR", "127.0.0.1")
