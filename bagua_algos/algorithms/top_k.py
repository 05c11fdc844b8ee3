"""Top K with error feedback (seed 001 Table 4, Appendix G.4), registered as ``top_k``.

Each worker sends, for every tensor of a bucket, the K_t entries of its contribution
a = g + e of largest magnitude (values and positions); the workers allgather the
messages, and every worker's gradient becomes the average of the scattered values,
(1/W) Σ_w Σ_{i ∈ I_w} a_w(i)·e_i. The entries not sent stay in the worker's error
buffer, e ← a with its sent entries zeroed, and join the next step's contribution
(Algorithm 2). The math is :mod:`bagua_algos.compression.topk`; the op is the
allgather compressors' (:mod:`.allgather_compression`).

K is set by ``bytes_fraction``, the bytes of a tensor's message, values and int32
positions together, over the tensor's own bytes (K_t = ⌊fraction·N_t/2⌋ at float32).
For the seed's "same bytes as rank-r PowerSGD" pass PowerSGD's bytes over the model's
gradient bytes. The default 1/32 is the seed's medium regime (Sign+Norm's bytes).
"""

from __future__ import annotations

import torch

from ..arguments import check_flag, check_real
from ..compression.topk import TopKCodec
from .allgather_compression import AllgatherCompressionAlgorithm
from .table import AlgorithmConfig, register_algorithm

__all__ = ["TopKAlgorithm"]


class TopKAlgorithm(AllgatherCompressionAlgorithm):
    """Top K gradient compression with error feedback, aggregated by allgather.

    Args:
        bytes_fraction: a tensor's message (values + positions) over its own bytes, in
            (0, 1]; K_t = ⌊fraction·N_t·v/(v + i)⌋ ≥ 1 (v, i: the bytes of a value and
            of a position).
        error_feedback: keep what was not sent and add it to the next contribution
            (True: the seed's setting; False: plain Top K).
    """

    def __init__(self, bytes_fraction: float = 1 / 32, error_feedback: bool = True):
        self.bytes_fraction = check_real("bytes_fraction", bytes_fraction, 0.0, 1.0, low_open=True)
        self.error_feedback = check_flag("error_feedback", error_feedback)

    def make_codec(self, shapes: list, dtype: torch.dtype) -> TopKCodec:
        return TopKCodec([torch.Size(s).numel() for s in shapes], self.bytes_fraction, dtype)


register_algorithm(
    "top_k", TopKAlgorithm, "Top K: each tensor's K largest entries (values + positions) allgathered, error feedback",
    # Deterministic, every worker applies the same update. Across devices which entry is
    # K-th largest can flip on a rounding difference and move that weight by a
    # learning-rate-sized step.
    rows=[(240, AlgorithmConfig("top_k", "top_k", {"bytes_fraction": 0.1}, tolerance=5e-3))],
)
