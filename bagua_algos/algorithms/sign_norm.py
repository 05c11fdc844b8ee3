"""Sign+Norm with error feedback (seed 001 Table 4, Appendix G.3), registered as
``sign_norm``.

Each worker sends, for every tensor of a bucket, the signs of its contribution
a = g + e (1 bit each, packed 8 to a byte) and one float32 scale s = ‖a‖₁ / N_t; the
workers allgather the messages, and every worker's gradient becomes
(1/W) Σ_w s_w·S_w, tensor by tensor. The error buffer keeps e ← a − s·S (Algorithm 2).
A zero is sent as +1 (a 1-bit sign has no zero). The math is
:mod:`bagua_algos.compression.signs`; the op is the allgather compressors'
(:mod:`.allgather_compression`). A worker sends ⌈N/8⌉ + 4·T bytes per bucket of N
values in T tensors: about 1/32 of float32.
"""

from __future__ import annotations

import torch

from ..arguments import check_flag
from ..compression.signs import SignNormCodec
from .allgather_compression import AllgatherCompressionAlgorithm
from .table import AlgorithmConfig, register_algorithm

__all__ = ["SignNormAlgorithm"]


class SignNormAlgorithm(AllgatherCompressionAlgorithm):
    """Sign+Norm gradient compression with error feedback, aggregated by allgather.

    Args:
        error_feedback: keep a − s·S and add it to the next contribution (True: the
            seed's setting).
    """

    def __init__(self, error_feedback: bool = True):
        self.error_feedback = check_flag("error_feedback", error_feedback)

    def make_codec(self, shapes: list, dtype: torch.dtype) -> SignNormCodec:
        return SignNormCodec([torch.Size(s).numel() for s in shapes])


register_algorithm(
    "sign_norm", SignNormAlgorithm, "Sign+Norm: 1-bit signs and one L1 scale per tensor, allgathered, error feedback",
    # Deterministic, every worker applies the same update. Across devices a value's sign
    # can flip on a rounding difference and move that weight by a learning-rate-sized step.
    rows=[(250, AlgorithmConfig("sign_norm", "sign_norm", tolerance=5e-3))],
)
