"""Gradient allreduce: synchronous data-parallel SGD, as torch DDP.

Every worker applies the same gradient g = (1/n) Σ_i g_i (or Σ_i g_i with
``average=False``). A bucket's allreduce starts once all its gradients are ready, so
communication overlaps the rest of backward; the post-backward hook waits for it.
"""

from __future__ import annotations

from ..runtime import comm
from ..runtime.algorithm import Algorithm, AlgorithmImpl, GlobalAlgorithmRegistry

__all__ = ["GradientAllReduceAlgorithm", "GradientAllReduceAlgorithmImpl"]


class GradientAllReduceAlgorithmImpl(AlgorithmImpl):
    def __init__(self, process_group, hierarchical: bool = False, average: bool = True):
        super().__init__(process_group)
        if hierarchical and process_group is not None:
            raise ValueError("hierarchical=True runs over all workers; pass process_group=None")
        self.hierarchical = hierarchical
        self.op = comm.ReduceOp.AVG if average else comm.ReduceOp.SUM

    def init_operations(self, bagua_ddp, bucket) -> None:
        bucket.clear_ops()
        bucket.append_op(self._allreduce_gradients)

    def _allreduce_gradients(self, bucket) -> comm.CommHandle:
        grads = bucket.flat_grads()
        if self.hierarchical:
            handle = comm.hierarchical_allreduce_inplace(grads, self.op, async_op=True)
        else:
            handle = comm.allreduce_inplace(grads, self.op, group=self.process_group, async_op=True)
        if not bucket.flattened:
            handle.then(lambda: bucket.set_grads_from_flat(grads))
        return handle


class GradientAllReduceAlgorithm(Algorithm):
    """Allreduce the gradients every step.

    Args:
        hierarchical: reduce within each node first, then across nodes.
        average: average the gradients (True) or sum them (False).
    """

    def __init__(self, hierarchical: bool = False, average: bool = True):
        self.hierarchical = bool(hierarchical)
        self.average = bool(average)

    def reify(self, process_group) -> GradientAllReduceAlgorithmImpl:
        return GradientAllReduceAlgorithmImpl(process_group, self.hierarchical, self.average)


GlobalAlgorithmRegistry.register(
    "gradient_allreduce", GradientAllReduceAlgorithm, "allreduce the gradients every step (synchronous SGD)"
)
