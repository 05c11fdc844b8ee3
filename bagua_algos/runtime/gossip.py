"""The gossip mix of stacked workers: x_i ← w_ii x_i + Σ_k w_{i,j_k} x_{j_k}, every
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

from .rows import RowGather, engine_cpu_passes, run_calls

__all__ = ["NeighbourMix"]


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
