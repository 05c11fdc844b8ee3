"""The one gossip: x ← W_t x for the workers a process runs, over ``comm``'s neighbour
exchange, so one coding serves a job's process and the one-process engine.

Every algorithm that gossips goes through :class:`Gossip`: Bagua's decentralized op
(:class:`~.ops.DecentralizedSynchronousOp`: a topology, shift_one or "all", hierarchical
or not) and the algorithms that gossip after the optimizer step (D², SGP, gradient
tracking, quasi-global momentum: :mod:`bagua_algos.algorithms.adapt_then_combine`).
``x`` is ``[W, L]``, a row per worker this process runs (W = 1 in a job; the n stacked
workers on the engine), or ``[L]`` for one worker. Three kinds of W_t:

1. a fixed topology, W its Metropolis–Hastings matrix; row i of x becomes
   x_i ← w_ii x_i + Σ_k w_{i,j_k} x_{j_k}, the neighbours j_k in the topology's order
   (the slots of one :class:`~.topology.NeighbourTable`): the self term is one product,
   each slot one multiply-add (``addcmul_``), in slot order;
2. a time-varying topology (:class:`~topologies.OnePeerExponentialTopology`, Bagua's
   shift_one as :class:`~topologies.ShiftOneTopology`): at exchange t worker i sends x_i
   to ``out_peer(i, t)``, receives y from ``in_peer(i, t)`` and x_i ← (x_i + y) / 2, the
   pairwise average (:func:`pairwise_average_`);
3. none (Bagua's ``"all"``): x ← the mean over the members, an allreduce average.

A fixed topology's step is ``comm.neighbor_allreduce``: its transport computes (1), a
process by the exchange into ``[W, D, L]`` receive buffers, the one-process engine from
the neighbours' rows of x itself (``bagua_algos.engine.gossip``), the same terms in the
same order either way.
"""

from __future__ import annotations

from typing import Sequence

import torch

from . import comm
from .topology import NeighbourTable

__all__ = ["Gossip", "pairwise_average_", "pairwise_average_and_copy_"]


def pairwise_average_(x: torch.Tensor, received: torch.Tensor) -> torch.Tensor:
    """x ← (x + received) / 2 in place: a time-varying topology's exchange (shift_one,
    the one-peer exponential graph). One sum, then an exact halving."""
    return x.add_(received).mul_(0.5)


AVERAGE_BLOCK = 1 << 16
"""Elements a block of :func:`pairwise_average_and_copy_` (256 KiB of fp32: the block of
each of its three tensors stays in a core's L2 between the three operations)."""


