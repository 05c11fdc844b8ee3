"""Process group and collectives with Bagua's names, on torch.distributed.

This module is the only code in the project that calls ``torch.distributed``. Its
names follow ``bagua.torch_api.communication`` (``init_process_group``, ``allreduce``,
``allreduce_inplace``, ``ReduceOp``, ...). Where Bagua takes a ``comm`` communicator,
these functions take ``group``: a process group from :func:`new_group`, or ``None`` for
the global one.

Collectives accept ``async_op=True`` and then return a :class:`CommHandle` whose
``wait()`` also finishes whatever the backend cannot do itself (gloo has no AVG: the
sum is divided on completion).
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = [
    "ReduceOp",
    "CommHandle",
    "init_process_group",
    "destroy_process_group",
    "is_initialized",
    "get_backend",
    "get_rank",
    "get_world_size",
    "get_local_rank",
    "get_local_size",
    "get_node_rank",
    "new_group",
    "group_rank",
    "group_ranks",
    "intra_node_group",
    "inter_node_group",
    "allreduce",
    "allreduce_inplace",
    "hierarchical_allreduce_inplace",
    "broadcast",
    "allgather",
    "reduce_scatter",
    "send",
    "recv",
    "barrier",
    "neighbor_exchange",
    "start_neighbor_exchange",
]

DEFAULT_TIMEOUT = timedelta(minutes=10)


# torch 2.14 renamed the *_tensor collectives to *_single (and warns on the old names).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


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


class CommHandle:
    """A pending communication; ``wait()`` blocks until it is done and runs the finishers.

    Finishers are callables run once, in order, after every underlying work completed
    (e.g. dividing a sum by the group size to emulate AVG).
    """

    def __init__(self, works=(), finishers=()):
        self._works = [w for w in works if w is not None]
        self._finishers = list(finishers)
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        for work in self._works:
            work.wait()
        for finish in self._finishers:
            finish()
        self._done = True

    def then(self, finisher) -> "CommHandle":
        """Run ``finisher()`` after the others once the communication is done."""
        if self._done:
            finisher()
        else:
            self._finishers.append(finisher)
        return self

    @property
    def done(self) -> bool:
        return self._done


def _finish(handle: CommHandle, async_op: bool):
    if async_op:
        return handle
    handle.wait()
    return None


# --------------------------------------------------------------------------- groups

_node_groups: dict[str, object] = {}


def _env_int(name: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise RuntimeError(
                f"environment variable {name} is not set; start the workers with "
                "`python -m bagua_algos.launch` or torchrun, or set RANK, WORLD_SIZE, "
                "MASTER_ADDR and MASTER_PORT yourself"
            )
        return default
    try:
        return int(value)
    except ValueError:
        raise RuntimeError(f"environment variable {name}={value!r} is not an integer") from None


def init_process_group(
    backend: str | None = None,
    timeout: timedelta | float | None = None,
    store: dist.Store | None = None,
    rank: int | None = None,
    world_size: int | None = None,
) -> None:
    """Join the global process group, like ``bagua.init_process_group()``.

    Without ``store`` it rendezvous through ``env://``: RANK, WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT (LOCAL_RANK and LOCAL_WORLD_SIZE are read when present). The backend is
    NCCL when CUDA is available, else gloo. ``timeout`` (a timedelta or seconds) bounds
    every wait on a peer, so a dead peer becomes an error instead of a hang.
    """
    if dist.is_initialized():
        raise RuntimeError("init_process_group() was called twice in this process")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if timeout is None:
        timeout = DEFAULT_TIMEOUT
    elif not isinstance(timeout, timedelta):
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds or a timedelta, got {timeout!r}")
        timeout = timedelta(seconds=float(timeout))
    if store is None:
        rank = _env_int("RANK") if rank is None else rank
        world_size = _env_int("WORLD_SIZE") if world_size is None else world_size
        _env_int("MASTER_PORT")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    elif rank is None or world_size is None:
        raise ValueError("init_process_group(store=...) also needs rank= and world_size=")
    if backend == "nccl":
        torch.cuda.set_device(get_local_rank() if "LOCAL_RANK" in os.environ else rank % torch.cuda.device_count())
    kwargs = {"backend": backend, "timeout": timeout, "rank": rank, "world_size": world_size}
    if store is not None:
        kwargs["store"] = store
    else:
        kwargs["init_method"] = "env://"
    dist.init_process_group(**kwargs)
    os.environ.setdefault("LOCAL_RANK", str(rank))
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(world_size))


def destroy_process_group() -> None:
    _node_groups.clear()
    if dist.is_initialized():
        dist.destroy_process_group()


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def _require_init(what: str) -> None:
    if not is_initialized():
        raise RuntimeError(
            f"{what} needs the process group: call bagua_algos.init_process_group() first "
            "(in workers started by `python -m bagua_algos.launch` or torchrun)"
        )


def get_backend(group=None) -> str:
    _require_init("get_backend()")
    return str(dist.get_backend(group))


def get_rank(group=None) -> int:
    """This process's rank in ``group`` (global by default)."""
    _require_init("get_rank()")
    return dist.get_rank(group)


