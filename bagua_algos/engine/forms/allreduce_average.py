"""allreduce_average on the stacked state: after the optimizer step, on the steps of
Bagua's schedule (:func:`communicates_at`), every worker's model becomes the mean."""

from __future__ import annotations

import torch

from ...algorithms.model_averaging import communicates_at
from .base import StackedForm


class AllreduceAverageForm(StackedForm):
    @torch.no_grad()
    def after_step(self, step: int) -> None:
        if communicates_at(step, self.algorithm.communication_interval):
            params = self.engine.model.params
            params.copy_(params.sum(0, keepdim=True).div_(self.n).expand_as(params))