def pairwise_average_and_copy_(received: torch.Tensor, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """received ← (received + x) / 2, then target ← received: :func:`pairwise_average_`'s
    sum and exact halving (received + x is x + received, bit for bit) and a copy, taken
    block by block so that each block is read from memory once. In fp32 the three
    passes over a bucket (sum, halving, copy) move 28 bytes an element, one sweep 16;
    four processes at once on 2 cores, a 21 MB bucket each, took 10.6–11.4 ms a sweep
    against 13.3–16.8 ms for the passes. ``target`` may be ``x``; a strided tensor, or
    ``target`` aliasing ``received``, takes the passes, and so does a tensor off the CPU:
    on a GPU the blocks would be 3 kernel launches each (a 21 MB bucket, 243 launches
    against 3), and its caches are not a CPU core's. Returns ``received``."""
    flat = [t.view(-1) if t.is_contiguous() else None for t in (received, x, target)]
    if (received.device.type != "cpu" or any(f is None for f in flat)
            or received.data_ptr() == target.data_ptr()):
        target.copy_(pairwise_average_(received, x))
        return received
    r, xs, ts = flat
    for start in range(0, r.numel(), AVERAGE_BLOCK):
        block = r[start:start + AVERAGE_BLOCK]
        block.add_(xs[start:start + AVERAGE_BLOCK]).mul_(0.5)
        ts[start:start + AVERAGE_BLOCK].copy_(block)
    return received


class Gossip:
    """x ← W_t x in place for the workers this process runs (the module's docstring has
    the rule and its three kinds of W_t).

    Args:
        topology: a Topology over the gossip's members (fixed or time-varying), or None
            for Bagua's "all": the members' average.
        rows: the members (topology ranks) whose weights this process holds, in the
            order of x's rows: ``[its index]`` in a job, every member on the engine.
        member_ranks: member → the rank ``comm`` takes for it (the group's global ranks,
            or the node leaders' for a gossip between nodes).
        group: the process group ``comm`` exchanges in (for "all": the one averaged over).

    On the engine a peer is every worker's peer at once, a ``[n]`` long tensor (−1:
    none). Receive buffers are ``[W, D, L]`` zeros, a slot per neighbour; a worker with
    fewer than D neighbours keeps zeros in its last slots, which its zero weights turn
    into exact zero terms.

    Example::

        >>> import torch, topologies
        >>> from bagua_algos.engine.transport import StackedGroup
        >>> world = StackedGroup(4)
        >>> gossip = Gossip(topologies.RingTopology(4), [0, 1, 2, 3], [0, 1, 2, 3], world)
        >>> x = torch.arange(4.0).unsqueeze(1)
        >>> with comm.using_transport(world):
        ...     gossip.mix_(x, step=0)
        >>> [round(v, 4) for v in x.squeeze(1).tolist()]   # (x_{i-1} + x_i + x_{i+1}) / 3
        [1.3333, 1.0, 2.0, 1.6667]
    """

    def __init__(self, topology, rows: Sequence[int], member_ranks: Sequence[int], group):
        self.topology = topology
        self.rows = list(rows)
        self.member_ranks = list(member_ranks)
        self.group = group
        self.members = len(self.member_ranks) if topology is None else topology.world_size
        if topology is not None and topology.world_size != len(self.member_ranks):
            raise ValueError(f"member_ranks must name a rank for each of the topology's {topology.world_size} "
                             f"members, got {len(self.member_ranks)}")
        if not self.rows:
            raise ValueError("rows must name at least one member (the workers this process runs)")
        self._received: dict = {}  # (shape, dtype, device) -> [W, 1, L]: a time-varying exchange's receive buffer
        self.table = None
        if topology is None or self.members == 1:
            self.slots = 0  # an allreduce, or nothing: no receive slot
            return
        if topology.time_varying:
            self.slots = 1  # one peer in per exchange
            return
        self.table = NeighbourTable(topology, self.rows)
        self.slots = self.table.slots
        self._peers = [self._peer(self.table.neighbours[:, s].tolist()) for s in range(self.slots)]

    def _peer(self, members: list):
        """Members as ``comm`` takes a peer: a ``[W]`` long tensor of ranks (−1: none), W = 1 in a job."""
        ranks = [self.member_ranks[j] if j >= 0 else -1 for j in members]
        return torch.tensor(ranks, dtype=torch.long)

    def _as_rows(self, x: torch.Tensor) -> torch.Tensor:
        """x as ``[W, L]``: itself, or one worker's ``[L]`` viewed as ``[1, L]``."""
        w = len(self.rows)
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() == 2 and x.shape[0] == w:
            return x
        if x.dim() == 1 and w == 1:
            return x.unsqueeze(0)
        raise ValueError(f"x must be [W, L] with W = {w} (a row per worker this process runs)"
                         f"{' or [L]' if w == 1 else ''}; got shape {tuple(x.shape)}")

    def _buffer(self, x: torch.Tensor) -> torch.Tensor:
        key = (x.shape, x.dtype, x.device)
        if key not in self._received:
            self._received = {key: torch.zeros(x.shape[0], self.slots, x.shape[1], dtype=x.dtype, device=x.device)}
        return self._received[key]

    def _pairwise(self, rows: torch.Tensor, received: torch.Tensor, step: int):
        """A time-varying topology's exchange at ``step`` posted (each row to its
        out-peer, its in-peer's into ``received``); its handle. (Sending in pieces, each
        averaged while the later ones travel, was measured slower where the exchange is
        CPU: docs/benchmarks.md, "Against Decent-DP".)"""
        t = self.topology
        out = self._peer([t.out_peer(i, step) for i in self.rows])
        into = self._peer([t.in_peer(i, step) for i in self.rows])
        return comm.start_neighbor_exchange([(out, rows)], [(into, received)], group=self.group)

    @property
    def exchanges_pairwise(self) -> bool:
        """Whether an exchange is a time-varying topology's one send and one receive a
        row (what :meth:`start_exchange_into` posts)."""
        return self.members > 1 and self.topology is not None and self.topology.time_varying

    def exchange_into(self, x: torch.Tensor, out: torch.Tensor, step: int = 0):
        """:meth:`mix_into` in two halves, for a caller that writes the result back into
        x afterwards (Bagua's decentralized op): the exchange now, and ``finish(target)``
        returned, which leaves ``out`` as :meth:`mix_into` would, bit for bit, and copies
        it into ``target`` (x's storage, or None for no copy). A time-varying topology
        receives the peer's x into ``out`` now, and ``finish`` averages and copies in one
        sweep (:func:`pairwise_average_and_copy_`) once x may be written; until then
        ``out`` holds the peer's x. Anything else is :meth:`mix_into` now, and ``finish``
        the copy."""
        if not self.exchanges_pairwise:
            self.mix_into(x, out, step)
            return lambda target=None: out if target is None else target.copy_(out)
        handle, finish = self.start_exchange_into(x, out, step)
        handle.wait()
        return finish

    def start_exchange_into(self, x: torch.Tensor, out: torch.Tensor, step: int = 0):
        """A time-varying topology's :meth:`exchange_into` posted and not waited for:
        ``(handle, finish)``. After ``handle.wait()`` ``out`` holds the peer's x and
        ``finish`` is :meth:`exchange_into`'s; x must not be written, nor ``out`` read,
        before the wait."""
        if not self.exchanges_pairwise:
            raise ValueError("start_exchange_into posts a time-varying topology's exchange between two or more "
                             "members; call exchange_into for any other gossip")
        rows, into_rows = self._as_rows(x), self._as_rows(out)
        if into_rows.shape != rows.shape:
            raise ValueError(f"out must be shaped as x, {tuple(x.shape)}; got {tuple(out.shape)}")
        handle = self._pairwise(rows, into_rows, step)

        def finish(target=None):
            if target is None:
                return pairwise_average_(into_rows, rows)
            return pairwise_average_and_copy_(into_rows, rows, self._as_rows(target))

        return handle, finish

    def mix_(self, x: torch.Tensor, step: int = 0) -> None:
        """x ← W_t x in place (``step``: the exchange's index t, for a time-varying
        topology; counted from 0)."""
        rows = self._as_rows(x)
        if self.members == 1:
            return  # one member: W = 1
        if self.topology is None:
            comm.allreduce_inplace(x, comm.ReduceOp.AVG, group=self.group)
            return
        if self.topology.time_varying:
            received = self._buffer(rows)[:, 0]
            self._pairwise(rows, received, step).wait()
            pairwise_average_(rows, received)
            return
        self._fixed(rows, rows)

    def _fixed(self, rows: torch.Tensor, into_rows: torch.Tensor) -> None:
        """A fixed topology's exchange of ``rows`` with every neighbour, then
        into_rows ← w_ii · rows + Σ_j w_ij · received_j (``into_rows`` may be ``rows``)."""
        self_weight, weight = self.table.weights_as(rows)
        comm.neighbor_allreduce(rows, into_rows, self_weight,
                                [(peer, weight[:, s:s + 1]) for s, peer in enumerate(self._peers)], group=self.group)

    def mix_into(self, x: torch.Tensor, out: torch.Tensor, step: int = 0) -> torch.Tensor:
        """out ← W_t x, x left as it is (read while the exchange sends it): the terms
        and order of :meth:`mix_`, so ``out`` holds, bit for bit, what ``out.copy_(x)``
        and ``mix_(out, step)`` would leave there, without the copy. A time-varying
        topology receives the peer's x into ``out`` and adds x there (received + x, the
        same sum as x + received); a fixed one starts ``out`` as x · w_ii. ``out`` must
        not overlap x. ("all" and one member: the copy, then :meth:`mix_`.)"""
        rows, into_rows = self._as_rows(x), self._as_rows(out)
        if into_rows.shape != rows.shape:
            raise ValueError(f"out must be shaped as x, {tuple(x.shape)}; got {tuple(out.shape)}")
        if self.members == 1 or self.topology is None:
            out.copy_(x)
            self.mix_(out, step)
            return out
        if self.topology.time_varying:
            self._pairwise(rows, into_rows, step).wait()
            pairwise_average_(into_rows, rows)
            return out
        self._fixed(rows, into_rows)
        return out
