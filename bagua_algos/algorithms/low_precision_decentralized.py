"""Low-precision decentralized SGD: Bagua's ``low_precision_decentralized``.

After each local step x_{t+½} = x_t − γ g_t, every worker mixes its weights with its
two ring neighbours' and exchanges only the 8-bit quantized *difference* (Tang et al.,
"Communication compression for decentralized training", 2018, as Bagua implements it):

    z_i     = (x_{t+½}^i − x̂^i) + (x̂^{i−1} + x̂^i + x̂^{i+1}) / 3 − x̂^i
            = x_{t+½}^i + x̂^{i−1} / 3 + x̂^{i+1} / 3 − 5 x̂^i / 3        (Bagua's kernel)
    x̂^i    ← x̂^i + Q(z_i)   (and each neighbour's replica of x̂^i moves by the same Q(z_i))
    x_{t+1}^i = x̂^i ≈ Σ_j W_ij x̂^j − γ g_t   (x̂^i is where the local step started)

where x̂^j are the copies every neighbour keeps of worker j's weights, Q the MinMaxUInt8
codec. The op is :class:`bagua_algos.runtime.ops.LowPrecisionDecentralizedSynchronousOp`;
the copies live in the bucket's ``state`` (checkpointed). Steps communicate when
(step − 1) mod ``communication_interval`` = 0; the others are local SGD steps.

Written as Bagua 0.9 writes it: parameters are the Bagua tensors, the post-step hook
marks them ready and waits; the weight and peer copies are
``bucket.flattened_tensor()`` made when the buckets are built (after the initial
broadcast, so every copy starts at the common model).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..arguments import check_flag, check_interval
from ..runtime.algorithm import Algorithm, PostOptimizerStepHook
from .model_averaging import ModelAveragingAlgorithmImpl
from .table import AlgorithmConfig, register_algorithm

if TYPE_CHECKING:
    from ..runtime.bucket import BaguaBucket
    from ..runtime.ddp import BaguaDistributedDataParallel

__all__ = ["LowPrecisionDecentralizedAlgorithm", "LowPrecisionDecentralizedAlgorithmImpl"]


class LowPrecisionDecentralizedAlgorithmImpl(ModelAveragingAlgorithmImpl):
    finds_parameters_in_the_optimizer = True  # (its post-step hook marks the optimizer's parameters ready)

    WORLD_SIZE_RULE = {
        "step counter": "carried over",
        "copies of the own and the ring neighbours' weights": "reset to the loaded weights (at a new world size "
                                                              "every rank loads the same model, so all copies agree)",
        "ring": "rebuilt for the new world size",
    }

    def resized_state(self, bagua_ddp, state, bucket_states):
        copies = ("low_precision_weight", "low_precision_left_peer_weight", "low_precision_right_peer_weight")
        buckets = {b.name: b for b in bagua_ddp.bagua_buckets}
        return state, {name: {**saved, **{key: buckets[name].flat_view().clone() for key in copies}}
                       for name, saved in bucket_states.items()}

    def __init__(self, process_group, hierarchical: bool = True, communication_interval: int = 1):
        super().__init__(process_group, communication_interval)
        self.hierarchical = hierarchical

    def init_tensors(self, bagua_ddp: BaguaDistributedDataParallel) -> list:
        super().init_tensors(bagua_ddp)
        parameters = bagua_ddp.bagua_build_params()
        in_optimizers = {id(p) for opt in bagua_ddp.bagua_optimizers for group in opt.param_groups for p in group["params"]}
        for name, param in parameters:
            if id(param) not in in_optimizers:
                raise ValueError(
                    f"LowPrecisionDecentralizedAlgorithm: parameter {name!r} is not updated by any optimizer "
                    "given to with_bagua; its weights are averaged after the optimizer step, so give every "
                    "trainable parameter to the optimizer (or freeze it with requires_grad=False)"
                )
        return self.tensors

    def init_post_optimizer_step_hook(self, bagua_ddp: BaguaDistributedDataParallel) -> PostOptimizerStepHook:
        # Bagua's: the parameters of the optimizer that stepped (every parameter is in one).
        def hook(optimizer):
            if self._should_communicate(bagua_ddp):
                for group in optimizer.param_groups:
                    for param in group["params"]:
                        if param.is_bagua_tensor():
                            param.bagua_mark_communication_ready()
                bagua_ddp._bagua_backend.wait_pending_comm_ops()

        return hook

    def init_operations(self, bagua_ddp: BaguaDistributedDataParallel, bucket: BaguaBucket) -> None:
        bucket.clear_ops()
        bucket._weight = bucket.flattened_tensor().ensure_bagua_tensor("weight")
        bucket._left_peer_weight = bucket.flattened_tensor().ensure_bagua_tensor("left_peer_weight")
        bucket._right_peer_weight = bucket.flattened_tensor().ensure_bagua_tensor("right_peer_weight")
        bucket.append_low_precision_decentralized_synchronous_op(
            weight=bucket._weight,
            left_peer_weight=bucket._left_peer_weight,
            right_peer_weight=bucket._right_peer_weight,
            hierarchical=self.hierarchical,
            compression="MinMaxUInt8",
            group=self.process_group,
        )


class LowPrecisionDecentralizedAlgorithm(Algorithm):
    """Bagua's low-precision decentralized SGD (ring of workers, 8-bit differences).

    Args:
        hierarchical: average within each node, ring between node leaders (Bagua's
            default: True; on one machine the leader alone then moves its copy by the
            quantized change toward the node's average, so there is no gossip at all).
        communication_interval: communicate at steps 1, k+1, 2k+1, … (Bagua's schedule).
    """

    def __init__(self, hierarchical: bool = True, communication_interval: int = 1):
        self.hierarchical = check_flag("hierarchical", hierarchical)
        self.communication_interval = check_interval(communication_interval)

    def reify(self, process_group) -> LowPrecisionDecentralizedAlgorithmImpl:
        return LowPrecisionDecentralizedAlgorithmImpl(
            process_group, hierarchical=self.hierarchical, communication_interval=self.communication_interval
        )


register_algorithm(
    "low_precision_decentralized",
    LowPrecisionDecentralizedAlgorithm,
    "decentralized SGD on a ring exchanging 8-bit compressed weight differences (Bagua's)",
    rows=[(280, AlgorithmConfig("low_precision_decentralized", "low_precision_decentralized",
                                {"hierarchical": False}, replicas="drift", tolerance=1e-3))],
)
