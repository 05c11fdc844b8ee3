"""low_precision_decentralized on the stacked state: the per-rank op
(:class:`bagua_algos.runtime.ops.LowPrecisionDecentralizedSynchronousOp`) after the
optimizer step of every communicating step ((step − 1) mod k = 0), for all workers at once.

``hierarchical=False``: the ring of the n workers. Worker i keeps x̂_i, the copy of its
weights its neighbours hold, and replicas of x̂_{i−1} and x̂_{i+1}; a replica moves by the
very bytes its owner applies, so it always equals the owner's x̂ bit for bit, and the
stacked form keeps one matrix W (row i = x̂_i) and reads the replicas as W's rows i ∓ 1:

    z_i  = x_i + x̂_{i−1} / 3 + x̂_{i+1} / 3 − 5 x̂_i / 3      (z = x − x̂ for one worker)
    x̂_i ← x̂_i + D(Q(z_i)),   x_i ← x̂_i

with Q the 8-bit min-max codec, one header per worker's bucket (each bucket of every
worker is one row of one batched encoding). With two workers both neighbours are the
other one, as in the per-rank ring.

``hierarchical=True`` (the default) on the engine's one node: the node's exact average
m = Σ_i x_i / n, then the node leader's ring of one, z = m − x̂_0 with x̂_0 the leader's
copy, x̂_0 ← x̂_0 + D(Q(z)), and every worker takes the leader's x̂_0 (its broadcast).
The other workers' copies are never read on one node, so W is one row.

The sum of the average runs in another order than gloo's ring allreduce (a few float32
ulps); the 8-bit grid of z can turn such a difference into one quantization step of z,
which the next communication corrects (z is measured from x̂). The equality test states
the tolerance this needs.
"""

from __future__ import annotations

import torch

from ...algorithms.model_averaging import communicates_at
from ...compression import minmax
from ...runtime.ops import MINMAX_UINT8_BITS, low_precision_difference
from .base import StackedForm


class LowPrecisionDecentralizedForm(StackedForm):
    def __init__(self, algorithm, engine):
        super().__init__(algorithm, engine)
        params = engine.model.params.detach()
        # x̂ starts at the common initial model (the per-rank op's copies are made after
        # the initial broadcast); one row per ring member.
        members = 1 if algorithm.hierarchical else self.n
        self.weight = params[:members].clone()
        if members > 1:
            index = torch.arange(members, device=params.device)
            self.left = (index - 1) % members  # ring_peers(i, n)
            self.right = (index + 1) % members
        else:
            self.left = self.right = None

    @torch.no_grad()
    def after_step(self, step: int) -> None:
        if not communicates_at(step, self.algorithm.communication_interval):
            return
        params = self.engine.model.params
        # the per-rank op works on a float32 copy of the bucket
        x = rows = params.detach() if params.dtype == torch.float32 else params.detach().float()
        if self.algorithm.hierarchical:
            # the node's allreduce (sum, then / n), done by the leader's row
            x = x.sum(0, keepdim=True).div_(self.n)
        w = self.weight
        z = low_precision_difference(x, w, *((w[self.left], w[self.right]) if self.left is not None else ()))
        marks = []
        for bucket in self.engine.model.layout.buckets:
            zb = z[:, bucket.start:bucket.end]
            sent = minmax.encode_chunks(zb, MINMAX_UINT8_BITS, non_finite="mark")
            marks.append(minmax.marked(sent, zb.shape[0]))
            decoded = minmax.decode_chunks(sent, zb.shape[0], bits=MINMAX_UINT8_BITS, numel=bucket.size)
            w[:, bucket.start:bucket.end].add_(decoded.to(w.dtype))
        self._raise_if_marked(marks, rows if self.algorithm.hierarchical else z)
        # x ← x̂ (through the op's float32 copy, as the per-rank op writes it back)
        new = w if params.dtype == torch.float32 else w.float()
        params.copy_(new.expand_as(params))

    def _raise_if_marked(self, marks, rows) -> None:
        """One host read per communicating step: a z with NaN/inf cannot be encoded (the
        per-rank op sends the codec's mark and every neighbour raises). ``rows``: each
        worker's z, or (hierarchical) each worker's weights that went into the average."""
        if not bool(torch.cat(marks).any()):
            return
        bad = (~torch.isfinite(rows).all(1)).nonzero().flatten().tolist()
        what = f"the weights of worker(s) {bad} have" if bad else "the workers' average weights (an overflow) have"
        raise ValueError(
            f"low_precision_decentralized: {what} NaN/inf values, which the min-max codec cannot encode (look for "
            "a diverging loss or a learning rate that is too high)"
        )
