"""The min-max scatter-gather over a process group: the stages of
:mod:`bagua_algos.compression.scatter_gather` run over the group's collectives (a
bucket's compressed reduction: the MinMaxUInt8 centralized op, TernGrad, DiLoCo's
compressed outer step)."""

from __future__ import annotations

import torch

from ...compression.scatter_gather import scatter_gather
from .. import comm

__all__ = ["compressed_scatter_gather"]


def compressed_scatter_gather(
    flat: torch.Tensor,
    bits: int,
    average: bool,
    group,
    stochastic: bool = False,
    generator=None,
) -> torch.Tensor:
    """Reduce ``flat`` over ``group`` in place through the min-max codec (Bagua's
    compressed scatter-gather), returning the decoded values of what this worker sent
    in the first stage, D(Q(c_j)) (for error feedback), shaped as ``flat``: the
    stages, bounds and stacked form are
    :func:`bagua_algos.compression.scatter_gather.scatter_gather`'s, run here over
    ``group``'s all-to-all and all-gather (on the one-process engine, a stacked group,
    the engine's transport's row moves). ``flat``: ``[W, L]``, a row per worker (or
    a lone worker's ``[L]``). ``generator``: the stochastic rounding's generators, one
    per row (a lone torch.Generator for one row).
    """
    return scatter_gather(
        flat, bits, average, n=comm.get_world_size(group),
        alltoall=lambda send, recv: comm.alltoall(send, recv, group=group),
        allgather=lambda send, recv: comm.allgather(send, recv, group=group),
        ranks=lambda: comm.group_ranks(group), stochastic=stochastic, generator=generator)
