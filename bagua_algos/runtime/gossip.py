"""Gossip over a topology: :class:`NeighbourGossip` for the algorithms that gossip after
the optimizer step, written once for the workers a process runs, and :class:`NeighbourMix`,
the engine's compiled form of Bagua's decentralized op.

The gossip mix of stacked workers: x_i ← w_ii x_i + Σ_k w_{i,j_k} x_{j_k}, every
worker's row at once, the neighbours j_k in the topology's order and the weights its
Metropolis–Hastings row (:meth:`Topology.gossip_weights`).

It is the one-process engine's form of the gossip step of :class:`~.ops.
DecentralizedSynchronousOp` (a rank multiplies its own weights by w_ii, then adds
each neighbour's received weights times w_ij, in the same order): the op calls it when
its group is the engine's stacked workers, where a neighbour exchange and the adds would
be a gather per neighbour and a pass each. Where cuda_ext's CPU module is loaded, the
mix is one compiled sweep over the rows, the same terms in the same order
(csrc/engine_cpu.cpp).
"""

from __future__ import annotations

import functools

import torch

from . import comm
from .rows import RowGather, engine_cpu_passes, run_calls

__all__ = ["NeighbourGossip", "NeighbourMix"]


class NeighbourGossip:
    """x ← W_t x in place for the workers this process runs: ``x`` is ``[W, L]``, a row
    per worker (W = 1 in a job; the n stacked workers on the one-process engine), and the
    exchange is ``comm``'s neighbour exchange (between processes, or the stacked
    communicator's row gather), so one coding serves both.

    - a fixed topology: W its Metropolis–Hastings matrix, each row
      x_i ← w_ii x_i + Σ_k w_{i,j_k} x_{j_k}, the neighbours j_k in the topology's order;
    - a time-varying one (:class:`~topologies.OnePeerExponentialTopology`): at exchange t
      worker i sends x_i to ``out_peer(i, t)`` and x_i ← (x_i + x_{in_peer(i, t)}) / 2.

    ``rows`` are the group ranks of the W workers (:attr:`AlgorithmImpl.row_ranks`),
    ``global_rank`` maps a group rank to the rank ``comm`` takes; on the engine a peer is
    every worker's peer at once, a ``[n]`` long tensor (−1: none). Receive buffers are
    ``[W, D, L]`` zeros, a slot per neighbour; a worker with fewer than D neighbours
    keeps zeros in its last slots, which its zero weights turn into exact zero terms.

    Example::

        >>> import torch, topologies
        >>> from bagua_algos.runtime.comm.stacked import StackedGroup, stacked_world
        >>> world = StackedGroup(4)
        >>> gossip = NeighbourGossip(topologies.RingTopology(4), [0, 1, 2, 3], [0, 1, 2, 3], world)
        >>> x = torch.arange(4.0).unsqueeze(1)
        >>> with stacked_world(world):
        ...     gossip.mix_(x, step=0)
        >>> [round(v, 4) for v in x.squeeze(1).tolist()]   # (x_{i-1} + x_i + x_{i+1}) / 3
        [1.3333, 1.0, 2.0, 1.6667]
    """

    def __init__(self, topology, rows: list, global_rank: list, group):
        self.topology = topology
        self.group = group
        self.stacked = comm.is_stacked(group)
        self.rows = list(rows)
        self._global_rank = list(global_rank)
        self._received: dict = {}
        if topology.time_varying:
            self.slots = 1 if topology.world_size > 1 else 0
            return
        neighbours = [list(topology.neighbors(i)) for i in self.rows]
        weights = [topology.gossip_weights(i) for i in self.rows]
        self.slots = max((len(nb) for nb in neighbours), default=0)
        self._neighbours = torch.tensor([nb + [-1] * (self.slots - len(nb)) for nb in neighbours],
                                        dtype=torch.long).reshape(len(self.rows), self.slots)
        # float64, rounded once to the tensor's dtype where it is used
        self._self_weight = torch.tensor([[w[i]] for i, w in zip(self.rows, weights)], dtype=torch.float64)
        self._weight = torch.tensor([[w[j] for j in nb] + [0.0] * (self.slots - len(nb))
                                     for nb, w in zip(neighbours, weights)],
                                    dtype=torch.float64).reshape(len(self.rows), self.slots)
        self._as: dict = {}
        self._peers = [self._peer(self._neighbours[:, s].tolist()) for s in range(self.slots)]

    def _peer(self, group_ranks: list):
        """A peer as ``comm`` takes it: a global rank in a job, a ``[n]`` tensor on the engine."""
        if self.stacked:
            return torch.tensor(group_ranks, dtype=torch.long)
        return self._global_rank[group_ranks[0]]

    def _buffer(self, x: torch.Tensor) -> torch.Tensor:
        key = (x.shape, x.dtype, x.device)
        if key not in self._received:
            self._received = {key: torch.zeros(x.shape[0], self.slots, x.shape[1], dtype=x.dtype, device=x.device)}
        return self._received[key]

    def _weights(self, x: torch.Tensor):
        key = (x.dtype, x.device)
        if key not in self._as:
            self._as[key] = (self._self_weight.to(x.device, x.dtype), self._weight.to(x.device, x.dtype))
        return self._as[key]

    def mix_(self, x: torch.Tensor, step: int) -> None:
        """x ← W_t x in place (``step``: the exchange's index, for a time-varying topology)."""
        if self.slots == 0:
            return  # one worker: W = 1
        received = self._buffer(x)
        if self.topology.time_varying:
            t = self.topology
            out = self._peer([t.out_peer(i, step) for i in self.rows])
            into = self._peer([t.in_peer(i, step) for i in self.rows])
            comm.neighbor_exchange([(out, x)], [(into, received[:, 0])], group=self.group)
            x.add_(received[:, 0]).mul_(0.5)
            return
        sends, recvs = [], []
        for s, peer in enumerate(self._peers):
            sends.append((peer, x))
            recvs.append((peer, received[:, s]))
        comm.neighbor_exchange(sends, recvs, group=self.group)
        self_weight, weight = self._weights(x)
        x.mul_(self_weight)
        for s in range(self.slots):
            x.addcmul_(received[:, s], weight[:, s:s + 1])


