"""What several ops share: Bagua's hierarchical pattern (reduce within the node, the
leader works, broadcast back), whether a group is the whole job, a Bagua tensor's
effective tensor, and the bit width of Bagua's MinMaxUInt8 compression."""

from __future__ import annotations

import torch

from .. import comm

__all__ = ["MINMAX_UINT8_BITS", "within_nodes"]

MINMAX_UINT8_BITS = 8  # Bagua's MinMaxUInt8: 256 levels between a chunk's min and max


def within_nodes(x: torch.Tensor, leader_work, intra=None, is_leader: bool = True,
                 op=comm.ReduceOp.AVG) -> None:
    """Bagua's hierarchical pattern on ``x``, in place: reduce it within the node
    (``op`` over ``intra``), let the node leader run ``leader_work(x)``, broadcast the
    leader's ``x`` back within the node. ``intra=None`` (not hierarchical): only
    ``leader_work(x)``, where ``is_leader``. A node of one process skips its
    collectives, which would change nothing."""
    within = intra is not None and intra.nranks() > 1
    if within:
        comm.allreduce_inplace(x, op, group=intra)
    if is_leader:
        leader_work(x)
    if within:
        comm.broadcast(x, src=comm.get_node_rank() * comm.get_local_size(), group=intra)


def is_whole_world(group) -> bool:
    """Whether ``group`` holds every worker of the job (None: the default group)."""
    return group is None or comm.group_ranks(group) == list(range(comm.get_world_size()))


def effective(tensor: torch.Tensor) -> torch.Tensor:
    """A Bagua tensor's effective tensor (its getter closure's), any other tensor itself."""
    if hasattr(tensor, "is_bagua_tensor") and tensor.is_bagua_tensor():
        return tensor.bagua_getter_closure()
    return tensor
