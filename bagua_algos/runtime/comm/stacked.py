"""The stacked communicator: n workers of one process, every tensor a row per worker.

The one-process engine runs an algorithm's own hooks and bucket ops once for all of
its n workers, on *stacked* tensors: a worker's tensor of shape ``s`` is row i of a
``[n, *s]`` tensor. While :func:`stacked_world` is active (the engine's step), every
call of this package answers for those n workers instead of reaching
torch.distributed:

* ``get_world_size()`` is n, ``get_rank()`` and ``group_rank(group)`` are the rows'
  ranks, ``torch.arange(n)`` (a rank is per worker, so it is a tensor too); the
  workers are one node (``get_local_size()`` is n, ``get_node_rank()`` 0);
* a collective reads every worker's row of its send tensor and writes every worker's
  row of its receive tensor: an allreduce is a reduction over the worker dimension,
  an allgather the rows themselves, an all-to-all a transpose of the chunks, a
  broadcast a row copy;
* a neighbour exchange is a row gather: the peers are ``[n]`` long tensors (worker
  i's peer in row i; -1: none), and worker i receives from its peer j what j sent to
  i (pairs between the same two workers matched in posting order, as between
  processes).

A receive tensor whose value is the same on every worker (an allreduce's result, an
allgather's, a broadcast's) may be given without the worker dimension: it then holds
that one value. A send tensor always has it: what a worker sends is its own.

This is an experiment engine's arithmetic, not a transport: no byte leaves the
process, and :func:`bytes_sent` counts what one worker would send.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Optional

import torch

from .counter import _count, _nbytes
from .handle import CommHandle
from .reduce_op import ReduceOp

__all__ = ["StackedGroup", "stacked_world", "active_world", "is_stacked", "dispatch"]

_local = threading.local()


class StackedGroup:
    """The n workers of the one-process engine as one process group (and its global,
    intra-node and inter-node communicator: the workers are one node)."""

    def __init__(self, n: int, device="cpu"):
        self.n = int(n)
        self.device = torch.device(device)
        self.ranks = list(range(self.n))
        self._rows = torch.arange(self.n)
        self._padding: dict = {}  # bucket name -> the view of its padding columns (engine's layout)

    def reserve_padding(self, bucket_name: str, view: torch.Tensor) -> None:
        """The engine's layout holds bucket ``bucket_name``'s padding in ``view``
        (``[n, padding]`` zero columns after its last tensor)."""
        self._padding.setdefault(bucket_name, []).append(view)

    def padding_view(self, bucket_name: str, last: torch.Tensor, padding: int):
        """Where a bucket pads (a view the layout reserved for it), or None: fresh zeros."""
        for view in self._padding.get(bucket_name, ()):  # (the parameters' storage, the gradients')
            if (view.shape == (self.n, padding) and view.dtype == last.dtype
                    and view.untyped_storage().data_ptr() == last.untyped_storage().data_ptr()):
                return view
        return None

    # --- the names of BaguaProcessGroup and BaguaCommunicator --------------------------
    def rank(self) -> torch.Tensor:
        return self._rows

    def nranks(self) -> int:
        return self.n

    def size(self) -> int:
        return self.n

    def is_member(self) -> bool:
        return True

    def get_global_communicator(self) -> "StackedGroup":
        return self

    get_intra_node_communicator = get_global_communicator

    def get_inter_node_communicator(self) -> "StackedGroup":
        return _one_node_leaders(self)

    def __repr__(self) -> str:
        return f"StackedGroup(n={self.n})"


@functools.lru_cache(maxsize=None)
def _one_node_leaders(group: StackedGroup) -> StackedGroup:
    return StackedGroup(1, group.device)


@contextlib.contextmanager
def stacked_world(group: StackedGroup):
    """Within this block (on this thread), ``comm``'s calls are ``group``'s."""
    before = getattr(_local, "world", None)
    _local.world = group
    try:
        yield group
    finally:
        _local.world = before


def active_world() -> Optional[StackedGroup]:
    """The stacked group of the engine's step running on this thread, else None."""
    return getattr(_local, "world", None)