class NeighbourMix:
    """x_i ← w_ii x_i + Σ_k w_{i,j_k} x_{j_k} for every row at once, the neighbours of
    each worker in the topology's order (a worker with fewer neighbours than the most
    connected one has nothing in its last slots).

    Each slot is a :class:`~.rows.RowGather`: a ring's slot is two multiply-adds of
    contiguous row ranges, not a gather into a fresh ``[n, d]`` tensor and an add.
    :meth:`mix` writes W x into a given tensor: the self term, then one multiply-add per
    slot (a ring: three passes over ``[n, d]``), prepared once per (x, out) pair as calls
    on views (:func:`~.rows.run_calls`). Where cuda_ext's CPU module is loaded,
    :meth:`mix_in_place_` does it in one sweep over x instead (csrc/engine_cpu.cpp)."""

    def __init__(self, topology, device):
        n = topology.world_size
        rows = [topology.gossip_weights(i) for i in range(n)]
        neighbours = [list(topology.neighbors(i)) for i in range(n)]
        slots = max((len(nb) for nb in neighbours), default=0)
        # weights in float64, rounded once to the parameters' dtype where they are used
        self.self_weight = torch.tensor([[rows[i][i]] for i in range(n)], dtype=torch.float64, device=device)
        self.slots = []  # (RowGather, weight [n, 1]) per neighbour slot
        for k in range(slots):
            index = [nb[k] if k < len(nb) else None for nb in neighbours]
            weight = [rows[i][nb[k]] if k < len(nb) else 0.0 for i, nb in enumerate(neighbours)]
            self.slots.append((RowGather(index, device),
                               torch.tensor(weight, dtype=torch.float64, device=device).unsqueeze(1)))
        self._prepared = {}  # (x, out) -> calls
        # the same rows for the compiled sweep: neighbour j_ik (−1: no term), w_ik
        self.neighbour = torch.tensor([[nb[k] if k < len(nb) else -1 for k in range(slots)] for nb in neighbours],
                                      dtype=torch.long).reshape(n, slots)
        self.weight = torch.tensor([[rows[i][nb[k]] if k < len(nb) else 0.0 for k in range(slots)]
                                    for i, nb in enumerate(neighbours)], dtype=torch.float64).reshape(n, slots)
        self._weights_as = {}  # dtype -> (self weights [n], weights [n, slots]) on the CPU

    def _calls(self, x: torch.Tensor, out: torch.Tensor) -> list:
        """The passes of ``mix(x, out)``, prepared for the last two (x, out) pairs (the
        form alternates between two storages)."""
        key = (x.data_ptr(), out.data_ptr(), x.shape, x.stride(), out.stride(), x.dtype, x.device)
        calls = self._prepared.get(key)
        if calls is None:
            calls = [(functools.partial(torch.mul, out=out), (x, self.self_weight.to(x.dtype)))]
            for gather, weight in self.slots:
                calls += gather.add_calls(out, x, weight.to(x.dtype))
            self._prepared = {**dict(list(self._prepared.items())[-1:]), key: calls}
        return calls

    def mix(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out ← W x (each row's terms in the order above); ``out`` must not overlap x."""
        run_calls(self._calls(x, out))
        return out

    def mix_in_place_(self, x: torch.Tensor) -> bool:
        """x ← W x by cuda_ext's compiled sweep, where it is loaded
        (:func:`~.rows.engine_cpu_passes`; the same terms in the same order, rounded alike);
        returns False, doing nothing, where it is not."""
        passes = engine_cpu_passes(x)
        if passes is None:
            return False
        if x.dtype not in self._weights_as:
            self._weights_as[x.dtype] = (self.self_weight.reshape(-1).to("cpu", x.dtype), self.weight.to(x.dtype))
        self_weight, weight = self._weights_as[x.dtype]
        passes.engine_gossip_mix_(x, self_weight, self.neighbour, weight)
        return True