def get_world_size(group=None) -> int:
    _require_init("get_world_size()")
    return dist.get_world_size(group)


def get_local_rank() -> int:
    """Rank among the processes of this node (LOCAL_RANK)."""
    return _env_int("LOCAL_RANK", get_rank() if is_initialized() else 0)


def get_local_size() -> int:
    """Number of processes on this node (LOCAL_WORLD_SIZE)."""
    return _env_int("LOCAL_WORLD_SIZE", get_world_size() if is_initialized() else 1)


def get_node_rank() -> int:
    return get_rank() // get_local_size()


def new_group(ranks: Sequence[int] | None = None, timeout: timedelta | None = None):
    """A process group over ``ranks`` (global ranks). Every process must call this."""
    _require_init("new_group()")
    kwargs = {} if timeout is None else {"timeout": timeout}
    return dist.new_group(ranks=None if ranks is None else sorted(ranks), **kwargs)


def group_rank(group) -> int:
    """This process's rank inside ``group``, or -1 if it is not a member."""
    _require_init("group_rank()")
    return dist.get_rank(group)


def group_ranks(group) -> list[int]:
    """The global ranks of ``group``, in group-rank order."""
    _require_init("group_ranks()")
    if group is None:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def _build_node_groups() -> None:
    # Every process must create every subgroup, in the same order.
    world, local = get_world_size(), get_local_size()
    if world % local:
        raise RuntimeError(f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local}")
    me = get_rank()
    for node in range(world // local):
        g = new_group(range(node * local, (node + 1) * local))
        if me // local == node:
            _node_groups["intra"] = g
    _node_groups["inter_all"] = [new_group(range(lr, world, local)) for lr in range(local)]
    _node_groups["inter"] = _node_groups["inter_all"][me % local]


def intra_node_group():
    """The processes on this node (consecutive global ranks of size LOCAL_WORLD_SIZE)."""
    if "intra" not in _node_groups:
        _build_node_groups()
    return _node_groups["intra"]


def inter_node_group():
    """The processes with this process's local rank, one on each node."""
    if "inter" not in _node_groups:
        _build_node_groups()
    return _node_groups["inter"]


# ---------------------------------------------------------------------- collectives


def allreduce_inplace(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, group=None, async_op: bool = False):
    """``tensor`` ← reduce over the group of every member's ``tensor`` (AVG = SUM / size)."""
    op = ReduceOp(op)
    finishers = []
    if op == ReduceOp.AVG:
        if get_backend(group) == "nccl":
            torch_op = dist.ReduceOp.AVG
        else:
            torch_op = dist.ReduceOp.SUM
            size = get_world_size(group)
            if tensor.is_floating_point() or tensor.is_complex():
                finishers.append(lambda: tensor.div_(size))
            else:
                finishers.append(lambda: tensor.floor_divide_(size))
    else:
        torch_op = _TORCH_OPS[op]
    work = dist.all_reduce(tensor, op=torch_op, group=group, async_op=True)
    return _finish(CommHandle([work], finishers), async_op)


def hierarchical_allreduce_inplace(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, async_op: bool = False):
    """Allreduce over all workers in two levels: within each node, then across nodes
    between processes of equal local rank (each then holds the global result).

    Only SUM and AVG (a sum divided by the world size) are two-level reductions here.
    """
    op = ReduceOp(op)
    if op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise ValueError(f"hierarchical allreduce supports ReduceOp.SUM and ReduceOp.AVG, got {op.name}")
    allreduce_inplace(tensor, ReduceOp.SUM, group=intra_node_group())
    allreduce_inplace(tensor, ReduceOp.SUM, group=inter_node_group())
    if op == ReduceOp.AVG:
        tensor.div_(get_world_size())
    return _finish(CommHandle(), async_op)


def allreduce(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, group=None, async_op: bool = False):
    """``recv_tensor`` ← reduce of every member's ``send_tensor``; ``send_tensor`` is kept."""
    if recv_tensor.shape != send_tensor.shape:
        raise ValueError(f"recv_tensor shape {tuple(recv_tensor.shape)} differs from send_tensor shape {tuple(send_tensor.shape)}")
    if recv_tensor.data_ptr() != send_tensor.data_ptr():
        recv_tensor.copy_(send_tensor)
    return allreduce_inplace(recv_tensor, op, group, async_op)


def broadcast(tensor: torch.Tensor, src: int = 0, group=None, async_op: bool = False):
    """Every member's ``tensor`` ← ``tensor`` of global rank ``src``."""
    work = dist.broadcast(tensor, src=src, group=group, async_op=True)
    return _finish(CommHandle([work]), async_op)


def allgather(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, group=None, async_op: bool = False):
    """``recv_tensor`` (size × numel of ``send_tensor``) ← members' tensors in group-rank order."""
    size = get_world_size(group)
    if recv_tensor.numel() != size * send_tensor.numel():
        raise ValueError(
            f"recv_tensor must have {size} x {send_tensor.numel()} elements for allgather, got {recv_tensor.numel()}"
        )
    work = _all_gather_single(recv_tensor.view(-1), send_tensor.reshape(-1).contiguous(), group=group, async_op=True)
    return _finish(CommHandle([work]), async_op)


def reduce_scatter(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, group=None, async_op: bool = False):
    """Member k's ``recv_tensor`` ← reduction of chunk k of every member's ``send_tensor``."""
    size = get_world_size(group)
    if send_tensor.numel() != size * recv_tensor.numel():
        raise ValueError(
            f"send_tensor must have {size} x {recv_tensor.numel()} elements for reduce_scatter, got {send_tensor.numel()}"
        )
    op = ReduceOp(op)
    finishers = []
    torch_op = dist.ReduceOp.SUM if op == ReduceOp.AVG else _TORCH_OPS[op]
    if op == ReduceOp.AVG:
        finishers.append(lambda: recv_tensor.div_(size))
    flat_out = recv_tensor.view(-1)
    if get_backend(group) == "gloo":
        # gloo has no reduce_scatter: reduce the whole buffer, keep this member's chunk.
        work_buffer = send_tensor.reshape(-1).clone()
        work = dist.all_reduce(work_buffer, op=torch_op, group=group, async_op=True)
        me = group_rank(group)
        n = recv_tensor.numel()
        finishers.insert(0, lambda: flat_out.copy_(work_buffer[me * n:(me + 1) * n]))
    else:
        work = _reduce_scatter_single(flat_out, send_tensor.reshape(-1).contiguous(), op=torch_op, group=group, async_op=True)
    return _finish(CommHandle([work], finishers), async_op)


def send(tensor: torch.Tensor, dst: int, group=None) -> None:
    """Blocking send to global rank ``dst``."""
    dist.send(tensor, dst=dst, group=group)


def recv(tensor: torch.Tensor, src: int, group=None) -> None:
    """Blocking receive from global rank ``src`` into ``tensor``."""
    dist.recv(tensor, src=src, group=group)


def barrier(group=None) -> None:
    dist.barrier(group=group)


def start_neighbor_exchange(
    sends: Mapping[int, torch.Tensor] | Sequence[tuple[int, torch.Tensor]],
    recvs: Mapping[int, torch.Tensor] | Sequence[tuple[int, torch.Tensor]],
    group=None,
) -> CommHandle:
    """Post all sends and receives of one step at once (``batch_isend_irecv``).

    ``sends`` and ``recvs`` map a peer's global rank to a tensor (or are lists of
    ``(peer, tensor)`` pairs when a peer gets several tensors; pairs to the same peer
    are matched in order). Returns a handle; ``wait()`` blocks until all are done.
    """
    send_items = list(sends.items()) if isinstance(sends, Mapping) else list(sends)
    recv_items = list(recvs.items()) if isinstance(recvs, Mapping) else list(recvs)
    ops = [dist.P2POp(dist.isend, t, peer, group) for peer, t in send_items]
    ops += [dist.P2POp(dist.irecv, t, peer, group) for peer, t in recv_items]
    if not ops:
        return CommHandle()
    return CommHandle(dist.batch_isend_irecv(ops))


def neighbor_exchange(sends, recvs, group=None) -> None:
    """Blocking :func:`start_neighbor_exchange`."""
    start_neighbor_exchange(sends, recvs, group).wait()


# TEMP (replaced by the comm branch)
def _get_default_group():
    return None


def all_gather_object(obj, group=None) -> list:
    out = [None] * get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out
