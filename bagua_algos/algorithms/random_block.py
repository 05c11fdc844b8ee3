"""Random Block compression of seed 001 (Table 4, Appendix G.1) as a Bagua gradient
algorithm, registered as ``"random_block"``.

Each tensor, flattened, sends b consecutive entries from a start drawn uniformly, the same
on every worker each step (a block running past the end wraps to the start); the blocks
of a bucket are averaged by one allreduce and written back in place, every other entry of
the update being 0. With error feedback (the default, as the seed's Table 4 runs it) each
worker keeps what it did not send and adds it to its next gradient. b is what rank-r
PowerSGD sends for that tensor (``powersgd_rank=r``: (n + m)·r for a matrix PowerSGD
compresses, the whole tensor otherwise; the seed's setting) or ceil(numel / c)
(``compression_ratio=c``). The math and the bucket op are shared with the other sketches
(:mod:`bagua_algos.compression.random_sketch`, :mod:`.random_sketch`).
"""

from __future__ import annotations

from .random_sketch import RandomSelectionAlgorithm
from .table import AlgorithmConfig, register_algorithm

__all__ = ["RandomBlockAlgorithm"]


class RandomBlockAlgorithm(RandomSelectionAlgorithm):
    """Random Block gradient compression with error feedback (seed 001 Table 4); the
    arguments are :class:`~.random_sketch.RandomSelectionAlgorithm`'s."""

    method = "random_block"


register_algorithm(
    "random_block", RandomBlockAlgorithm,
    "Random Block: a shared random contiguous block of each tensor, allreduced, with error feedback (seed 001 Table 4)",
    # At rank-2 PowerSGD's bytes (Table 4's "high rank 2" regime).
    rows=[(220, AlgorithmConfig("random_block", "random_block", {"powersgd_rank": 2}))],
)
