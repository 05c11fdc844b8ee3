"""The engine's transport: n workers of one process, every tensor a row per worker.

The one-process engine runs an algorithm's own hooks and bucket ops once for all of
its n workers, on *stacked* tensors: a worker's tensor of shape ``s`` is row i of a
``[n, *s]`` tensor. :class:`StackedGroup` is both the engine's process group (what
``reify`` receives) and the :class:`~bagua_algos.runtime.comm.Transport` that answers
``comm``'s calls during the engine's step (``comm.using_transport(group)``):

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
  processes); a neighbour allreduce reads the neighbours' rows of x itself
  (:class:`~.gossip.StackedMix`), with no receive buffer.

A receive tensor whose value is the same on every worker (an allreduce's result, an
allgather's, a broadcast's) may be given without the worker dimension: it then holds
that one value. A send tensor always has it: what a worker sends is its own.

This is an experiment engine's arithmetic: no byte leaves the process, and
``comm.bytes_sent`` counts what one worker would send.
"""

from __future__ import annotations

import functools

import torch

from ..runtime.comm import CommHandle, ReduceOp, Transport, count_sent
from .gossip import StackedMix
from .rows import RowGather

__all__ = ["StackedGroup", "neighbor_exchange_bytes", "count_bytes"]


def _done(async_op: bool, result=None):
    """A call's return: its result, or a completed handle under ``async_op``."""
    return CommHandle() if async_op else result


def _refused(name: str):
    """A method refusing comm.``name``, which has no stacked form."""
    def refuse(self, *args, **kwargs):
        raise NotImplementedError(f"comm.{name} has no stacked form: the one-process engine does not run an op "
                                  "that calls it; run the algorithm as processes (--engine processes)")

    return refuse


