"""Bagua's reduction operators and their torch counterparts."""

from __future__ import annotations

import enum

import torch.distributed as dist


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


def is_torch_world(group) -> bool:
    """Whether ``group`` is torch's ``dist.group.WORLD`` (the default group)."""
    return group is dist.group.WORLD
