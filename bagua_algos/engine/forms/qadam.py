"""qadam on the stacked state: the per-rank :class:`bagua_algos.algorithms.q_adam.
QAdamAlgorithmImpl` for all workers at once, with QAdam's own optimizer on the stacked
parameter.

The optimizer is a :class:`QAdamOptimizer` on the ``[n, d]`` parameter with the settings
of the one inside the algorithm (its update is elementwise, so row i is worker i's Adam
and its state is stacked the same way); :meth:`QAdamForm.make_optimizer` builds it. Its
step count decides the phase, as the per-rank algorithm's does (:func:`in_compression`):

- warm-up: after the backward, every worker's gradient ← the mean of all workers'
  (the per-rank exact allreduce: a sum, then / n), and the optimizer runs Adam;
- compression: each worker's momentum m_i ← β1 m_i + (1 − β1)(g_i + wd·x_i)
  (:func:`local_momentum_`), then the momenta are averaged bucket by bucket, and the
  optimizer applies the update with the average and the frozen v. ``hierarchical=True``
  (the default) on the engine's one node is the node's exact average; ``False`` is
  Bagua's MinMaxUInt8 scatter-gather over the n workers
  (:func:`compressed_scatter_gather`).

As in the per-rank runtime, the switch of phase rebuilds the buckets: every worker's
parameters, buffers and optimizer state become worker 0's (the runtime's broadcast from
the first rank; in QAdam the workers are equal anyway), and each bucket's padding starts
at zero. In the compression phase the padding of a bucket (up to a multiple of n, for
n equal chunks) is a tensor of its own in the per-rank bucket, not optimizer state: it
keeps the decoded values of the last average, which enter the next one's chunk ranges.
The form keeps them in ``padding`` and leaves the optimizer's momentum zero there, so
the padding columns of the parameters never move.

The gradient and momentum averages sum in another order than gloo's ring allreduce (a
few float32 ulps); where the momentum is then quantized (``hierarchical=False``), such a
difference can move a value to the neighbouring 8-bit level. The equality test states
the tolerance this needs.
"""

from __future__ import annotations

import warnings

import torch

from ...algorithms.q_adam import QAdamOptimizer, in_compression, local_momentum_
from ...runtime.comm import StackedGroup
from ...runtime.ops import MINMAX_UINT8_BITS, compressed_scatter_gather
from .base import StackedForm

__all__ = ["QAdamForm"]

_GROUP_SETTINGS = ("lr", "betas", "eps", "weight_decay")


