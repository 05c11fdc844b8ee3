"""Spectral Atomo (Wang et al., 2018) as seed 001 runs it (Table 6, Appendix G.6),
registered as ``atomo``.

Every step, each worker decomposes each gradient matrix of a bucket by a full SVD,
draws exactly ``rank`` of its singular components with Atomo's variance-minimising
probabilities p_i, and sends U' = [σ_i/p_i·u_i] and V' = [v_i] (the bytes of rank-r
PowerSGD for the same matrix); the workers allgather them and every worker's gradient
becomes (1/W) Σ_w U'_w V'_wᵀ. The seed runs it "in its original form, without error
feedback", with the optimizer's momentum 0.9 after the exchange and its own learning
rate (Appendix I: 0.1 per worker for CIFAR-10, as SGD's); ``error_feedback=True`` keeps
e ← a − U'V'ᵀ as the other compressors do. The math and the random draws are
:mod:`bagua_algos.compression.atomo`; the op is the allgather compressors'
(:mod:`.allgather_compression`). Rank r's draws come from a CPU generator seeded
``rank_seed(seed, r)``, saved in the algorithm's state dict.

The SVD every step is what the seed measured as Atomo's cost (948 ms a batch against
SGD's 312 ms in its Table 6); this one is as slow, by design.
"""

from __future__ import annotations

import torch

from ..arguments import check_choice, check_flag, check_int, check_seed
from ..compression.atomo import ATOMO_VIEWS, AtomoCodec
from .allgather_compression import AllgatherCompressionAlgorithm
from .table import AlgorithmConfig, register_algorithm

__all__ = ["AtomoAlgorithm"]


class AtomoAlgorithm(AllgatherCompressionAlgorithm):
    """Spectral Atomo: SVD, importance sampling of exactly ``rank`` components, allgather.

    Args:
        rank: components sent per matrix (int ≥ 1; capped at min(n, m)).
        error_feedback: keep a − U'V'ᵀ and add it to the next contribution (False: the
            seed's setting).
        seed: rank r draws its components from a CPU generator seeded ``rank_seed(seed, r)``.
        matrix_view: how a tensor is viewed as a matrix: ``"powersgd"`` (shape[0] × rest, so
            Atomo's bytes equal PowerSGD's at the same rank) or ``"seed"`` (seed 001's code:
            a vector as N/2 × 2, a convolution as (out·in/2) × (2·k·k); fewer rows, less
            compression, Table 6's budget; :mod:`bagua_algos.compression.atomo`).
    """

    samples = True

    def __init__(self, rank: int = 2, error_feedback: bool = False, seed: int = 0, matrix_view: str = "powersgd"):
        self.rank = check_int("rank", rank, 1)
        self.error_feedback = check_flag("error_feedback", error_feedback)
        self.seed = check_seed(seed)
        self.matrix_view = check_choice("matrix_view", matrix_view, ATOMO_VIEWS)

    def make_codec(self, shapes: list, dtype: torch.dtype) -> AtomoCodec:
        return AtomoCodec(shapes, self.rank, dtype, self.matrix_view)


register_algorithm(
    "atomo", AtomoAlgorithm, "Spectral Atomo: an SVD per matrix, exactly r components importance-sampled, allgathered",
    # Atomo draws its components on the CPU (the same sets on every device); a CUDA SVD
    # rounds otherwise, and a component's σ/p is a large factor.
    rows=[(270, AlgorithmConfig("atomo", "atomo", {"rank": 2}, tolerance=5e-3))],
)
