"""The engine's neighbour allreduce: x ← W x for all n stacked rows, read from x itself.

What ``comm.neighbor_allreduce`` computes in a process (the exchange into receive
buffers, then x_i · w_ii and a multiply-add per slot), the engine computes from x's own
rows: every worker's neighbours are rows of the same tensor, so no receive buffer and no
exchange copy are needed."""

from __future__ import annotations

import functools
from typing import Optional

import torch

from ..runtime.topology import NeighbourTable
from .rows import RowGather, engine_cpu_passes, run_calls

__all__ = ["StackedMix"]


class StackedMix:
    """x ← W x for all n stacked rows of a fixed topology, the neighbours read from x.

    Row i: (1) out_i = x_i · w_ii, one product; (2) out_i += x_{j_ik} · w_ik for each slot
    k in order, one multiply-add; rows without a k-th neighbour (-1 in ``neighbours``)
    take nothing, where a process adds 0·0, an exact zero. These are a process's terms
    in its order, with the same weights, so every worker's result is what its process
    computes.

    Two codings: :meth:`mix` (torch passes: each slot a :class:`~.rows.RowGather`, a
    ring's slot two strided multiply-adds, prepared once per (x, out) pair) and, where
    cuda_ext's CPU module is loaded, its ``engine_gossip_mix_`` (one sweep, in place, in
    column blocks kept in L2; csrc/engine_cpu.cpp). :meth:`mix_` takes the compiled one
    where it can.

    Args:
        neighbours: ``[n, D]`` long, row i's k-th neighbour (a row), -1 where it has none;
            or a :class:`~bagua_algos.runtime.topology.NeighbourTable` of every row in
            order, whose weights a call then uses when it is given none.
    """

    def __init__(self, neighbours):
        self.table = None
        if isinstance(neighbours, NeighbourTable):
            if neighbours.rows != list(range(len(neighbours.rows))):
                raise ValueError(f"the table must hold every row of the stacked world in order, got rows "
                                 f"{neighbours.rows}")
            self.table, neighbours = neighbours, neighbours.neighbours
        if not isinstance(neighbours, torch.Tensor) or neighbours.dim() != 2:
            raise ValueError(f"neighbours must be an [n, D] long tensor or a NeighbourTable, got {neighbours!r}")
        self.neighbours = neighbours.to(torch.long)
        self.n, self.slots = self.neighbours.shape
        self._slots = [[None if j < 0 else j for j in self.neighbours[:, k].tolist()] for k in range(self.slots)]
        self._by_device: dict = {}  # device -> its row gathers
        self._prepared: dict = {}  # (x, out, weights) -> calls
        self._spare: Optional[torch.Tensor] = None

    def _gathers_on(self, device) -> list:
        key = str(device)
        if key not in self._by_device:
            self._by_device[key] = [RowGather(rows, device) for rows in self._slots]
        return self._by_device[key]

    def _calls(self, x: torch.Tensor, out: torch.Tensor, self_weight: torch.Tensor, weight: torch.Tensor) -> list:
        """The passes of ``mix(x, out, ...)``, prepared for the last two argument sets."""
        key = (x.data_ptr(), out.data_ptr(), x.shape, x.stride(), out.stride(), x.dtype, x.device,
               self_weight.data_ptr(), weight.data_ptr())
        calls = self._prepared.get(key)
        if calls is None:
            calls = [(functools.partial(torch.mul, out=out), (x, self_weight))]
            for k, gather in enumerate(self._gathers_on(x.device)):
                calls += gather.add_calls(out, x, weight[:, k:k + 1])
            self._prepared = {**dict(list(self._prepared.items())[-1:]), key: calls}
        return calls

    def _check(self, name: str, t: torch.Tensor) -> None:
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[0] != self.n:
            raise ValueError(f"{name} must be [{self.n}, L] (a row per stacked worker), "
                             f"got {tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")

    def _weights(self, x: torch.Tensor, self_weight, weight) -> tuple:
        """The weights given, else the table's in x's dtype."""
        if self_weight is None or weight is None:
            if self.table is None:
                raise ValueError("self_weight and weight must be given: this mix has no NeighbourTable")
            return self.table.weights_as(x)
        return self_weight, weight

    def mix(self, x: torch.Tensor, out: torch.Tensor, self_weight: Optional[torch.Tensor] = None,
            weight: Optional[torch.Tensor] = None) -> torch.Tensor:
        """out ← W x by torch passes (the terms above, in their order); ``out`` must not
        overlap x. ``self_weight`` ``[n, 1]`` and ``weight`` ``[n, D]`` in x's dtype."""
        self._check("x", x)
        self._check("out", out)
        self_weight, weight = self._weights(x, self_weight, weight)
        run_calls(self._calls(x, out, self_weight, weight))
        return out

    def mix_compiled_(self, x: torch.Tensor, self_weight: Optional[torch.Tensor] = None,
                      weight: Optional[torch.Tensor] = None) -> bool:
        """x ← W x in place by cuda_ext's compiled sweep where it is loaded
        (:func:`~.rows.engine_cpu_passes`); returns False, doing nothing, where it is not."""
        passes = engine_cpu_passes(x)
        if passes is None:
            return False
        self_weight, weight = self._weights(x, self_weight, weight)
        passes.engine_gossip_mix_(x, self_weight.reshape(-1), self.neighbours, weight)
        return True

    def mix_(self, x: torch.Tensor, self_weight: Optional[torch.Tensor] = None,
             weight: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x ← W x in place: compiled where loaded, else the torch passes into a spare,
        copied back."""
        self._check("x", x)
        self_weight, weight = self._weights(x, self_weight, weight)
        if self.mix_compiled_(x, self_weight, weight):
            return x
        if self._spare is None or self._spare.shape != x.shape or self._spare.dtype != x.dtype \
                or self._spare.device != x.device:
            self._spare = torch.empty_like(x)
        return x.copy_(self.mix(x, self._spare, self_weight, weight))
