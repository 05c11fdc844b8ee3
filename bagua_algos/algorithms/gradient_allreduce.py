"""Gradient allreduce: synchronous data-parallel SGD, as torch DDP.

Every worker applies the same gradient g = (1/n) Σ_i g_i (or Σ_i g_i with
``average=False``). Written exactly as a Bagua 0.9 algorithm: the runtime's defaults
register each gradient and mark it ready once accumulated; each bucket gets one
centralized synchronous op, which the communication thread runs as soon as the bucket
is ready, so communication overlaps the rest of backward; the post-backward hook waits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..arguments import check_flag
from ..runtime.algorithm import Algorithm, AlgorithmImpl
from .table import AlgorithmConfig, register_algorithm

if TYPE_CHECKING:
    from ..runtime.bucket import BaguaBucket
    from ..runtime.ddp import BaguaDistributedDataParallel

__all__ = ["GradientAllReduceAlgorithm", "GradientAllReduceAlgorithmImpl"]


class GradientAllReduceAlgorithmImpl(AlgorithmImpl):
    WORLD_SIZE_RULE = {"step counter": "carried over",
                       "other state": "none (the gradients are averaged afresh at every step)"}

    def __init__(self, process_group, hierarchical: bool = False, average: bool = True):
        super().__init__(process_group)
        self.hierarchical = hierarchical
        self.average = average

    def init_operations(self, bagua_ddp: BaguaDistributedDataParallel, bucket: BaguaBucket) -> None:
        bucket.clear_ops()
        bucket.append_centralized_synchronous_op(
            hierarchical=self.hierarchical, average=self.average, group=self.process_group
        )


class GradientAllReduceAlgorithm(Algorithm):
    """Allreduce the gradients every step.

    Args:
        hierarchical: reduce within each node first, then across nodes.
        average: average the gradients (True) or sum them (False).
    """

    def __init__(self, hierarchical: bool = False, average: bool = True):
        self.hierarchical = check_flag("hierarchical", hierarchical)
        self.average = check_flag("average", average)

    def reify(self, process_group) -> GradientAllReduceAlgorithmImpl:
        return GradientAllReduceAlgorithmImpl(process_group, self.hierarchical, self.average)


register_algorithm(
    "gradient_allreduce", GradientAllReduceAlgorithm, "allreduce the gradients every step (synchronous SGD)",
    rows=[
        (10, AlgorithmConfig("gradient_allreduce", "gradient_allreduce", exact_alone=True)),
        (20, AlgorithmConfig("gradient_allreduce_hierarchical", "gradient_allreduce", {"hierarchical": True},
                             exact_alone=True)),
    ],
)