def is_stacked(group=None) -> bool:
    """Whether ``group`` (or, for None, the default group) is the engine's workers."""
    return isinstance(group, StackedGroup) or (group is None and active_world() is not None)


def _world_of(comm, group) -> Optional[StackedGroup]:
    for g in (comm, group):
        if isinstance(g, StackedGroup):
            return g
    world = active_world()
    if world is not None and comm is None and group is None:
        return world
    if world is not None:
        raise TypeError(f"the one-process engine's workers communicate through their own group (comm=None or the "
                        f"algorithm's process_group); got {comm if comm is not None else group!r}")
    return None


def dispatch(stacked_function):
    """Decorate a function of ``comm``: while a stacked world is active (or a
    :class:`StackedGroup` is passed as ``comm=`` / ``group=``), ``stacked_function``
    answers instead, with the same arguments and the group first."""

    def decorate(function):
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            comm, group = kwargs.get("comm"), kwargs.get("group")
            if comm is None and group is None:
                comm = next((a for a in args if isinstance(a, StackedGroup)), None)
            world = _world_of(comm, group) if (active_world() is not None or comm is not None
                                               or group is not None) else None
            if world is None:
                return function(*args, **kwargs)
            args = tuple(a for a in args if not isinstance(a, StackedGroup))
            kwargs = {k: v for k, v in kwargs.items() if k not in ("comm", "group")}
            async_op = kwargs.pop("async_op", False)
            result = stacked_function(world, *args, **kwargs)
            return CommHandle() if async_op else result

        wrapper.stacked = stacked_function
        return wrapper

    return decorate


