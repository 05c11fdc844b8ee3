"""The process transport: the job's processes over torch.distributed, one worker each.

Each method is the implementation in its concern's module (``env``, ``groups``,
``collectives``, ``hierarchical``, ``neighbors``), bound here by name, so the module
that implements a call is the one that documents it; :meth:`ProcessTransport.
neighbor_allreduce` is written here, over the neighbour exchange."""

from __future__ import annotations

import threading

import torch

from . import collectives, env, hierarchical, neighbors
from .groups import (_as_communicator, _get_default_group, group_rank, group_ranks, inter_node_group,
                     intra_node_group)
from .transport import Transport, set_process_transport

__all__ = ["ProcessTransport", "PROCESS_TRANSPORT", "exchange_and_combine"]


def _rank(group=None) -> int:
    """This process's rank in the job, or inside ``group`` (-1 if not a member)."""
    if group is None:
        return env.get_rank()
    env._require_init("get_rank(group)")
    return _as_communicator(group).rank()


def _world_size(group=None) -> int:
    """The number of processes in the job, or in ``group``."""
    if group is None:
        return env.get_world_size()
    env._require_init("get_world_size(group)")
    return _as_communicator(group).nranks()


def _no_peer(peer) -> tuple:
    """Which rows of a peer have none (-1): a peer is an int or a ``[W]`` long tensor."""
    if isinstance(peer, torch.Tensor):
        return tuple(p < 0 for p in peer.tolist())
    return (peer is None or peer < 0,)


class ProcessTransport(Transport):
    """One worker per process: a worker's tensors are its own (``row_dims`` ``()``), a
    rank an int, every collective a torch.distributed call (gloo, NCCL)."""

    row_dims = ()

    is_initialized = staticmethod(env.is_initialized)
    get_rank = staticmethod(_rank)
    get_world_size = staticmethod(_world_size)
    get_local_rank = staticmethod(env.get_local_rank)
    get_local_size = staticmethod(env.get_local_size)
    get_node_rank = staticmethod(env.get_node_rank)
    leads_node = staticmethod(env.leads_node)

    default_group = staticmethod(_get_default_group)
    group_rank = staticmethod(group_rank)
    group_ranks = staticmethod(group_ranks)
    intra_node_group = staticmethod(intra_node_group)
    inter_node_group = staticmethod(inter_node_group)

    allreduce_inplace = staticmethod(collectives.allreduce_inplace)
    allreduce = staticmethod(collectives.allreduce)
    hierarchical_allreduce_inplace = staticmethod(hierarchical.hierarchical_allreduce_inplace)
    broadcast = staticmethod(collectives.broadcast)
    reduce = staticmethod(collectives.reduce)
    reduce_inplace = staticmethod(collectives.reduce_inplace)
    allgather = staticmethod(collectives.allgather)
    allgather_inplace = staticmethod(collectives.allgather_inplace)
    gather = staticmethod(collectives.gather)
    gather_inplace = staticmethod(collectives.gather_inplace)
    scatter = staticmethod(collectives.scatter)
    scatter_inplace = staticmethod(collectives.scatter_inplace)
    reduce_scatter = staticmethod(collectives.reduce_scatter)
    reduce_scatter_inplace = staticmethod(collectives.reduce_scatter_inplace)
    alltoall = staticmethod(collectives.alltoall)
    alltoall_inplace = staticmethod(collectives.alltoall_inplace)
    alltoall_v = staticmethod(collectives.alltoall_v)
    alltoall_v_inplace = staticmethod(collectives.alltoall_v_inplace)
    barrier = staticmethod(collectives.barrier)
    send = staticmethod(collectives.send)
    recv = staticmethod(collectives.recv)
    all_gather_object = staticmethod(neighbors.all_gather_object)
    broadcast_object = staticmethod(neighbors.broadcast_object)

    start_neighbor_exchange = staticmethod(neighbors.start_neighbor_exchange)
    neighbor_exchange = staticmethod(neighbors.neighbor_exchange)

    def __init__(self):
        self._scratch = threading.local()  # per thread: (shape, dtype, device, slots) → receive buffers

    @staticmethod
    def worker_ranks(group=None) -> list:
        """``[this process's rank in group]`` (its one worker)."""
        return [_rank(group)]

    def _received(self, x: torch.Tensor, neighbors: list) -> torch.Tensor:
        """``[W, D, L]`` receive buffers for x's exchange with ``neighbors``, kept per
        thread (an op and the training thread may exchange at once, one thread never
        twice at once) while the shape and the slots without a peer stay the same: those
        slots are never written, so they hold the zeros they were made with."""
        absent = tuple(_no_peer(peer) for peer, _ in neighbors)
        key = (x.shape, x.dtype, x.device, absent)
        kept = getattr(self._scratch, "buffers", None)
        if kept is None or kept[0] != key:
            kept = self._scratch.buffers = (key, x.new_zeros(x.shape[0], len(neighbors), x.shape[1]))
        return kept[1]

    def neighbor_allreduce(self, x, out, self_weight, neighbors, group=None) -> None:
        """out ← self_weight · x + Σ_s weight_s · (x of peer_s), slot by slot in order:
        x (``[W, L]``) is exchanged with every slot's peer (sent to it, its x received),
        then the self term is one product and each slot one multiply-add. ``neighbors``
        are ``(peer, weight)`` pairs: a peer as :func:`start_neighbor_exchange` takes it,
        ``weight`` ``[W, 1]``. ``out`` may be x: the exchange is over before it is
        written. A slot without a peer keeps a zero received, which adds zero."""
        neighbors = list(neighbors)
        exchange_and_combine(self.neighbor_exchange, x, out, self_weight, neighbors, self._received(x, neighbors),
                             group)


def exchange_and_combine(exchange, x, out, self_weight, neighbors: list, received, group=None) -> None:
    """:meth:`ProcessTransport.neighbor_allreduce` over the neighbour exchange ``exchange``
    (a transport's ``neighbor_exchange``), into ``received`` (``[W, D, L]``)."""
    exchange([(peer, x) for peer, _ in neighbors],
             [(peer, received[:, s]) for s, (peer, _) in enumerate(neighbors)], group=group)
    torch.mul(x, self_weight, out=out)
    for s, (_, weight) in enumerate(neighbors):
        out.addcmul_(received[:, s], weight)


PROCESS_TRANSPORT = ProcessTransport()
set_process_transport(PROCESS_TRANSPORT)
