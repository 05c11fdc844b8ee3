"""``comm``'s calls: Bagua's names, each answered by the transport the call is on.

Every call picks its transport (:func:`~.transport.transport_for`: a transport named as
``comm=`` / ``group=``, else the one current on this thread, else the process
transport) and hands it the call's own arguments. Each call's documentation is its
process implementation's (in ``collectives``, ``env``, ``groups``, ``hierarchical``,
``neighbors``), copied onto it below."""

from __future__ import annotations

import torch

from .process import PROCESS_TRANSPORT
from .reduce_op import ReduceOp
from .transport import current_transport, transport_for

SUM = ReduceOp.SUM


# --- the environment ------------------------------------------------------------------
def is_initialized() -> bool:
    return current_transport().is_initialized()


def get_rank(group=None):
    return transport_for(None, group).get_rank(group)


def get_world_size(group=None) -> int:
    return transport_for(None, group).get_world_size(group)


def get_local_rank():
    return current_transport().get_local_rank()


def get_local_size() -> int:
    return current_transport().get_local_size()


def get_node_rank() -> int:
    return current_transport().get_node_rank()


def leads_node() -> bool:
    return current_transport().leads_node()


# --- groups -------------------------------------------------------------------------------
def _get_default_group():
    return current_transport().default_group()


def group_rank(group):
    return transport_for(None, group).group_rank(group)


def group_ranks(group) -> list:
    return transport_for(None, group).group_ranks(group)


def worker_ranks(group=None) -> list:
    """The ranks in ``group`` (default: the job) of the workers whose rows this
    process's tensors hold, in row order: ``[its rank]`` in a process, every rank on
    the one-process engine."""
    return transport_for(None, group).worker_ranks(group)


def intra_node_group():
    return current_transport().intra_node_group()


def inter_node_group():
    return current_transport().inter_node_group()


# --- collectives --------------------------------------------------------------------------
def allreduce_inplace(tensor: torch.Tensor, op: ReduceOp = SUM, comm=None, *, group=None, async_op: bool = False):
    return transport_for(comm, group).allreduce_inplace(tensor, op, comm, group=group, async_op=async_op)


def allreduce(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, op: ReduceOp = SUM, comm=None, *, group=None,
              async_op: bool = False):
    return transport_for(comm, group).allreduce(send_tensor, recv_tensor, op, comm, group=group, async_op=async_op)


def hierarchical_allreduce_inplace(tensor: torch.Tensor, op: ReduceOp = SUM, *, async_op: bool = False):
    return current_transport().hierarchical_allreduce_inplace(tensor, op, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int = 0, comm=None, *, group=None, async_op: bool = False):
    return transport_for(comm, group).broadcast(tensor, src, comm, group=group, async_op=async_op)


def reduce(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, dst: int, op: ReduceOp = SUM, comm=None, *,
           group=None, async_op: bool = False):
    return transport_for(comm, group).reduce(send_tensor, recv_tensor, dst, op, comm, group=group, async_op=async_op)


def reduce_inplace(tensor: torch.Tensor, dst: int, op: ReduceOp = SUM, comm=None, *, group=None,
                   async_op: bool = False):
    return transport_for(comm, group).reduce_inplace(tensor, dst, op, comm, group=group, async_op=async_op)


def allgather(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, comm=None, *, group=None, async_op: bool = False):
    return transport_for(comm, group).allgather(send_tensor, recv_tensor, comm, group=group, async_op=async_op)


def allgather_inplace(tensor: torch.Tensor, comm=None, *, group=None, async_op: bool = False):
    return transport_for(comm, group).allgather_inplace(tensor, comm, group=group, async_op=async_op)


def gather(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, dst: int, comm=None, *, group=None,
           async_op: bool = False):
    return transport_for(comm, group).gather(send_tensor, recv_tensor, dst, comm, group=group, async_op=async_op)


def gather_inplace(tensor: torch.Tensor, count: int, dst: int, comm=None, *, group=None, async_op: bool = False):
    return transport_for(comm, group).gather_inplace(tensor, count, dst, comm, group=group, async_op=async_op)


def scatter(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, src: int, comm=None, *, group=None,
            async_op: bool = False):
    return transport_for(comm, group).scatter(send_tensor, recv_tensor, src, comm, group=group, async_op=async_op)


