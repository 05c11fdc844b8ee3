"""Allreduce model averaging: the baseline of the RelaySGD study (seed 002, Alg. 3–4).

After the local step x_i^{t+½} = x_i^t − γ ∇f_i(x_i^t), every worker takes the exact
mean x_i^{t+1} = (1/n) Σ_j x_j^{t+½}, in place on the flattened parameter buffers.
With ``communication_interval`` k > 1 the mean is taken every k-th step (local SGD).
"""

from __future__ import annotations

from ..runtime import comm
from ..runtime.algorithm import Algorithm, AlgorithmImpl, GlobalAlgorithmRegistry

__all__ = ["AllreduceAverageAlgorithm", "AllreduceAverageAlgorithmImpl"]


def check_interval(communication_interval) -> int:
    if isinstance(communication_interval, bool) or not isinstance(communication_interval, int) or communication_interval < 1:
        raise ValueError(f"communication_interval must be an int >= 1, got {communication_interval!r}")
    return communication_interval


class AllreduceAverageAlgorithmImpl(AlgorithmImpl):
    def __init__(self, process_group, communication_interval: int = 1):
        super().__init__(process_group)
        self.communication_interval = communication_interval

    def init_backward_hook(self, bagua_ddp):
        return lambda name, param: None  # gradients stay local

    def init_post_backward_hook(self, bagua_ddp):
        return lambda: None

    def init_post_optimizer_step_hook(self, bagua_ddp):
        def hook(optimizer):
            if bagua_ddp.bagua_train_step_counter % self.communication_interval:
                return
            flats = [bucket.flat_params() for bucket in bagua_ddp.buckets]
            handles = [comm.allreduce_inplace(f, comm.ReduceOp.AVG, group=self.process_group, async_op=True) for f in flats]
            for bucket, flat, handle in zip(bagua_ddp.buckets, flats, handles):
                handle.wait()
                bucket.set_params_from_flat(flat)

        return hook


class AllreduceAverageAlgorithm(Algorithm):
    """Average the models of all workers after every ``communication_interval`` steps."""

    def __init__(self, communication_interval: int = 1):
        self.communication_interval = check_interval(communication_interval)

    def reify(self, process_group) -> AllreduceAverageAlgorithmImpl:
        return AllreduceAverageAlgorithmImpl(process_group, self.communication_interval)


GlobalAlgorithmRegistry.register(
    "allreduce_average", AllreduceAverageAlgorithm, "average the models with an allreduce after each step"
)
