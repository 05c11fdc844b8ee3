"""Bagua's reduction operators, their torch counterparts, and AVG where the backend
has none (gloo; NCCL for integers): a SUM, then a division on completion."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from .groups import BaguaCommunicator


class ReduceOp(enum.IntEnum):
    """Reduction operators, numbered as in Bagua."""

    SUM = 0
    PRODUCT = 1
    MIN = 2
    MAX = 3
    BOR = 7
    BAND = 8
    BXOR = 9
    AVG = 10


_TORCH_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.BOR: dist.ReduceOp.BOR,
    ReduceOp.BAND: dist.ReduceOp.BAND,
    ReduceOp.BXOR: dist.ReduceOp.BXOR,
}
_BITWISE_OPS = (ReduceOp.BOR, ReduceOp.BAND, ReduceOp.BXOR)

# torch's own names, for the functions of Bagua's API whose signatures use them
# (bagua.torch_api.data_parallel.functional.all_reduce: op=dist.ReduceOp.SUM).
TORCH_SUM = dist.ReduceOp.SUM


def from_torch_reduce_op(op) -> ReduceOp:
    """Bagua's operator for torch's ``ReduceOp.SUM`` or ``ReduceOp.MAX`` (the two Bagua maps)."""
    if op == dist.ReduceOp.SUM:
        return ReduceOp.SUM
    if op == dist.ReduceOp.MAX:
        return ReduceOp.MAX
    raise ValueError(f"op must be torch.distributed.ReduceOp.SUM or MAX, got {op!r}")


def _op_and_finish(op: ReduceOp, c: "BaguaCommunicator", out: torch.Tensor):
    """The torch op to run and the finishers that complete ``op`` on ``out``."""
    if op != ReduceOp.AVG:
        return _TORCH_OPS[op], []
    if c.uses_nccl(out) and (out.is_floating_point() or out.is_complex()):
        return dist.ReduceOp.AVG, []  # NCCL's own; its integer AVG truncates, Bagua's floors
    return dist.ReduceOp.SUM, [_divider(out, c.nranks())]


def _divider(t: torch.Tensor, size: int):
    """The finisher of an emulated AVG: ``t`` ← ``t`` / ``size`` (floored for integers, as Bagua)."""
    if t.is_floating_point() or t.is_complex():
        return lambda: t.div_(size)
    return lambda: t.div_(size, rounding_mode="floor")
