"""Allreduce in two levels: within each node, then across nodes."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .checks import _check_tensor, _reduce_op
from .counter import _count, _nbytes
from .env import _require_init, get_local_size, get_rank, get_world_size
from .groups import BaguaCommunicator, NodeGroups, _get_default_group, _new_torch_group
from .handle import _finish
from .helper_thread import _submit
from .reduce_op import ReduceOp, _divider
from .staging import _Staging


def _hierarchical_groups() -> NodeGroups:
    """The default group's node communicators, with ``hierarchical_inter`` set: for the
    helper thread alone, a private copy of the inter-node groups (created collectively
    on first use)."""
    node = _get_default_group()._node_groups()
    if node.hierarchical_inter is None:
        local, me = get_local_size(), get_rank()
        if local == 1 or local == get_world_size():
            # One level is trivial; the other is posted from the caller's thread only.
            node.hierarchical_inter = node.by_local_rank[me % local]
        else:
            for lr in range(local):
                g = _new_torch_group(range(lr, get_world_size(), local))
                if lr == me % local:
                    node.hierarchical_inter = BaguaCommunicator(g, range(lr, get_world_size(), local),
                                                                f"default/hierarchical-inter{lr}")
    return node


def hierarchical_allreduce_inplace(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, *, async_op: bool = False):
    """Allreduce over all workers in two levels: within each node, then across nodes
    between processes of equal local rank (each then holds the global result).

    Only SUM and AVG (a sum divided by the world size) are two-level reductions here.
    With ``async_op=True`` it returns at once: the intra-node allreduce is posted here
    and, on gloo, a helper thread posts the inter-node one (on groups of its own, in
    submission order) when the first completes; on NCCL both are posted here, ordered
    by CUDA streams.
    """
    _require_init("hierarchical_allreduce_inplace()")
    _check_tensor("tensor", tensor)
    op = _reduce_op(op, tensor)
    if op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise ValueError(f"hierarchical allreduce supports ReduceOp.SUM and ReduceOp.AVG, got ReduceOp.{op.name}")
    node = _hierarchical_groups()
    intra, inter = node.intra, node.hierarchical_inter
    finishers = [_divider(tensor, get_world_size())] if op == ReduceOp.AVG else []
    _count(_nbytes(tensor) * ((intra.nranks() > 1) + (inter.nranks() > 1)))
    st = _Staging(intra)
    buf = st(tensor, write=True)
    if intra.nranks() == 1 or inter.nranks() == 1:
        level = inter if intra.nranks() == 1 else intra
        works = [None if level.nranks() == 1 else
                 dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=level.torch_group, async_op=True)]
    elif intra.uses_nccl(buf):
        first = dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=intra.torch_group, async_op=True)
        first.wait()  # orders the CUDA streams; the CPU does not block
        works = [dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=inter.torch_group, async_op=True)]
    else:
        first = dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=intra.torch_group, async_op=True)

        def second():
            first.wait()
            dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=inter.torch_group, async_op=True).wait()

        works = [_submit(second)]
    return _finish(st.handle(works, finishers), async_op)
