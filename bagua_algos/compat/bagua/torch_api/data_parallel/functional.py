"""``bagua.torch_api.data_parallel.functional``: an allreduce that autograd differentiates."""

from __future__ import annotations

import torch

from bagua_algos.runtime import comm as _comm
from bagua_algos.runtime.comm import ReduceOp  # noqa: F401 - Bagua defines it here too
from bagua_algos.runtime.comm.groups import is_torch_world
from bagua_algos.runtime.comm.reduce_op import TORCH_SUM, from_torch_reduce_op

__all__ = ["ReduceOp", "all_reduce", "torch_reduce_op_to_bagua"]


torch_reduce_op_to_bagua = from_torch_reduce_op  # Bagua's name: torch's SUM / MAX as Bagua's


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


def all_reduce(tensor, op=TORCH_SUM, group=None):
    """Bagua's ``all_reduce(tensor, op=SUM, group=WORLD)``: a new tensor holding the
    reduction over the group; its gradient is the same allreduce of the output's."""
    if is_torch_world(group):
        group = None
    return _AllReduce.apply(op, group, tensor)
