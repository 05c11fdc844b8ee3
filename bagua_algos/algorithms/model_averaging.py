"""What the model-averaging algorithms share (not an algorithm itself).

In model averaging the parameters themselves are the Bagua tensors (one flattened
buffer per bucket) and gradients stay local: the backward and post-backward hooks do
nothing. The schedule is Bagua's: training step t (counted from 1) communicates when
(t − 1) mod k = 0, k the ``communication_interval``, i.e. at steps 1, k+1, 2k+1, …
By default the parameters are averaged after the optimizer step (mark them all ready,
wait for the buckets' ops); an algorithm that communicates elsewhere overrides
:meth:`ModelAveragingAlgorithmImpl.init_post_optimizer_step_hook`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..runtime.algorithm import AlgorithmImpl, BackwardHook, PostBackwardHook, PostOptimizerStepHook

if TYPE_CHECKING:
    from ..runtime.ddp import BaguaDistributedDataParallel

__all__ = ["ModelAveragingAlgorithmImpl", "communicates_at"]


def communicates_at(step: int, communication_interval: int) -> bool:
    """Bagua's schedule: training step ``step`` (counted from 1) communicates when
    (step − 1) mod interval = 0, i.e. at steps 1, k+1, 2k+1, …"""
    return (step - 1) % communication_interval == 0


class ModelAveragingAlgorithmImpl(AlgorithmImpl):
    """An ``AlgorithmImpl`` whose Bagua tensors are the parameters."""

    needs_optimizer_step = True  # by default the parameters are averaged after the step

    def __init__(self, process_group, communication_interval: int = 1):
        super().__init__(process_group)
        self.communication_interval = communication_interval

    def _should_communicate(self, bagua_ddp) -> bool:
        return communicates_at(bagua_ddp.bagua_train_step_counter, self.communication_interval)

    def init_tensors(self, bagua_ddp: BaguaDistributedDataParallel) -> list:
        self.tensors = [
            param.ensure_bagua_tensor(name, bagua_ddp.bagua_module_name)
            for name, param in reversed(bagua_ddp.bagua_build_params())
        ]
        return self.tensors

    def init_backward_hook(self, bagua_ddp: BaguaDistributedDataParallel) -> BackwardHook:
        return lambda name, param: None  # gradients stay local

    def init_post_backward_hook(self, bagua_ddp: BaguaDistributedDataParallel) -> PostBackwardHook:
        return lambda: None

    def init_post_optimizer_step_hook(self, bagua_ddp: BaguaDistributedDataParallel) -> PostOptimizerStepHook:
        def hook(optimizer):
            if self._should_communicate(bagua_ddp):
                for tensor in self.tensors:
                    tensor.bagua_mark_communication_ready()
                bagua_ddp._bagua_backend.wait_pending_comm_ops()

        return hook
