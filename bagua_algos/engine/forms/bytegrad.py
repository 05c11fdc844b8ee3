"""bytegrad on the stacked state: every worker's gradient bucket goes through Bagua's
8-bit min-max scatter-gather (:func:`bagua_algos.runtime.ops.
stacked_compressed_scatter_gather`, the per-rank op's stages on all workers at once),
after backward, bucket by bucket.

- ``hierarchical=True`` (Bagua's default): the per-rank op averages exactly within the
  node and only node leaders compress; the engine is one node, so this is the exact
  mean (or sum) of gradient_allreduce, with no quantization at all.
- ``hierarchical=False``: worker i cuts its bucket into n chunks and encodes them
  (nearest rounding), worker k decodes and reduces chunk k of every worker
  (Σ_i / n with ``average``), encodes it again, and every worker decodes the n reduced
  chunks: one batched encode of the ``[n², chunk]`` chunks, one of the ``[n, chunk]``
  reduced ones.

The buckets are padded to a multiple of n, as the per-rank buckets (``alignment``).
The padding of a process's bucket is a tensor of its own, not a gradient: ``zero_grad``
leaves it alone and the scatter-gather writes the reduced chunk's values there, so the
next step's bucket starts with them (the same on every worker). The engine's padding
columns of the gradients are zeroed with the rest, so :class:`BucketPadding` keeps
those values for the compressing forms.
"""

from __future__ import annotations

import torch

from ...runtime.ops import MINMAX_UINT8_BITS, stacked_compressed_scatter_gather
from .gradient_allreduce import GradientAllReduceForm


class BucketPadding:
    """Each bucket's padding values (what a process's padding tensor holds), ``[size -
    numel]`` per bucket, shared by every worker; zeros at first."""

    def __init__(self, layout, device):
        self.buckets = layout.buckets
        self.values = [torch.zeros(b.size - b.numel, device=device) for b in self.buckets]

    def flat(self, grads: torch.Tensor, b: int) -> torch.Tensor:
        """A new float32 ``[n, size]``: every worker's bucket b, the padding included
        (the process's ``bucket.flat_view()``, as float32)."""
        bucket = self.buckets[b]
        n = grads.shape[0]
        return torch.cat([grads[:, bucket.start:bucket.start + bucket.numel].float(),
                          self.values[b].expand(n, -1)], dim=1)

    def write(self, grads: torch.Tensor, b: int, flat: torch.Tensor) -> None:
        """Bucket b's gradients ← ``flat[:, :numel]``, its padding ← ``flat``'s rest (row 0:
        a reduction leaves every row equal)."""
        bucket = self.buckets[b]
        grads[:, bucket.start:bucket.start + bucket.numel].copy_(flat[:, :bucket.numel])
        self.values[b].copy_(flat[0, bucket.numel:])


class ByteGradForm(GradientAllReduceForm):
    def __init__(self, algorithm, engine):
        super().__init__(algorithm, engine)
        self.padding = BucketPadding(engine.model.layout, engine.device)

    @classmethod
    def alignment(cls, algorithm, n: int) -> int:
        return n  # one chunk per worker (aligned_buckets(..., world_size))

    @torch.no_grad()
    def after_backward(self, step: int) -> None:
        if self.algorithm.hierarchical:  # one node: the node's exact reduction is the result
            super().after_backward(step)
            return
        grads = self.engine.model.grads
        for b in range(len(self.padding.buckets)):
            flat = self.padding.flat(grads, b)
            stacked_compressed_scatter_gather(flat, MINMAX_UINT8_BITS, self.algorithm.average)
            self.padding.write(grads, b, flat)
