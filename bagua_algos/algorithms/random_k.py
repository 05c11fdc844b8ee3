"""Random K compression of seed 001 (Table 4, Appendix G.2) as a Bagua gradient
algorithm, registered as ``"random_k"``.

Each tensor, flattened, sends b entries drawn uniformly without replacement, the same on
every worker each step; the values of a bucket are averaged by one allreduce and written
back in place, every other entry of the update being 0. It sends as much as Random Block
but reads and writes scattered entries, and draws b of numel indices each step (a
``randperm`` on the CPU, moved to the device), which the seed names as why it is slower.
With error feedback (the default, as the seed's Table 4 runs it) each worker keeps what
it did not send and adds it to its next gradient. b is what rank-r
PowerSGD sends for that tensor (``powersgd_rank=r``: (n + m)·r for a matrix PowerSGD
compresses, the whole tensor otherwise; the seed's setting) or ceil(numel / c)
(``compression_ratio=c``). The math and the bucket op are shared with the other sketches
(:mod:`bagua_algos.compression.random_sketch`, :mod:`.random_sketch`).
"""

from __future__ import annotations

from .random_sketch import RandomSelectionAlgorithm
from .table import AlgorithmConfig, register_algorithm

__all__ = ["RandomKAlgorithm"]


class RandomKAlgorithm(RandomSelectionAlgorithm):
    """Random K gradient compression with error feedback (seed 001 Table 4); the
    arguments are :class:`~.random_sketch.RandomSelectionAlgorithm`'s."""

    method = "random_k"


register_algorithm(
    "random_k", RandomKAlgorithm,
    "Random K: shared random entries of each tensor, allreduced, with error feedback (seed 001 Table 4)",
    # At rank-2 PowerSGD's bytes (Table 4's "high rank 2" regime).
    rows=[(230, AlgorithmConfig("random_k", "random_k", {"powersgd_rank": 2}))],
)
