"""terngrad on the stacked state: after backward, bucket by bucket in the per-rank
order (the order the communication thread runs them), every worker's contribution

    v_i = clip(g_i) + e_i          (clip: :func:`clip_rows_by_std`, e_i: error feedback)

goes through the min-max scatter-gather at ``bits`` bits (:func:`bagua_algos.runtime.
ops.compressed_scatter_gather`: worker i encodes its n chunks, worker k
reduces chunk k of every worker, mean, encodes it again, every worker decodes all
reduced chunks), and with error feedback e_i ← v_i − D(Q(v_i)), the error of worker
i's own first encoding.

Stochastic rounding: worker i holds rank i's :class:`RoundingStream` (a CPU generator
seeded ``rank_seed(seed, i)``); each bucket's reduction draws one key from it and
seeds a generator on the engine's device, as the process does on its bucket's device.
So on the CPU every worker rounds with its process's very numbers, and on CUDA with
what its process would draw on CUDA (the same key, the same Philox kernels); a CPU
process and a CUDA engine round differently (each unbiased). The codec's encodes then
run once per worker and stage (each worker's generator is its own stream); nearest
rounding runs each stage as one batched encode. The padding is kept as for bytegrad
(:class:`~.bytegrad.BucketPadding`).
"""

from __future__ import annotations

import torch

from ...algorithms.terngrad import RoundingStream, clip_rows_by_std
from ...runtime.comm import StackedGroup
from ...runtime.ops import compressed_scatter_gather
from .base import StackedForm


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


class TernGradForm(StackedForm):
    def __init__(self, algorithm, engine):
        super().__init__(algorithm, engine)
        layout = engine.model.layout
        self.padding = BucketPadding(layout, engine.device)
        self.streams = [RoundingStream(algorithm.seed, i) for i in range(self.n)] if algorithm.stochastic else None
        # e_i of each bucket, padding included (the per-rank bucket.state["terngrad_error"])
        self.errors = ([torch.zeros(self.n, b.size, device=engine.device) for b in layout.buckets]
                       if algorithm.error_feedback else None)

    @classmethod
    def alignment(cls, algorithm, n: int) -> int:
        return n  # one chunk per worker (aligned_buckets(..., world_size))

    @torch.no_grad()
    def after_backward(self, step: int) -> None:
        algorithm = self.algorithm
        grads = self.engine.model.grads
        for b in range(len(self.padding.buckets)):
            v = self.padding.flat(grads, b)  # every worker's contribution (a new tensor)
            if algorithm.clip is not None:
                clip_rows_by_std(v, algorithm.clip)
            if self.errors is not None:
                v.add_(self.errors[b])
            result = v.clone()
            generators = ([s.reduction_generator(result.device) for s in self.streams]
                          if self.streams is not None else None)
            sent = compressed_scatter_gather(result, algorithm.bits, True, StackedGroup(self.n), algorithm.stochastic,
                                             generators)
            if self.errors is not None:
                self.errors[b].copy_(v.sub_(sent))
            self.padding.write(grads, b, result)