def scatter_inplace(tensor: torch.Tensor, count: int, src: int, comm=None, *, group=None, async_op: bool = False):
    return transport_for(comm, group).scatter_inplace(tensor, count, src, comm, group=group, async_op=async_op)


def reduce_scatter(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, op: ReduceOp = SUM, comm=None, *,
                   group=None, async_op: bool = False):
    return transport_for(comm, group).reduce_scatter(send_tensor, recv_tensor, op, comm, group=group,
                                                     async_op=async_op)


def reduce_scatter_inplace(tensor: torch.Tensor, op: ReduceOp = SUM, comm=None, *, group=None, async_op: bool = False):
    return transport_for(comm, group).reduce_scatter_inplace(tensor, op, comm, group=group, async_op=async_op)


def alltoall(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, comm=None, *, group=None, async_op: bool = False):
    return transport_for(comm, group).alltoall(send_tensor, recv_tensor, comm, group=group, async_op=async_op)


def alltoall_inplace(tensor: torch.Tensor, comm=None, *, group=None, async_op: bool = False):
    return transport_for(comm, group).alltoall_inplace(tensor, comm, group=group, async_op=async_op)


def alltoall_v(send_tensor: torch.Tensor, send_counts, send_displs, recv_tensor: torch.Tensor, recv_counts,
               recv_displs, comm=None, *, group=None, async_op: bool = False):
    return transport_for(comm, group).alltoall_v(send_tensor, send_counts, send_displs, recv_tensor, recv_counts,
                                                 recv_displs, comm, group=group, async_op=async_op)


def alltoall_v_inplace(tensor: torch.Tensor, counts, displs, comm=None, *, group=None, async_op: bool = False):
    return transport_for(comm, group).alltoall_v_inplace(tensor, counts, displs, comm, group=group, async_op=async_op)


def barrier(comm=None, *, group=None, async_op: bool = False):
    return transport_for(comm, group).barrier(comm, group=group, async_op=async_op)


def send(tensor: torch.Tensor, dst: int, comm=None, *, group=None, async_op: bool = False):
    return transport_for(comm, group).send(tensor, dst, comm, group=group, async_op=async_op)


def recv(tensor: torch.Tensor, src: int, comm=None, *, group=None, async_op: bool = False):
    return transport_for(comm, group).recv(tensor, src, comm, group=group, async_op=async_op)


def all_gather_object(obj, comm=None, *, group=None) -> list:
    return transport_for(comm, group).all_gather_object(obj, comm, group=group)


def broadcast_object(obj, src: int = 0, comm=None, *, group=None):
    return transport_for(comm, group).broadcast_object(obj, src, comm, group=group)


# --- between neighbours -----------------------------------------------------------------
def start_neighbor_exchange(sends, recvs, group=None):
    return transport_for(None, group).start_neighbor_exchange(sends, recvs, group)


def neighbor_exchange(sends, recvs, group=None) -> None:
    return transport_for(None, group).neighbor_exchange(sends, recvs, group)


def neighbor_allreduce(x: torch.Tensor, out: torch.Tensor, self_weight: torch.Tensor, neighbors, group=None) -> None:
    return transport_for(None, group).neighbor_allreduce(x, out, self_weight, neighbors, group)


CALLS = ("is_initialized", "get_rank", "get_world_size", "get_local_rank", "get_local_size", "get_node_rank",
         "leads_node", "group_rank", "group_ranks", "worker_ranks", "intra_node_group", "inter_node_group", "allreduce_inplace",
         "allreduce", "hierarchical_allreduce_inplace", "broadcast", "reduce", "reduce_inplace", "allgather",
         "allgather_inplace", "gather", "gather_inplace", "scatter", "scatter_inplace", "reduce_scatter",
         "reduce_scatter_inplace", "alltoall", "alltoall_inplace", "alltoall_v", "alltoall_v_inplace", "barrier",
         "send", "recv", "all_gather_object", "broadcast_object", "start_neighbor_exchange", "neighbor_exchange",
         "neighbor_allreduce")
"""The calls a transport answers (each a method of :class:`~.transport.Transport` of the
same name; a test holds the two lists equal)."""

for _name in CALLS:
    if globals()[_name].__doc__ is None:
        globals()[_name].__doc__ = getattr(PROCESS_TRANSPORT, _name).__doc__
_get_default_group.__doc__ = PROCESS_TRANSPORT.default_group.__doc__
del _name
