"""``bagua.torch_api.data_parallel.functional``: an allreduce that autograd differentiates."""

from __future__ import annotations

import torch
import torch.distributed as dist

from bagua_algos.runtime import comm as _comm
from bagua_algos.runtime.comm import ReduceOp  # noqa: F401 - Bagua defines it here too

__all__ = ["ReduceOp", "all_reduce", "torch_reduce_op_to_bagua"]


def torch_reduce_op_to_bagua(op):
    """torch's ``ReduceOp.SUM`` / ``MAX`` as Bagua's (the two Bagua maps)."""
    if op == dist.ReduceOp.SUM:
        return ReduceOp.SUM
    if op == dist.ReduceOp.MAX:
        return ReduceOp.MAX
    raise ValueError(f"op must be torch.distributed.ReduceOp.SUM or MAX, got {op!r}")


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, group, tensor):
        ctx.op, ctx.group = op, group
        out = tensor.clone().contiguous()
        _comm.allreduce_inplace(out, torch_reduce_op_to_bagua(op), group=group)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        return None, None, _AllReduce.apply(ctx.op, ctx.group, grad_output)


def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None):
    """Bagua's ``all_reduce(tensor, op=SUM, group=WORLD)``: a new tensor holding the
    reduction over the group; its gradient is the same allreduce of the output's."""
    if group is dist.group.WORLD:
        group = None
    return _AllReduce.apply(op, group, tensor)
