"""Signum: signSGD with momentum and majority vote (Bernstein et al., 2019), as seed 001
runs it (Table 6, Appendix G.5 and I), registered as ``signum``.

Where the pieces sit (seed 001 G.5: "its original form, without error feedback, with
momentum of 0.9"; its training code keeps the momentum *before* the exchange, as an
exponential moving average, and adds weight decay *after* it):

1. each worker keeps its own momentum of its own gradients, m ← β·m + (1 − β)·g
   (β = ``momentum``, m = 0 at first, so the first step sends sign(g));
2. it sends sign(m), 1 bit per value packed 8 to a byte; the workers allgather them;
3. the gradient becomes the majority vote V = sign(Σ_w sign(m_w)) ∈ {−1, 0, +1}
   (0 on a tie, possible with an even number of workers);
4. the user's optimizer applies it with the learning rate: with
   ``torch.optim.SGD(lr=η, weight_decay=λ)`` (no momentum: it is step 1's), x ← x − η·(V + λx).

Appendix I tunes η separately for Signum (5e-5 per worker, scaled linearly with the
workers, for CIFAR-10: ±η per coordinate is a much larger step than an averaged
gradient's). An optimizer with its own momentum would add a second momentum after
the vote, which is not Signum: ``with_bagua`` warns about one (the DDP hook cannot see
the optimizer). No error feedback: the vote is not a compression of
anything a worker could keep the error of. The math is
:mod:`bagua_algos.compression.signs` (``MajorityVoteCodec``); the op is the allgather
compressors' (:mod:`.allgather_compression`). A worker sends ⌈N/8⌉ bytes per bucket
of N values.

A NaN gradient makes that worker's momentum NaN for good and its signs +1 from then on
(1 bit has no NaN): the vote stays finite and nothing reports it, unlike the averaging
algorithms, whose NaN reaches every worker's weights.
"""

from __future__ import annotations

import torch

from ..arguments import check_real
from ..compression.signs import MajorityVoteCodec
from .allgather_compression import AllgatherCompressionAlgorithm, warn_second_momentum
from .table import AlgorithmConfig, register_algorithm

__all__ = ["SignumAlgorithm"]


class SignumAlgorithm(AllgatherCompressionAlgorithm):
    """Signum with majority vote: per-worker momentum, 1-bit signs allgathered, the vote
    as the gradient (train with SGD without momentum; the module's notes).

    Args:
        momentum: β in [0, 1) of m ← β·m + (1 − β)·g (0.9: the seed's; 0: signSGD).
    """

    def __init__(self, momentum: float = 0.9):
        self.momentum = check_real("momentum", momentum, 0.0, 1.0, high_open=True)

    def check_optimizers(self, optimizers) -> None:
        """Warn about an optimizer with momentum: it would add a second momentum after the vote."""
        warn_second_momentum(optimizers, "Signum", f"β = {self.momentum}", "the vote")

    def make_codec(self, shapes: list, dtype: torch.dtype) -> MajorityVoteCodec:
        return MajorityVoteCodec(sum(torch.Size(s).numel() for s in shapes))


register_algorithm(
    "signum", SignumAlgorithm, "Signum: signs of each worker's momentum, allgathered, majority vote",
    # Deterministic, every worker applies the same update. Across devices a value's sign
    # can flip on a rounding difference and move that weight by a learning-rate-sized step.
    rows=[(260, AlgorithmConfig("signum", "signum", tolerance=5e-3))],
)
