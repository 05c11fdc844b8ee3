"""Allreduce model averaging: the baseline of the RelaySGD study (seed 002, Alg. 3–4).

After the local step x_i^{t+½} = x_i^t − γ ∇f_i(x_i^t), every worker takes the exact
mean x_i^{t+1} = (1/n) Σ_j x_j^{t+½}. The parameters themselves are the Bagua tensors
(one flattened buffer per bucket); after the optimizer step every parameter is marked
ready, the buckets' allreduce-mean ops run in place on the buffers, and the hook waits.
With ``communication_interval`` k > 1 the mean is taken at steps 1, k+1, 2k+1, …
(Bagua's schedule: step t communicates when (t − 1) mod k = 0), i.e. local SGD.
"""

from __future__ import annotations

from ..runtime.algorithm import Algorithm, AlgorithmImpl, GlobalAlgorithmRegistry

__all__ = ["AllreduceAverageAlgorithm", "AllreduceAverageAlgorithmImpl", "check_interval", "communicates_at"]


def check_interval(communication_interval) -> int:
    if isinstance(communication_interval, bool) or not isinstance(communication_interval, int) or communication_interval < 1:
        raise ValueError(f"communication_interval must be an int >= 1, got {communication_interval!r}")
    return communication_interval


def communicates_at(step: int, communication_interval: int) -> bool:
    """Bagua's schedule: training step ``step`` (counted from 1) communicates when
    (step − 1) mod interval = 0, i.e. at steps 1, k+1, 2k+1, …"""
    return (step - 1) % communication_interval == 0


class AllreduceAverageAlgorithmImpl(AlgorithmImpl):
    def __init__(self, process_group, communication_interval: int = 1):
        super().__init__(process_group)
        self.communication_interval = communication_interval

    def init_tensors(self, bagua_ddp):
        self.tensors = [
            param.ensure_bagua_tensor(name, bagua_ddp.bagua_module_name)
            for name, param in reversed(bagua_ddp.bagua_build_params())
        ]
        return self.tensors

    def init_operations(self, bagua_ddp, bucket) -> None:
        bucket.clear_ops()
        bucket.append_centralized_synchronous_op(average=True, group=self.process_group)

    def init_backward_hook(self, bagua_ddp):
        return lambda name, param: None  # gradients stay local

    def init_post_backward_hook(self, bagua_ddp):
        return lambda: None

    def init_post_optimizer_step_hook(self, bagua_ddp):
        def hook(optimizer):
            if communicates_at(bagua_ddp.bagua_train_step_counter, self.communication_interval):
                for tensor in self.tensors:
                    tensor.bagua_mark_communication_ready()
                bagua_ddp._bagua_backend.wait_pending_comm_ops()

        return hook


class AllreduceAverageAlgorithm(Algorithm):
    """Average the models of all workers after the optimizer step, every
    ``communication_interval`` steps (from the first)."""

    def __init__(self, communication_interval: int = 1):
        self.communication_interval = check_interval(communication_interval)

    def reify(self, process_group) -> AllreduceAverageAlgorithmImpl:
        return AllreduceAverageAlgorithmImpl(process_group, self.communication_interval)


GlobalAlgorithmRegistry.register(
    "allreduce_average", AllreduceAverageAlgorithm, "average the models with an allreduce after each step"
)