class StackedGroup(Transport):
    """The n workers of the one-process engine as one process group (its global,
    intra-node and inter-node communicator: the workers are one node) and as the
    transport of ``comm``'s calls."""

    def __init__(self, n: int, device="cpu"):
        self.n = int(n)
        self.device = torch.device(device)
        self.ranks = list(range(self.n))
        self.row_dims = (self.n,)
        self.runs_in_caller = True  # a call is arithmetic on the rows, done before it returns
        self._rows = torch.arange(self.n)
        self._padding: dict = {}  # bucket name -> the views of its padding columns (engine's layout)
        self._plans: dict = {}  # a neighbour exchange's pairing -> its row gathers
        self._mixes: dict = {}  # a neighbour allreduce's peers -> (the peers, its StackedMix)

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

    # --- the environment and groups --------------------------------------------------
    def is_initialized(self) -> bool:
        return True

    def get_rank(self, group=None) -> torch.Tensor:
        return self._rows

    get_local_rank = group_rank = get_rank

    def get_world_size(self, group=None) -> int:
        return self.n

    def get_local_size(self) -> int:
        return self.n

    def get_node_rank(self) -> int:
        return 0

    def leads_node(self) -> bool:
        return True  # one node in one process: its rows do the leader's work together

    def default_group(self) -> "StackedGroup":
        return self

    intra_node_group = default_group

    def inter_node_group(self) -> "StackedGroup":
        return self.get_inter_node_communicator()

    def group_ranks(self, group=None) -> list:
        return list(self.ranks)

    worker_ranks = group_ranks

    # --- helpers ---------------------------------------------------------------------
    def _as_rows(self, name: str, t: torch.Tensor, write: bool = False) -> torch.Tensor:
        """``t`` as ``[n, m]`` (a worker's tensor flattened per row); it must have the
        worker dimension. With ``write``, a view (what is written to it reaches ``t``)."""
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() == 0 or t.shape[0] != self.n:
            raise ValueError(f"{name}: on the one-process engine a worker's tensor is a row of a stacked tensor, "
                             f"[{self.n}, ...] (one row per worker); got shape {tuple(t.shape)}. Allocate "
                             "per-worker buffers from the bucket's tensors (torch.zeros_like(bucket.flat_view()), "
                             "t.new_empty(...)), not with a per-rank shape")
        if not write:
            return t.reshape(self.n, -1)
        try:
            return t.view(self.n, -1)
        except RuntimeError:
            raise ValueError(f"{name}: a receive tensor must be viewable as [{self.n}, -1] (its rows laid out "
                             f"alike), got strides {t.stride()}") from None

    def _write(self, name: str, out: torch.Tensor, value: torch.Tensor) -> None:
        """``out`` ← ``value`` ([m], every worker's same result): into every row of a
        stacked ``out``, or into ``out`` itself when it has no worker dimension."""
        with torch.no_grad():
            if out.numel() == value.numel():
                out.view(-1).copy_(value.view(-1)) if out.is_contiguous() else out.copy_(value.view(out.shape))
            elif out.numel() == value.numel() * self.n:
                out.view(self.n, -1).copy_(value.view(1, -1).expand(self.n, -1)) if out.is_contiguous() \
                    else out.copy_(value.view(1, *out.shape[1:]).expand_as(out))
            else:
                raise ValueError(f"{name} has {out.numel()} elements: the result has {value.numel()} per worker, "
                                 f"so it must be [{value.numel()}] (shared) or [{self.n}, {value.numel()}] (a row "
                                 "per worker)")

    def _per_worker_bytes(self, t: torch.Tensor) -> int:
        return t.numel() * t.element_size() // self.n

    # --- collectives -------------------------------------------------------------------
    def allreduce_inplace(self, tensor, op=ReduceOp.SUM, comm=None, *, group=None, async_op=False):
        x = self._as_rows("tensor", tensor)
        count_sent(self._per_worker_bytes(tensor))
        with torch.no_grad():
            tensor.copy_(_reduce(x, op).view(1, *tensor.shape[1:]).expand_as(tensor))
        return _done(async_op)

    def allreduce(self, send_tensor, recv_tensor, op=ReduceOp.SUM, comm=None, *, group=None, async_op=False):
        x = self._as_rows("send_tensor", send_tensor)
        count_sent(self._per_worker_bytes(send_tensor))
        self._write("recv_tensor", recv_tensor, _reduce(x, op))
        return _done(async_op)

    def hierarchical_allreduce_inplace(self, tensor, op=ReduceOp.SUM, *, async_op=False):
        return self.allreduce_inplace(tensor, op, async_op=async_op)  # one node: the two levels are one reduction

    def broadcast(self, tensor, src=0, comm=None, *, group=None, async_op=False):
        x = self._as_rows("tensor", tensor, write=True)
        with torch.no_grad():
            x.copy_(x[src].unsqueeze(0).expand_as(x))
        return _done(async_op)

    def allgather(self, send_tensor, recv_tensor, comm=None, *, group=None, async_op=False):
        x = self._as_rows("send_tensor", send_tensor)
        count_sent(self._per_worker_bytes(send_tensor))
        self._write("recv_tensor", recv_tensor, x.reshape(-1))
        return _done(async_op)

    def allgather_inplace(self, tensor, comm=None, *, group=None, async_op=False):
        x = self._as_rows("tensor", tensor, write=True).view(self.n, self.n, -1)
        own = torch.diagonal(x, dim1=0, dim2=1).T.contiguous()  # worker i's chunk i: [n, chunk]
        count_sent(self._per_worker_bytes(tensor) // self.n)
        with torch.no_grad():
            x.copy_(own.unsqueeze(0).expand_as(x))
        return _done(async_op)

    def alltoall(self, send_tensor, recv_tensor, comm=None, *, group=None, async_op=False):
        x = self._as_rows("send_tensor", send_tensor).view(self.n, self.n, -1)
        out = self._as_rows("recv_tensor", recv_tensor, write=True).view(self.n, self.n, -1)
        count_sent(self._per_worker_bytes(send_tensor) * (self.n - 1) // self.n)
        with torch.no_grad():
            out.copy_(x.transpose(0, 1))  # worker i receives chunk i of every sender j
        return _done(async_op)

    def alltoall_inplace(self, tensor, comm=None, *, group=None, async_op=False):
        return self.alltoall(tensor.clone(), tensor, async_op=async_op)

    def reduce_scatter(self, send_tensor, recv_tensor, op=ReduceOp.SUM, comm=None, *, group=None, async_op=False):
        x = self._as_rows("send_tensor", send_tensor).view(self.n, self.n, -1)
        out = self._as_rows("recv_tensor", recv_tensor, write=True)
        count_sent(self._per_worker_bytes(send_tensor) * (self.n - 1) // self.n)
        with torch.no_grad():  # worker k: the reduction of chunk k over the senders j
            out.copy_(_reduce(x, op))
        return _done(async_op)

    def reduce_scatter_inplace(self, tensor, op=ReduceOp.SUM, comm=None, *, group=None, async_op=False):
        x = self._as_rows("tensor", tensor, write=True).view(self.n, self.n, -1)
        reduced = _reduce(x, op)  # [k, chunk]
        with torch.no_grad():
            torch.diagonal(x, dim1=0, dim2=1).copy_(reduced.T)
        return _done(async_op)

    def reduce(self, send_tensor, recv_tensor, dst, op=ReduceOp.SUM, comm=None, *, group=None, async_op=False):
        x = self._as_rows("send_tensor", send_tensor)
        out = self._as_rows("recv_tensor", recv_tensor, write=True)
        with torch.no_grad():
            out[dst].copy_(_reduce(x, op))
        return _done(async_op)

    def reduce_inplace(self, tensor, dst, op=ReduceOp.SUM, comm=None, *, group=None, async_op=False):
        x = self._as_rows("tensor", tensor, write=True)
        with torch.no_grad():
            x[dst].copy_(_reduce(x, op))
        return _done(async_op)

    def barrier(self, comm=None, *, group=None, async_op=False):
        return _done(async_op)

    def all_gather_object(self, obj, comm=None, *, group=None) -> list:
        return [obj] * self.n  # the engine's workers share one process, so one object

    def broadcast_object(self, obj, src=0, comm=None, *, group=None):
        return obj

    # calls no op run on the engine makes: refused, with what to do instead
    gather = _refused("gather")
    gather_inplace = _refused("gather_inplace")
    scatter = _refused("scatter")
    scatter_inplace = _refused("scatter_inplace")
    alltoall_v = _refused("alltoall_v")
    alltoall_v_inplace = _refused("alltoall_v_inplace")
    send = _refused("send (a lone send; the engine exchanges through start_neighbor_exchange)")
    recv = _refused("recv (a lone receive; the engine exchanges through start_neighbor_exchange)")

    # --- the neighbour exchange: a row gather -----------------------------------------
    def _peer_rows(self, name: str, peer) -> list:
        if isinstance(peer, torch.Tensor) and peer.dim() == 1 and peer.numel() == self.n:
            return [int(p) for p in peer.tolist()]
        raise ValueError(f"{name}: on the one-process engine a peer is every worker's peer, a [{self.n}] long "
                         f"tensor (-1: no peer), got {peer!r}")

    def _exchange_plan(self, send_peers: list, recv_peers: list, device) -> list:
        """For each receive r: (send index k, RowGather) pairs, the gather that copies
        into the receiving workers' rows the rows of send ``k``'s tensor their peers
        sent them. Worker i's ``o``-th receive from j takes j's ``o``-th send to i
        (posting order, as between processes). A topology's rows are a few arithmetic
        runs, so each gather is a few strided copies, no temporary (:class:`~.rows.RowGather`)."""
        key = (tuple(map(tuple, send_peers)), tuple(map(tuple, recv_peers)), str(device))
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = _pair_up(self.n, send_peers, recv_peers, device)
        return plan

    def _sent_bytes(self, send_peers: list, tensors: list) -> int:
        """What one worker hands to the network in a neighbour exchange: each send's
        bytes per worker times the share of workers that post it."""
        return sum(self._per_worker_bytes(t) * sum(1 for p in peers if p >= 0) // self.n
                   for peers, t in zip(send_peers, tensors))

    def neighbor_exchange_bytes(self, sends) -> int:
        """The bytes ``start_neighbor_exchange(sends, ...)`` counts, without exchanging
        or counting: for a form that computes an exchange's result from the rows
        themselves and counts the same bytes every step (:func:`count_bytes`)."""
        send_items = list(sends)
        return self._sent_bytes([self._peer_rows(f"sends[{k}] peer", p) for k, (p, _) in enumerate(send_items)],
                                [self._as_rows(f"sends[{k}] tensor", t) for k, (_, t) in enumerate(send_items)])

    def start_neighbor_exchange(self, sends, recvs, group=None):
        send_items = list(sends.items()) if hasattr(sends, "items") else list(sends)
        recv_items = list(recvs.items()) if hasattr(recvs, "items") else list(recvs)
        send_peers = [self._peer_rows(f"sends[{k}] peer", p) for k, (p, _) in enumerate(send_items)]
        recv_peers = [self._peer_rows(f"recvs[{k}] peer", p) for k, (p, _) in enumerate(recv_items)]
        sources = [self._as_rows(f"sends[{k}] tensor", t) for k, (_, t) in enumerate(send_items)]
        targets = [self._as_rows(f"recvs[{k}] tensor", t, write=True) for k, (_, t) in enumerate(recv_items)]
        count_sent(self._sent_bytes(send_peers, [t for _, t in send_items]))
        with torch.no_grad():
            for target, moves in zip(targets, self._exchange_plan(send_peers, recv_peers, targets[0].device
                                                                  if targets else "cpu")):
                for k, gather in moves:
                    gather.copy_(target, sources[k])
        return CommHandle()

    def neighbor_exchange(self, sends, recvs, group=None) -> None:
        self.start_neighbor_exchange(sends, recvs, group)

    def neighbor_allreduce(self, x, out, self_weight, neighbors, group=None) -> None:
        """The process's terms in its order (a product, a multiply-add per slot), each
        neighbour's term read from its row of x (:class:`~.gossip.StackedMix`); it
        counts the bytes the exchange would."""
        neighbors = list(neighbors)
        key = tuple(t.data_ptr() for pair in neighbors for t in pair)
        kept = self._mixes.get(key)
        if kept is None:  # (the arguments are kept with their mix, so their memory is not reused)
            if len(self._mixes) >= 64:  # the gossips were made anew (a reset): forget the old ones
                self._mixes.clear()
            peers = [self._peer_rows(f"neighbors[{k}] peer", peer) for k, (peer, _) in enumerate(neighbors)]
            table = torch.tensor(peers, dtype=torch.long).reshape(len(peers), self.n).T.contiguous()
            weight = torch.cat([w.reshape(self.n, 1) for _, w in neighbors], 1) if neighbors else \
                x.new_zeros(self.n, 0)
            kept = self._mixes[key] = (neighbors, StackedMix(table), weight, peers)
        count_sent(self._sent_bytes(kept[3], [x] * len(kept[3])))  # what the exchange would count
        if out is not x:
            out.copy_(x)
        kept[1].mix_(out, self_weight, kept[2])


@functools.lru_cache(maxsize=None)
def _one_node_leaders(group: StackedGroup) -> StackedGroup:
    return StackedGroup(1, group.device)


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


def _pair_up(n: int, send_peers: list, recv_peers: list, device) -> list:
    """The row gathers of an exchange (:meth:`StackedGroup._exchange_plan`)."""
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
    return plan


def neighbor_exchange_bytes(group: StackedGroup, sends) -> int:
    """:meth:`StackedGroup.neighbor_exchange_bytes` of ``group``."""
    if not isinstance(group, StackedGroup):
        raise ValueError(f"group must be the one-process engine's StackedGroup, got {group!r}")
    return group.neighbor_exchange_bytes(sends)


def count_bytes(nbytes_sent: int) -> None:
    """Count ``nbytes_sent`` as sent (a :func:`neighbor_exchange_bytes` figure, computed once)."""
    count_sent(nbytes_sent)
