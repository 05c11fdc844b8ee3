"""Spectral Atomo (Wang et al., 2018) as seed 001 runs it (Table 6, Appendix G.6,
Algorithm 8): pure tensor math; the allgather step is :mod:`bagua_algos.compression.
allgather`'s.

Each gradient matrix M (n × m) of a bucket is decomposed by a full (thin) SVD,
M = Σ_i σ_i u_i v_iᵀ, every step. Atomo keeps component i with probability p_i and
rescales it by 1/p_i, so that Σ_i 1{i kept}·σ_i/p_i·u_i v_iᵀ is M in expectation:

- **the probabilities** (:func:`atomo_probabilities`, Wang et al.'s "ATOMO
  probabilities"): for a budget of s components, the p minimising the variance
  Σ_i σ_i²/p_i subject to Σ_i p_i = s and 0 ≤ p_i ≤ 1. The solution is p_i =
  min(1, c·σ_i): the largest components are kept surely (p = 1) while s·σ_i is at
  least the sum of the σ's not yet kept; the others get p_i = s'·σ_i / Σ σ_rest, s'
  the budget left. A zero σ gets p = 0.
- **exactly r components** (the seed's modification, Appendix G.6): the inclusions are
  drawn independently with probabilities p, again and again until exactly r are
  drawn, so every message has the same size (the estimate is then no longer exactly
  unbiased; the seed found no effect on the run). A matrix with no more than r nonzero
  σ's sends those, exactly, and zero columns for the rest.
- **the message**: U' = [σ_i/p_i · u_i] (n × r) and V' = [v_i] (m × r), in the
  gradients' dtype; the update is (1/W) Σ_w U'_w V'_wᵀ.

r is ``rank``, capped at min(n, m). The matrix a tensor is viewed as is ``view``:
``"powersgd"`` (the default) views a tensor of two or more dimensions as shape[0] × (the
rest), as PowerSGD does, and a vector as 1 × N, whose one singular triple is sent exactly
(N + 1 values): Atomo's bytes then equal PowerSGD's at the same rank. ``"seed"`` is the
reshape of seed 001's code (its Appendix G.6: Atomo "treats tensors as matrices"
differently, "lower compression at the same rank"): a vector of even length N as N/2 × 2,
a tensor whose dimensions after the second are all 1 as shape[0] × shape[1], any other
(a convolution kernel out × in × k × k) as (out·in/2) × (2·k·k); an odd length or
out·in falls back to the "powersgd" view. On ResNet-18 at rank 2 that is about 9× fewer
bytes than the full gradient, Table 6's 113 MB of SGD's 1023 MB.

Random numbers: the inclusions are drawn on the CPU, from the sending worker's
generator (its rank's stream, ``rank_seed(seed, rank)``), in batches of
:data:`TRIALS_PER_DRAW` trials of which the first with exactly r inclusions is taken
(the same law as drawing one trial at a time); so a process and the one-process engine
draw the same sets, and a CPU run and a CUDA run of one seed too. The SVD runs on the
tensor's device (the seed ran it on the CPU, where its GPU was slower); its result and
the probabilities are read on the host every step (the probabilities decide the
loop), so on CUDA each matrix waits for its SVD.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from ..arguments import check_int
from .allgather import as_bytes, from_bytes
from .powersgd import matrix_shape as powersgd_matrix_shape

__all__ = ["AtomoCodec", "atomo_probabilities", "sample_exactly", "matrix_shape", "seed_matrix_shape", "ATOMO_VIEWS",
           "TRIALS_PER_DRAW", "MAX_DRAWS"]
ATOMO_VIEWS = ("powersgd", "seed")

TRIALS_PER_DRAW = 64
MAX_DRAWS = 1000  # 64 000 trials: P(exactly r) is ≥ ~1/(e·√(2πr)) when Σp = r, far above 1/64 000


def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """The matrix a tensor of ``shape`` is decomposed as: PowerSGD's view (shape[0] ×
    rest, :func:`bagua_algos.compression.powersgd.matrix_shape`), a vector 1 × N."""
    return powersgd_matrix_shape(shape) or (1, math.prod(shape))


def seed_matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """The matrix seed 001's Atomo code decomposes a tensor of ``shape`` as (module notes):
    N/2 × 2 for a vector, shape[0] × shape[1] when the later dimensions are all 1, else
    (shape[0]·shape[1]/2) × the rest; :func:`matrix_shape` where a half is not whole."""
    numel = math.prod(shape)
    if len(shape) == 1:
        return (numel // 2, 2) if numel % 2 == 0 else matrix_shape(shape)
    if all(s == 1 for s in shape[2:]):
        return (shape[0], shape[1])
    rows = shape[0] * shape[1]
    return (rows // 2, numel // (rows // 2)) if rows % 2 == 0 else matrix_shape(shape)


def atomo_probabilities(sigma: torch.Tensor, budget: int) -> torch.Tensor:
    """Wang et al.'s variance-minimising inclusion probabilities of singular values
    ``sigma`` (descending, ≥ 0; float64 on the CPU advised) for ``budget`` components: p_i
    = 1 for the leading ones while budget_left·σ_i ≥ Σ of the σ's from i on, then p_i =
    budget_left·σ_i / that sum; p = 0 where σ = 0; Σ p = min(budget, #nonzero σ)."""
    k = sigma.numel()
    p = torch.zeros_like(sigma)
    tail = sigma.flip(0).cumsum(0).flip(0)  # tail[i] = Σ_{j ≥ i} σ_j
    left = budget
    for i in range(k):
        if left <= 0 or tail[i] <= 0:
            break
        if left * sigma[i] >= tail[i]:  # kept surely; the next one is compared with the rest
            p[i] = 1.0
            left -= 1
            continue
        p[i:] = left * sigma[i:] / tail[i]
        break
    return p


def sample_exactly(p: torch.Tensor, r: int, generator: torch.Generator) -> torch.Tensor:
    """Indices (ascending, int64, on the CPU) of a draw of independent inclusions with
    probabilities ``p`` (CPU), conditioned on exactly ``r`` inclusions: trials of
    :data:`TRIALS_PER_DRAW` at a time, the first with r inclusions taken. If fewer than
    r of the p's are positive, those are returned (the caller pads)."""
    positive = int((p > 0).sum())
    if positive <= r:
        return torch.nonzero(p > 0).flatten()
    for _ in range(MAX_DRAWS):
        kept = torch.rand(TRIALS_PER_DRAW, p.numel(), generator=generator, dtype=p.dtype) < p
        hits = torch.nonzero(kept.sum(1) == r).flatten()
        if hits.numel():
            return torch.nonzero(kept[hits[0]]).flatten()
    raise RuntimeError(f"Atomo: no draw of {MAX_DRAWS * TRIALS_PER_DRAW} kept exactly {r} components "
                       f"(probabilities {p.tolist()})")


class AtomoCodec:
    """Spectral Atomo of a bucket of tensors of ``shapes`` at rank ``rank``, values of ``dtype``,
    each tensor viewed as a matrix by ``view`` (``"powersgd"`` or ``"seed"``, the module's notes)."""

    def __init__(self, shapes: Sequence[Sequence[int]], rank: int, dtype: torch.dtype, view: str = "powersgd"):
        self.rank = check_int("rank", rank, 1)
        self.shapes = [tuple(s) for s in shapes]
        if not self.shapes:
            raise ValueError("shapes must name at least one tensor")
        if view not in ATOMO_VIEWS:
            raise ValueError(f"view must be one of {list(ATOMO_VIEWS)}, got {view!r}")
        shape_of = seed_matrix_shape if view == "seed" else matrix_shape
        self.matrices = [shape_of(s) for s in self.shapes]
        self.ranks = [min(self.rank, n, m) for n, m in self.matrices]
        self.numels = [n * m for n, m in self.matrices]
        self.numel = sum(self.numels)
        self.dtype = dtype
        self.message_values = sum(r * (n + m) for r, (n, m) in zip(self.ranks, self.matrices))
        self.message_bytes = self.message_values * torch.empty((), dtype=dtype).element_size()

    def encode(self, contributions: torch.Tensor, generators=None) -> torch.Tensor:
        """``[W, N]`` → ``[W, B]``: per matrix, one SVD of all W rows (batched), then row w's
        components drawn from ``generators[w]``."""
        if generators is None or len(generators) != contributions.shape[0]:
            raise ValueError(f"generators must be one torch.Generator per row ({contributions.shape[0]}), "
                             f"got {generators!r}")
        W = contributions.shape[0]
        pieces = []
        for part, (n, m), r in zip(contributions.split(self.numels, dim=1), self.matrices, self.ranks):
            u, s, vh = torch.linalg.svd(part.reshape(W, n, m).float(), full_matrices=False)
            s_host = s.double().cpu()
            us = torch.zeros(W, n, r, dtype=torch.float32, device=part.device)
            vs = torch.zeros(W, m, r, dtype=torch.float32, device=part.device)
            for w in range(W):
                p = atomo_probabilities(s_host[w], r)
                chosen = sample_exactly(p, r, generators[w])
                c = len(chosen)
                scale = (s_host[w, chosen] / p[chosen]).to(torch.float32).to(part.device)
                index = chosen.to(part.device)
                us[w, :, :c] = u[w][:, index] * scale
                vs[w, :, :c] = vh[w][index, :].T
            pieces += [us.reshape(W, -1), vs.reshape(W, -1)]
        return as_bytes(torch.cat(pieces, dim=1).to(self.dtype))

    def _factors(self, messages: torch.Tensor):
        values = from_bytes(messages, self.dtype).float()
        offset = 0
        for (n, m), r in zip(self.matrices, self.ranks):
            us = values[:, offset:offset + n * r].reshape(-1, n, r)
            offset += n * r
            vs = values[:, offset:offset + m * r].reshape(-1, m, r)
            offset += m * r
            yield us, vs

    def decode(self, messages: torch.Tensor) -> torch.Tensor:
        """``[W, N]``: each sender's U'V'ᵀ, matrix by matrix."""
        return torch.cat([(us @ vs.transpose(1, 2)).reshape(messages.shape[0], -1)
                          for us, vs in self._factors(messages)], dim=1)

    def aggregate(self, messages: torch.Tensor) -> torch.Tensor:
        """(1/W) Σ_w U'_w V'_wᵀ, matrix by matrix (float32), as one product
        [U'_1 … U'_W]·[V'_1 … V'_W]ᵀ (inner dimension W·r; no ``[W, N]`` buffer)."""
        W = messages.shape[0]
        return torch.cat([(us.permute(1, 0, 2).reshape(us.shape[1], -1)
                           @ vs.permute(1, 0, 2).reshape(vs.shape[1], -1).T).reshape(-1)
                          for us, vs in self._factors(messages)]) / W
