"""gradient_allreduce on the stacked state: every worker's gradient becomes the mean
(or, with ``average=False``, the sum) of all workers' gradients. Hierarchical reduction
gives the same numbers up to the order of the sum, which the engine (one node) takes as
one reduction over the worker dimension."""

from __future__ import annotations

import torch

from .base import StackedForm


class GradientAllReduceForm(StackedForm):
    @torch.no_grad()
    def after_backward(self, step: int) -> None:
        grads = self.engine.model.grads
        total = grads.sum(0, keepdim=True)
        if self.algorithm.average:
            total.div_(self.n)
        grads.copy_(total.expand_as(grads))
