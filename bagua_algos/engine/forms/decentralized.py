"""decentralized (D-PSGD) on the stacked state:

    x_i^{t+1} = Σ_j W_ij x_j^t − (the optimizer's update from ∇f_i(x_i^t))

The per-rank op takes X^t before forward (its copy into ``peer_weight``) and its
post-backward hook copies the gossip result back; the parameters do not change in
between, so the form computes the mixture W X^t after backward, into a spare ``[n, d]``
tensor that then becomes the parameters' storage (``StackedModel.swap_params``: no copy
back; the old storage is the next spare), or in place by cuda_ext's compiled sweep where
its CPU module is loaded (:meth:`NeighbourMix.mix_in_place_`), and the optimizer step
then applies each worker's gradient to it. W is:

- ``peer_selection_mode="all"`` (flat or hierarchical: the engine is one node, where the
  hierarchical average is the exact average): (1/n) 11ᵀ;
- ``"shift_one"``: (x_i + x_peer) / 2 with Bagua's pairing :func:`shift_one_peer` at the
  exchange count (0, 1, 2, … over the communicating steps);
- ``topology=``: the topology's Metropolis–Hastings row of every worker, as
  ``w_ii x_i + Σ_k w_{i,j_k} x_{j_k}`` over the neighbours j_k in the topology's order
  (one gather and one multiply-add per neighbour slot, not a dense n × n product).
"""

from __future__ import annotations

import functools

import torch

from ...algorithms.model_averaging import communicates_at
from ...runtime.ops import shift_one_peer
from ...runtime.topology import resolve_topology
from .base import StackedForm
from .rows import RowGather, engine_cpu_passes, run_calls


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


class DecentralizedForm(StackedForm):
    def __init__(self, algorithm, engine):
        super().__init__(algorithm, engine)
        self.exchanges = 0  # the per-rank op's "decentralized_exchanges" (shift_one's schedule)
        self.mix = None
        if algorithm.topology is not None:
            topology = resolve_topology(algorithm.topology, self.n, members="the engine's workers")
            self.mix = NeighbourMix(topology, engine.device)
        elif algorithm.peer_selection_mode == "shift_one" and self.n > 1 and self.n % 2:
            raise ValueError(f"shift_one needs an even number of workers, got {self.n}")
        self._exchange = None  # the exchange taken at before_forward, mixed at after_backward
        self._spare = None  # [n, d]: the mixture is written here, then becomes the parameters

    def _communicates(self, step: int) -> bool:
        return communicates_at(step, self.algorithm.communication_interval)

    @torch.no_grad()
    def before_forward(self, step: int) -> None:
        # The per-rank op takes x^t here; the parameters do not change until the
        # optimizer's step, so the mix of x^t is computed in after_backward.
        if self._communicates(step):
            self._exchange = self.exchanges
            self.exchanges += 1

    @torch.no_grad()
    def after_backward(self, step: int) -> None:
        if self._exchange is None:
            return
        exchange, self._exchange = self._exchange, None
        model = self.engine.model
        x = model.params.detach()
        if self.n == 1:
            return  # one worker: the gossip result is its own weights
        if self.mix is None and self.algorithm.peer_selection_mode != "shift_one":
            x.copy_(x.sum(0, keepdim=True).div_(self.n).expand_as(x))
            return
        if self.mix is not None and self.mix.mix_in_place_(x):
            return
        if self._spare is None:
            self._spare = torch.empty_like(x)
        if self.mix is not None:
            mixed = self.mix.mix(x, self._spare)
        else:
            peers = torch.tensor([shift_one_peer(i, self.n, exchange) for i in range(self.n)], device=x.device)
            mixed = torch.index_select(x, 0, peers, out=self._spare).add_(x).mul_(0.5)  # (x_peer + x_i) / 2
        # the mixture becomes the parameters without a copy; their old storage is the
        # next step's spare
        self._spare = model.swap_params(mixed)
