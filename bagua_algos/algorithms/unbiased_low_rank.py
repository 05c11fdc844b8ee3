"""The unbiased rank-r compressor of seed 001 (§4.1, Table 1) as a Bagua gradient
algorithm, registered as ``"unbiased_low_rank"``.

Each matrix M (a gradient viewed as ``view(shape[0], -1)``) that rank-r PowerSGD would
compress is sent as M U, U ∈ R^{m×r} with i.i.d. N(0, 1/r) entries drawn alike on every
worker each step (E[U Uᵀ] = I), averaged by allreduce and rebuilt as mean(M U) Uᵀ, an
unbiased estimate of the mean gradient; the other tensors are averaged whole. It is
PowerSGD's unbiased counterpart: one random projection instead of a power-iteration step,
and only the n × r factor travels (U is never sent).

No error feedback, as in the seed, and none offered: the compressor is not a contraction.
With Z = √r·U standard normal, E[Z Zᵀ Z Zᵀ] = r(r + m + 1)·I, so
E‖M − M U Uᵀ‖² = ‖M‖²·(m + 1)/r, more than ‖M‖² for every r ≤ m: a residual kept
would grow step by step (a 20-step run of the engine's small job with it went to NaN). The math and the bucket op are shared with the other sketches
(:mod:`bagua_algos.compression.random_sketch`, :mod:`.random_sketch`).
"""

from __future__ import annotations

from ..arguments import check_int, check_real, check_seed
from ..compression import random_sketch as sketch
from .random_sketch import RandomSketchAlgorithm
from .table import AlgorithmConfig, register_algorithm

__all__ = ["UnbiasedLowRankAlgorithm"]


class UnbiasedLowRankAlgorithm(RandomSketchAlgorithm):
    """Unbiased rank-r gradient compression (seed 001 Table 1).

    Args:
        rank: r, the columns of U (int ≥ 1; a matrix with fewer rows or columns gets
            that smaller rank).
        min_compression_rate: compress a matrix only if n·m ≥ rate·(n + m)·r, PowerSGD's
            rule, so both compress the same matrices (≥ 1).
        seed: the U's (the same on every worker).
    """

    method = "unbiased_low_rank"

    error_feedback = False  # (the module's notes)

    def __init__(self, rank: int = 1, min_compression_rate: float = 2.0, seed: int = 0):
        self.rank = check_int("rank", rank, 1)
        self.min_compression_rate = check_real("min_compression_rate", min_compression_rate, 1.0)
        self.seed = check_seed(seed)

    def plan(self, shapes):
        return sketch.make_plan(self.method, shapes, rank=self.rank, min_compression_rate=self.min_compression_rate)


register_algorithm(
    "unbiased_low_rank", UnbiasedLowRankAlgorithm,
    "unbiased rank-r compression: M U with a shared random U, E[U Uᵀ] = I (seed 001 Table 1)",
    # One of seed 001's linear compressors (allreduce; the same model everywhere).
    rows=[(210, AlgorithmConfig("unbiased_low_rank", "unbiased_low_rank", {"rank": 2}))],
)
