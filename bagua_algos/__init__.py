"""bagua-algos: decentralized and compressed data-parallel training algorithms written to
Bagua's programming model, on torch.distributed.

Use it as Bagua's ``bagua.torch_api``::

    import bagua_algos as bagua
    from bagua_algos.algorithms import GradientAllReduceAlgorithm

    bagua.init_process_group()
    model = model.with_bagua([optimizer], GradientAllReduceAlgorithm())
"""

from .runtime.algorithm import Algorithm, AlgorithmImpl, GlobalAlgorithmRegistry
# Bagua's communication and env names (bagua.torch_api's), and this package's own besides
# (_OWN_COMMUNICATION_NAMES): the one list of them, which the compatibility package's
# bagua.torch_api exports too (BAGUA_COMMUNICATION_NAMES, derived below)
from .runtime import comm as _comm
from .runtime.comm import (
    BaguaProcessGroup,
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
    destroy_process_group,
    gather,
    gather_inplace,
    get_local_rank,
    get_local_size,
    get_node_rank,
    get_rank,
    get_world_size,
    init_process_group,
    is_initialized,
    neighbor_exchange,
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
# under torchft a script's rank and world size are its replica's slot among the job's
# (the collectives run over the live quorum: runtime/comm/fault_tolerance.py)
from .runtime.comm.fault_tolerance import job_rank as get_rank, job_world_size as get_world_size  # noqa: E402,F811

# Bagua has no neighbour exchange, and its env module has a node rank of its own
_OWN_COMMUNICATION_NAMES = ("destroy_process_group", "get_node_rank", "neighbor_exchange")
# the names imported above from comm, less this package's own, in comm's order: what the
# compatibility package's bagua.torch_api exports, with the values they have here
BAGUA_COMMUNICATION_NAMES = tuple(name for name in _comm.__all__
                                  if name in globals() and name not in _OWN_COMMUNICATION_NAMES)

from .runtime.ddp import with_bagua
from .runtime.checkpoint import load_checkpoint, resume_from_checkpoint, save_checkpoint
from . import algorithms  # noqa: E402,F401  (registers the algorithms)

__version__ = "0.1.0"
