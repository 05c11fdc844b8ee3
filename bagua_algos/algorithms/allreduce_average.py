"""Allreduce model averaging: the baseline of the RelaySGD study (seed 002, Alg. 3–4).

After the local step x_i^{t+½} = x_i^t − γ ∇f_i(x_i^t), every worker takes the exact
mean x_i^{t+1} = (1/n) Σ_j x_j^{t+½}. The parameters themselves are the Bagua tensors
(one flattened buffer per bucket); after the optimizer step every parameter is marked
ready, the buckets' allreduce-mean ops run in place on the buffers, and the hook waits.
With ``communication_interval`` k > 1 the mean is taken at steps 1, k+1, 2k+1, …
(Bagua's schedule: step t communicates when (t − 1) mod k = 0), i.e. local SGD.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..arguments import check_interval
from ..runtime.algorithm import Algorithm
from .model_averaging import ModelAveragingAlgorithmImpl
from .table import AlgorithmConfig, register_algorithm

if TYPE_CHECKING:
    from ..runtime.bucket import BaguaBucket
    from ..runtime.ddp import BaguaDistributedDataParallel

__all__ = ["AllreduceAverageAlgorithm", "AllreduceAverageAlgorithmImpl"]


class AllreduceAverageAlgorithmImpl(ModelAveragingAlgorithmImpl):
    """The parameters after the optimizer step, averaged by one allreduce per bucket
    (registration, hooks and schedule: :class:`ModelAveragingAlgorithmImpl`)."""
    WORLD_SIZE_RULE = {"step counter": "carried over (so the communication schedule goes on)",
                       "other state": "none (the models are averaged afresh at every communicating step)"}


    def init_operations(self, bagua_ddp: BaguaDistributedDataParallel, bucket: BaguaBucket) -> None:
        bucket.clear_ops()
        bucket.append_centralized_synchronous_op(average=True, group=self.process_group)


class AllreduceAverageAlgorithm(Algorithm):
    """Average the models of all workers after the optimizer step, every
    ``communication_interval`` steps (from the first)."""

    def __init__(self, communication_interval: int = 1):
        self.communication_interval = check_interval(communication_interval)

    def reify(self, process_group) -> AllreduceAverageAlgorithmImpl:
        return AllreduceAverageAlgorithmImpl(process_group, self.communication_interval)


register_algorithm(
    "allreduce_average", AllreduceAverageAlgorithm, "average the models with an allreduce after each step",
    rows=[(30, AlgorithmConfig("allreduce_average", "allreduce_average", exact_alone=True, in_sweep=True))],
)