# --- helpers -----------------------------------------------------------------------------
def _rows(world: StackedGroup, name: str, t: torch.Tensor, write: bool = False) -> torch.Tensor:
    """``t`` as ``[n, m]`` (a worker's tensor flattened per row); it must have the worker
    dimension. With ``write``, a view (what is written to it reaches ``t``)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() == 0 or t.shape[0] != world.n:
        raise ValueError(f"{name}: on the one-process engine a worker's tensor is a row of a stacked tensor, "
                         f"[{world.n}, ...] (one row per worker); got shape {tuple(t.shape)}. Allocate "
                         "per-worker buffers from the bucket's tensors (torch.zeros_like(bucket.flat_view()), "
                         "t.new_empty(...)), not with a per-rank shape")
    if not write:
        return t.reshape(world.n, -1)
    try:
        return t.view(world.n, -1)
    except RuntimeError:
        raise ValueError(f"{name}: a receive tensor must be viewable as [{world.n}, -1] (its rows laid out alike), "
                         f"got strides {t.stride()}") from None


def _write(world: StackedGroup, name: str, out: torch.Tensor, value: torch.Tensor) -> None:
    """``out`` ← ``value`` ([m], every worker's same result): into every row of a
    stacked ``out``, or into ``out`` itself when it has no worker dimension."""
    with torch.no_grad():
        if out.numel() == value.numel():
            out.view(-1).copy_(value.view(-1)) if out.is_contiguous() else out.copy_(value.view(out.shape))
        elif out.numel() == value.numel() * world.n:
            out.view(world.n, -1).copy_(value.view(1, -1).expand(world.n, -1)) if out.is_contiguous() \
                else out.copy_(value.view(1, *out.shape[1:]).expand_as(out))
        else:
            raise ValueError(f"{name} has {out.numel()} elements: the result has {value.numel()} per worker, so it "
                             f"must be [{value.numel()}] (shared) or [{world.n}, {value.numel()}] (a row per worker)")


def _reduce(x: torch.Tensor, op: ReduceOp) -> torch.Tensor:
    """The reduction of ``x`` over its first dimension, the senders (a sum, then ÷ n
    for AVG, as the per-rank AVG on gloo: a SUM divided on completion)."""
    op = ReduceOp(op)
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        total = x.sum(0)
        if op == ReduceOp.AVG:
            return total.div_(x.shape[0]) if total.is_floating_point() else total.div_(x.shape[0], rounding_mode="floor")
        return total
    if op == ReduceOp.PRODUCT:
        return x.prod(0)
    if op == ReduceOp.MIN:
        return x.amin(0)
    if op == ReduceOp.MAX:
        return x.amax(0)
    fold = {ReduceOp.BOR: torch.bitwise_or, ReduceOp.BAND: torch.bitwise_and, ReduceOp.BXOR: torch.bitwise_xor}[op]
    out = x[0].clone()
    for row in x[1:]:
        out = fold(out, row)
    return out


def _per_worker_bytes(world: StackedGroup, t: torch.Tensor) -> int:
    return _nbytes(t) // world.n


# --- env and groups ------------------------------------------------------------------
def get_world_size(world: StackedGroup, group=None) -> int:
    return world.n


def get_rank(world: StackedGroup, group=None) -> torch.Tensor:
    return world.rank()


def group_ranks(world: StackedGroup, group=None) -> list:
    return list(world.ranks)


def get_local_size(world: StackedGroup) -> int:
    return world.n


def get_node_rank(world: StackedGroup) -> int:
    return 0


def leads_node(world: StackedGroup) -> bool:
    return True  # one node in one process: its rows do the leader's work together


def this_group(world: StackedGroup, *args, **kwargs) -> StackedGroup:
    return world


def leaders(world: StackedGroup, *args, **kwargs) -> StackedGroup:
    return world.get_inter_node_communicator()


def is_initialized(world: StackedGroup) -> bool:
    return True


# --- collectives -----------------------------------------------------------------------
def allreduce_inplace(world, tensor, op=ReduceOp.SUM):
    x = _rows(world, "tensor", tensor)
    _count(_per_worker_bytes(world, tensor))
    with torch.no_grad():
        tensor.copy_(_reduce(x, op).view(1, *tensor.shape[1:]).expand_as(tensor))


def allreduce(world, send_tensor, recv_tensor, op=ReduceOp.SUM):
    x = _rows(world, "send_tensor", send_tensor)
    _count(_per_worker_bytes(world, send_tensor))
    _write(world, "recv_tensor", recv_tensor, _reduce(x, op))


def hierarchical_allreduce_inplace(world, tensor, op=ReduceOp.SUM):
    allreduce_inplace(world, tensor, op)  # one node: the two levels are one reduction


def broadcast(world, tensor, src=0):
    x = _rows(world, "tensor", tensor, write=True)
    with torch.no_grad():
        x.copy_(x[src].unsqueeze(0).expand_as(x))


def allgather(world, send_tensor, recv_tensor):
    x = _rows(world, "send_tensor", send_tensor)
    _count(_per_worker_bytes(world, send_tensor))
    _write(world, "recv_tensor", recv_tensor, x.reshape(-1))


def allgather_inplace(world, tensor):
    x = _rows(world, "tensor", tensor, write=True).view(world.n, world.n, -1)
    own = torch.diagonal(x, dim1=0, dim2=1).T.contiguous()  # worker i's chunk i: [n, chunk]
    _count(_per_worker_bytes(world, tensor) // world.n)
    with torch.no_grad():
        x.copy_(own.unsqueeze(0).expand_as(x))


def alltoall(world, send_tensor, recv_tensor):
    x = _rows(world, "send_tensor", send_tensor).view(world.n, world.n, -1)
    out = _rows(world, "recv_tensor", recv_tensor, write=True).view(world.n, world.n, -1)
    _count(_per_worker_bytes(world, send_tensor) * (world.n - 1) // world.n)
    with torch.no_grad():
        out.copy_(x.transpose(0, 1))  # worker i receives chunk i of every sender j


def alltoall_inplace(world, tensor):
    alltoall(world, tensor.clone(), tensor)


def reduce_scatter(world, send_tensor, recv_tensor, op=ReduceOp.SUM):
    x = _rows(world, "send_tensor", send_tensor).view(world.n, world.n, -1)
    out = _rows(world, "recv_tensor", recv_tensor, write=True)
    _count(_per_worker_bytes(world, send_tensor) * (world.n - 1) // world.n)
    with torch.no_grad():  # worker k: the reduction of chunk k over the senders j
        out.copy_(_reduce(x, op))


def reduce_scatter_inplace(world, tensor, op=ReduceOp.SUM):
    x = _rows(world, "tensor", tensor, write=True).view(world.n, world.n, -1)
    reduced = _reduce(x, op)  # [k, chunk]
    with torch.no_grad():
        torch.diagonal(x, dim1=0, dim2=1).copy_(reduced.T)


def reduce(world, send_tensor, recv_tensor, dst, op=ReduceOp.SUM):
    x = _rows(world, "send_tensor", send_tensor)
    out = _rows(world, "recv_tensor", recv_tensor, write=True)
    with torch.no_grad():
        out[dst].copy_(_reduce(x, op))


def reduce_inplace(world, tensor, dst, op=ReduceOp.SUM):
    x = _rows(world, "tensor", tensor, write=True)
    with torch.no_grad():
        x[dst].copy_(_reduce(x, op))


def barrier(world):
    return None


def all_gather_object(world, obj):
    return [obj] * world.n  # the engine's workers share one process, so one object


def broadcast_object(world, obj, src=0):
    return obj


def _refuse(name):
    def refuse(world, *args, **kwargs):
        raise NotImplementedError(
            f"comm.{name} has no stacked form: the one-process engine does not run an op that calls it; "
            "run the algorithm as processes (--engine processes)")

    return refuse


# --- the neighbour exchange: a row gather ---------------------------------------------
def _peer_rows(world: StackedGroup, name: str, peer) -> list:
    if isinstance(peer, torch.Tensor) and peer.dim() == 1 and peer.numel() == world.n:
        return [int(p) for p in peer.tolist()]
    raise ValueError(f"{name}: on the one-process engine a peer is every worker's peer, a [{world.n}] long tensor "
                     f"(-1: no peer), got {peer!r}")


_plans: dict = {}


def _exchange_plan(world: StackedGroup, send_peers: list, recv_peers: list, device) -> list:
    """For each receive r: (send index k, RowGather) pairs, the gather that copies into
    the receiving workers' rows the rows of send ``k``'s tensor their peers sent them.
    Worker i's ``o``-th receive from j takes j's ``o``-th send to i (posting order, as
    between processes). A topology's rows are a few arithmetic runs, so each gather is
    a few strided copies, no temporary (:class:`~bagua_algos.runtime.rows.RowGather`)."""
    from ..rows import RowGather  # (rows.py imports nothing of comm)

    key = (world.n, tuple(map(tuple, send_peers)), tuple(map(tuple, recv_peers)), str(device))
    plan = _plans.get(key)
    if plan is not None:
        return plan
    n = world.n
    sent = {}  # (sender, receiver) -> [send index, ...] in posting order
    for k, dst in enumerate(send_peers):
        for j in range(n):
            if dst[j] >= 0:
                sent.setdefault((j, dst[j]), []).append(k)
    taken = {}
    plan = []
    for r, src in enumerate(recv_peers):
        by_send: dict = {}
        for i in range(n):
            j = src[i]
            if j < 0:
                continue
            o = taken.get((i, j), 0)
            taken[(i, j)] = o + 1
            queue = sent.get((j, i), [])
            if o >= len(queue):
                raise ValueError(f"worker {i} receives from worker {j} (receive {r}), which sends it nothing "
                                 f"more: sends and receives must pair up, as between processes")
            by_send.setdefault(queue[o], ([], []))
            by_send[queue[o]][0].append(i)
            by_send[queue[o]][1].append(j)
        moves = []
        for k, (rows, srcs) in sorted(by_send.items()):
            index = [None] * n
            for row, src in zip(rows, srcs):
                index[row] = src
            moves.append((k, RowGather(index, device)))
        plan.append(moves)
    _plans[key] = plan
    return plan


def _sent_bytes(world: StackedGroup, send_peers: list, tensors: list) -> int:
    """What one worker hands to the network in a neighbour exchange: each send's bytes
    per worker times the share of workers that post it."""
    return sum(_per_worker_bytes(world, t) * sum(1 for p in peers if p >= 0) // world.n
               for peers, t in zip(send_peers, tensors))


def _count_sends(world: StackedGroup, send_peers: list, tensors: list) -> None:
    _count(_sent_bytes(world, send_peers, tensors))


def neighbor_exchange_bytes(group, sends) -> int:
    """The bytes ``start_neighbor_exchange(sends, ...)`` would count on the engine's
    workers (``group``: the stacked group, or None for the active one), without
    exchanging or counting: for a caller that computes an exchange's result from the rows
    themselves and counts the same bytes every step (:func:`count_bytes`)."""
    world = _world_of(None, group)
    if world is None:
        raise ValueError(f"group must be the one-process engine's stacked group, got {group!r}")
    send_items = list(sends)
    return _sent_bytes(world, [_peer_rows(world, f"sends[{k}] peer", p) for k, (p, _) in enumerate(send_items)],
                       [_rows(world, f"sends[{k}] tensor", t) for k, (_, t) in enumerate(send_items)])


def count_bytes(nbytes: int) -> None:
    """Count ``nbytes`` as sent (a :func:`neighbor_exchange_bytes` figure, computed once)."""
    _count(nbytes)


def count_neighbor_exchange(group, sends) -> None:
    """Count the bytes ``start_neighbor_exchange(sends, ...)`` would count on the engine's
    workers (``group``: the stacked group, or None for the active one), without
    exchanging: for a caller that computes an exchange's result from the rows
    themselves (the gossip's stacked mix, :class:`~bagua_algos.runtime.gossip.StackedMix`)."""
    _count(neighbor_exchange_bytes(group, sends))


def start_neighbor_exchange(world, sends, recvs):
    send_items = list(sends.items()) if hasattr(sends, "items") else list(sends)
    recv_items = list(recvs.items()) if hasattr(recvs, "items") else list(recvs)
    send_peers = [_peer_rows(world, f"sends[{k}] peer", p) for k, (p, _) in enumerate(send_items)]
    recv_peers = [_peer_rows(world, f"recvs[{k}] peer", p) for k, (p, _) in enumerate(recv_items)]
    sources = [_rows(world, f"sends[{k}] tensor", t) for k, (_, t) in enumerate(send_items)]
    targets = [_rows(world, f"recvs[{k}] tensor", t, write=True) for k, (_, t) in enumerate(recv_items)]
    _count_sends(world, send_peers, [t for _, t in send_items])
    with torch.no_grad():
        for target, moves in zip(targets, _exchange_plan(world, send_peers, recv_peers, targets[0].device
                                                         if targets else "cpu")):
            for k, gather in moves:
                gather.copy_(target, sources[k])
    return CommHandle()


def neighbor_exchange(world, sends, recvs):
    start_neighbor_exchange(world, sends, recvs)


_refuse_gather = _refuse("gather")
_refuse_gather_inplace = _refuse("gather_inplace")
_refuse_scatter = _refuse("scatter")
_refuse_scatter_inplace = _refuse("scatter_inplace")
_refuse_alltoall_v = _refuse("alltoall_v")
_refuse_alltoall_v_inplace = _refuse("alltoall_v_inplace")
_refuse_send = _refuse("send (a lone send; the engine exchanges through start_neighbor_exchange)")
_refuse_recv = _refuse("recv (a lone receive; the engine exchanges through start_neighbor_exchange)")