class QAdamForm(StackedForm):
    @classmethod
    def alignment(cls, algorithm, n: int) -> int:
        return n  # aligned_buckets(..., world_size): one chunk per worker

    @classmethod
    def make_optimizer(cls, algorithm, params, optimizer_factory):
        """A :class:`QAdamOptimizer` on the stacked ``params`` with the settings of
        ``algorithm.optimizer`` (QAdam owns its optimizer: the per-rank form is given
        that same one, so the engine takes no other)."""
        if optimizer_factory is not None:
            raise ValueError(
                "optimizer: QAdam's optimizer is the QAdamOptimizer inside QAdamAlgorithm (the engine stacks its "
                "settings); pass optimizer=None with qadam"
            )
        user = algorithm.optimizer
        if any(len(state) for state in user.state.values()):
            raise ValueError(
                "q_adam_optimizer has already taken steps; the engine starts QAdam from step 0, so give it a "
                "QAdamOptimizer that has not stepped"
            )
        settings = [{key: group[key] for key in _GROUP_SETTINGS} for group in user.param_groups]
        if any(s != settings[0] for s in settings[1:]):
            raise ValueError(
                f"q_adam_optimizer has parameter groups with different settings {settings}; the engine's stacked "
                "QAdam takes one setting of (lr, betas, eps, weight_decay) for the whole model"
            )
        with warnings.catch_warnings():  # the user's optimizer already warned about its settings
            warnings.simplefilter("ignore", UserWarning)
            return QAdamOptimizer([params], warmup_steps=user.warmup_steps, variant=user.variant, **settings[0])

    def __init__(self, algorithm, engine):
        super().__init__(algorithm, engine)
        self.optimizer = engine.optimizer
        in_optimizer = {id(p) for group in algorithm.optimizer.param_groups for p in group["params"]}
        missing = [name for name, p in engine.model.module.named_parameters()
                   if p.requires_grad and id(p) not in in_optimizer]
        if missing:
            raise ValueError(
                f"QAdamAlgorithm: parameters {missing} are not in the QAdamOptimizer given to QAdamAlgorithm; "
                "build the QAdamOptimizer from all of the module's trainable parameters"
            )
        self.hierarchical = algorithm.hierarchical
        self.warmup_steps = self.optimizer.warmup_steps
        self.buckets = engine.model.layout.buckets
        self.padding = None  # per bucket, the [n, padding] values of the compression phase
        self._compressing = None  # the phase the (per-rank) buckets were built for

    def _optimizer_steps(self) -> int:
        state = self.optimizer.state.get(self.engine.model.params, {})
        return int(state.get("step", 0))

    @torch.no_grad()
    def before_forward(self, step: int) -> None:
        compressing = in_compression(self._optimizer_steps(), self.warmup_steps)
        if self._compressing is not None and compressing != self._compressing:
            self._rebuild()
        elif compressing and self.padding is None:
            self.padding = self._zero_padding()
        self._compressing = compressing

    def _rebuild(self) -> None:
        """The per-rank reset: worker 0's parameters, buffers and optimizer state to
        every worker; new buckets, their padding zero."""
        model = self.engine.model
        model.params.copy_(model.params[:1].expand_as(model.params))
        for buffer in model.buffers.values():
            buffer.copy_(buffer[:1].expand_as(buffer))
        for value in self.optimizer.state.get(model.params, {}).values():
            if torch.is_tensor(value) and value.dim() > 0:
                value.copy_(value[:1].expand_as(value))
        self.padding = self._zero_padding()

    def _zero_padding(self) -> list:
        return [self.engine.model.params.new_zeros(self.n, b.size - b.numel) for b in self.buckets]

    @torch.no_grad()
    def after_backward(self, step: int) -> None:
        grads = self.engine.model.grads
        if not self._compressing:
            # the exact allreduce of the gradients (sum, then / n)
            grads.copy_(grads.sum(0, keepdim=True).div_(self.n).expand_as(grads))
            return
        params = self.engine.model.params
        group = self.optimizer.param_groups[0]
        momentum = self.optimizer.state[params]["exp_avg"]
        local_momentum_(momentum, grads, params.detach(), group["betas"][0], self.optimizer._decay(group))
        for bucket, padding in zip(self.buckets, self.padding):
            flat = momentum[:, bucket.start:bucket.end]
            pad = slice(bucket.numel, bucket.size)
            flat[:, pad] = padding
            if self.hierarchical:  # one node: the node's exact average (sum, then / n)
                flat.copy_(flat.sum(0, keepdim=True).div_(self.n).expand_as(flat))
            else:
                bad_rows = ~torch.isfinite(flat).all(1)  # before the average overwrites them
                try:  # (one host read per bucket: the per-rank op reads its marks too)
                    compressed_scatter_gather(flat, MINMAX_UINT8_BITS, True, StackedGroup(self.n))
                except ValueError:
                    self._raise_non_finite(bad_rows)
            padding.copy_(flat[:, pad])
            flat[:, pad] = 0  # not optimizer state: the padding's parameters stay zero

    @staticmethod
    def _raise_non_finite(bad_rows: torch.Tensor) -> None:
        bad = bad_rows.nonzero().flatten().tolist()
        what = f"the momentum of worker(s) {bad} has" if bad else "the averaged momentum (an overflow) has"
        raise ValueError(
            f"qadam: {what} NaN/inf values, which the min-max codec cannot encode (look for a diverging loss "
            "or a learning rate that is too high)"
        ) from None
