"""``bagua.torch_api`` on bagua-algos: Bagua 0.9's public names."""

from bagua_algos.runtime.comm import (  # noqa: F401
    ReduceOp,
    allgather,
    allgather_inplace,
    allreduce,
    allreduce_inplace,
    alltoall,
    alltoall_inplace,
    alltoall_v,
    alltoall_v_inplace,
    barrier,
    broadcast,
    broadcast_object,
    gather,
    gather_inplace,
    get_local_rank,
    get_local_size,
    get_rank,
    get_world_size,
    init_process_group,
    is_initialized,
    new_group,
    recv,
    reduce,
    reduce_inplace,
    reduce_scatter,
    reduce_scatter_inplace,
    scatter,
    scatter_inplace,
    send,
)
from bagua_algos.runtime.comm import BaguaProcessGroup  # noqa: F401
from bagua_algos.runtime.tensor import BaguaTensor  # noqa: F401
from bagua_algos.runtime.backend import get_backend  # noqa: F401

from . import algorithms, checkpoint, communication, contrib, data_parallel, env  # noqa: F401,E402
from .distributed import BaguaModule  # noqa: F401,E402
from .env import get_node_rank, get_default_bucket_size  # noqa: F401,E402
