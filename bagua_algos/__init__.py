"""bagua-algos: decentralized and compressed data-parallel training algorithms written to
Bagua's programming model, on torch.distributed.

Use it as Bagua's ``bagua.torch_api``::

    import bagua_algos as bagua
    from bagua_algos.algorithms import GradientAllReduceAlgorithm

    bagua.init_process_group()
    model = model.with_bagua([optimizer], GradientAllReduceAlgorithm())
"""

from .runtime.algorithm import Algorithm, AlgorithmImpl, GlobalAlgorithmRegistry
from .runtime.comm import (
    ReduceOp,
    allgather,
    allreduce,
    allreduce_inplace,
    barrier,
    broadcast,
    destroy_process_group,
    get_local_rank,
    get_local_size,
    get_rank,
    get_world_size,
    init_process_group,
    is_initialized,
    neighbor_exchange,
    new_group,
    recv,
    reduce_scatter,
    send,
)
from .runtime.ddp import with_bagua
from . import algorithms  # noqa: E402,F401  (registers the algorithms)

__version__ = "0.1.0"
