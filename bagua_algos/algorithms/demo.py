"""DeMo, decoupled momentum optimization (Peng, Quesnelle, Kingma 2024), registered as
``demo``: each worker keeps its own momentum and sends only its fast components, the
largest DCT coefficients of each chunk; every worker steps on the sign of their decoded
mean.

Followed: bloc97/DeMo's demo.py (the ``DeMo`` optimizer's ``step``, ``TransformDCT``,
``CompressDCT``), per bucket of each worker's gradients g:

1. m ← β·m + g                         each worker's own momentum, never averaged
                                       (``decay`` β; demo.py's ``delta``);
2. per tensor, its chunks (each side cut to ``chunk_side(s, chunk)``, demo.py's
   ``_get_smaller_split``) → the orthonormal DCT-II of each chunk → the ``topk`` largest
   coefficients by magnitude of each chunk (all of a shorter chunk): the message, their
   values and positions;
3. m ← m − IDCT(own message)           the sent part leaves the momentum;
4. allgather the messages; each coefficient becomes the mean of the values the workers
   that chose it sent (demo.py's ``scatter_reduce_(..., "mean", include_self=False)``
   over the concatenated messages: a coefficient one worker chose is that worker's
   value, not a 1/n of it), the inverse DCT of that is the direction;
5. the gradient becomes sign(direction), the same on every worker.

DeMo is an optimizer (demo.py subclasses ``torch.optim.SGD``: its step is SGD's on the
sign). Here it is the Bagua way, as Signum: the algorithm turns the gradient into
step 5's sign and you train with ``torch.optim.SGD(params, lr, weight_decay=λ)`` without
momentum (the momentum is step 1's; ``with_bagua`` warns about an optimizer with its
own). That SGD step is demo.py's: demo.py first scales p by (1 − lr·λ) (its decoupled
weight decay), then steps p − lr·sign; SGD's weight decay gives p − lr·(sign + λp), the
same update. Two differences from demo.py, neither changing the step:

- demo.py accumulates lr·g (``delta.add_(p.grad, alpha=lr)``); this is the paper's
  m ← βm + g. With a constant learning rate the two momenta differ by the factor lr,
  and every later step (the top-k, the subtraction, the mean, the sign) is unchanged
  by a positive factor; under a schedule demo.py weighs each step's gradient by its lr.
- positions travel as int16 (int32 past 2^15 coefficients a chunk), demo.py's as
  torch.topk's int64: a worker sends K·(4 + 2) bytes a step at float32, K the
  coefficients chosen (:class:`~bagua_algos.compression.chunked_topk.DCTTopKCodec`).

A tensor of three or more dimensions (which demo.py's rearrange refuses) is cut as
the matrix shape[0] × (the rest). The math is
:mod:`bagua_algos.compression.chunked_topk`; the op is the allgather compressors'
(:mod:`.allgather_compression`: the error buffer, ``bucket.state["error"]``, is m; its
contribution β·e + g and e ← a − D(C(a)) are steps 1 and 3). On the one-process engine
the same op runs on ``[W, N]`` rows.
"""

from __future__ import annotations

import torch

from ..arguments import check_int, check_real
from ..compression.chunked_topk import DCTTopKCodec
from .allgather_compression import AllgatherCompressionAlgorithm, AllgatherCompressionImpl, warn_second_momentum
from .table import AlgorithmConfig, register_algorithm

__all__ = ["DeMoAlgorithm", "DeMoAlgorithmImpl"]


class DeMoAlgorithmImpl(AllgatherCompressionImpl):
    """The allgather compressors' impl with DeMo's rule for another world size."""

    WORLD_SIZE_RULE = {"step counter": "carried over",
                       "momenta": "reset to zero (each worker's own, less what it sent)"}
    RESET_BUCKET_KEYS = frozenset({"error"})


class DeMoAlgorithm(AllgatherCompressionAlgorithm):
    """DeMo: per-worker momentum, its chunks' largest DCT coefficients allgathered, the
    sign of their decoded mean as the gradient (train with SGD without momentum; the
    module's notes).

    Args:
        chunk: the side of a chunk, >= 1: each dimension of a tensor is cut into pieces
            of its largest divisor at most ``chunk`` (demo.py's ``compression_chunk``).
        topk: the coefficients sent per chunk, >= 1 (demo.py's ``compression_topk``;
            a chunk with fewer sends all).
        decay: β of the momentum m ← β·m + g, in [0, 1) (demo.py's ``compression_decay``).
    """

    error_feedback = True

    def __init__(self, chunk: int = 64, topk: int = 32, decay: float = 0.999):
        self.chunk = check_int("chunk", chunk, 1, what="a chunk side, an int >= 1")
        self.topk = check_int("topk", topk, 1, what="the coefficients sent per chunk, an int >= 1")
        self.decay = check_real("decay", decay, 0.0, 1.0, high_open=True, what="a momentum decay in [0, 1)")
        self.error_decay = self.decay

    def check_optimizers(self, optimizers) -> None:
        """Warn about an optimizer with momentum: it would add a second momentum after the sign."""
        warn_second_momentum(optimizers, "DeMo", f"decay {self.decay}", "the exchange")

    def make_codec(self, shapes: list, dtype: torch.dtype) -> DCTTopKCodec:
        return DCTTopKCodec(shapes, self.chunk, self.topk, dtype)

    def reify(self, process_group) -> DeMoAlgorithmImpl:
        return DeMoAlgorithmImpl(process_group, self)


register_algorithm(
    "demo", DeMoAlgorithm,
    "DeMo: each worker's momentum, its chunks' top DCT coefficients allgathered, the sign of their mean applied",
    # As with signum, a sign decided otherwise on another device moves a weight by a step.
    rows=[(340, AlgorithmConfig("demo", "demo", {"chunk": 8, "topk": 8}, tolerance=5e-3))],
)
