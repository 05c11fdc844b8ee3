"""``bagua.torch_api.communication`` on bagua-algos (torch.distributed underneath)."""

from bagua_algos.runtime.comm import *  # noqa: F401,F403
from bagua_algos.runtime.comm import _get_default_group  # noqa: F401
from bagua_algos.runtime.backend import get_backend  # noqa: F401
import torch

from bagua_algos.runtime import comm as _comm


class _GroupRanks:
    """Bagua's ``_pg_group_ranks``: group → {global rank: rank in the group}."""

    def __getitem__(self, group):
        return {g: r for r, g in enumerate(_comm.group_ranks(group))}

    def __contains__(self, group) -> bool:
        return True


_pg_group_ranks = _GroupRanks()


def _rank_not_in_group(group) -> bool:
    return group is not None and _comm.group_rank(group) < 0


def broadcast_coalesced(tensors, src: int = 0, comm=None):
    """Bagua's ``broadcast_coalesced``: :func:`broadcast` of several tensors as one buffer."""
    _coalesced(tensors, lambda flat: _comm.broadcast(flat, src, comm))


def allreduce_coalesced_inplace(tensors, op=_comm.ReduceOp.SUM, comm=None):
    """Bagua's ``allreduce_coalesced_inplace``: :func:`allreduce_inplace` of several
    tensors (one dtype) as one buffer."""
    _coalesced(tensors, lambda flat: _comm.allreduce_inplace(flat, op, comm))


def _coalesced(tensors, collective) -> None:
    """``collective`` on the tensors packed in one buffer, the results copied back."""
    tensors = list(tensors)
    if not tensors:
        return
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    collective(flat)
    offset = 0
    with torch.no_grad():
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
