"""RelaySum/Grad (Vogels et al. 2021, the RelaySum paper's second variant): relay the
workers' updates over a tree instead of their models.

Each step, after the user's optimizer has taken the local step x½ = x_t + u_t (u_t its
update: −γ g_t, or a local-momentum step), the updates travel as RelaySum's messages
(:func:`~.relay.relay_messages`): worker i sends neighbour j

    m_{i→j} = u_i + Σ_{k∈N_i∖j} m_{k→i}   (last step's messages),

so each worker's update reaches every other worker exactly once, delayed by their
distance in the tree. Every worker then applies the sum of what reached it, over n:

    x_{t+1} = x_t + (u_t + Σ_j m_{j→i}) / n,

a delayed uniform average of all updates (before the pipeline has filled, the updates
not yet arrived count as zero: the RelaySum paper's normalisation by n). Optimizer
state stays local; the same tree machinery, double binary tree included, as RelaySGD.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..arguments import check_real, check_seed
from ..runtime.algorithm import Algorithm, ForwardPreHook, PostOptimizerStepHook
from ..runtime.topology import check_topology_arg
from .relay import RelayAlgorithmImpl
from .table import AlgorithmConfig, register_algorithm

if TYPE_CHECKING:
    from ..runtime.bucket import BaguaBucket
    from ..runtime.ddp import BaguaDistributedDataParallel

__all__ = ["RelaySumGradAlgorithm", "RelaySumGradAlgorithmImpl"]


class RelaySumGradAlgorithmImpl(RelayAlgorithmImpl):
    """RelaySGD's impl relaying u_t = x½ − x_t (x_t copied at forward) in mode
    "world_size" with missing updates zero, then x_{t+1} = x_t + the relay average."""

    WORLD_SIZE_RULE = {
        "step counter, relay step, drops counted": "carried over",
        "relayed updates and counts per tree link, last n̄": "reset to zero (sums over the old tree's links)",
        "drop generator": "reset to rank_seed(seed, the new rank)",
        "trees": "rebuilt for the new world size",
    }
    relays_models = False

    def __init__(self, process_group, topology, drop_rate, seed):
        super().__init__(process_group, topology, "world_size", drop_rate, seed)
        self.previous: dict = {}  # bucket name → x_t, [W, numel]

    def init_operations(self, bagua_ddp: BaguaDistributedDataParallel, bucket: BaguaBucket) -> None:
        super().init_operations(bagua_ddp, bucket)
        self.previous[bucket.name] = bucket.flat_view().detach().clone()

    def init_forward_pre_hook(self, bagua_ddp: BaguaDistributedDataParallel) -> ForwardPreHook:
        def hook(inputs):
            for bucket in bagua_ddp.bagua_buckets:
                self.previous[bucket.name].copy_(bucket.flat_view())

        return hook

    def init_post_optimizer_step_hook(self, bagua_ddp: BaguaDistributedDataParallel) -> PostOptimizerStepHook:
        def hook(optimizer):
            buckets = bagua_ddp.bagua_buckets
            for bucket in buckets:  # the parameters hold u_t while the relay runs
                flat = bucket.flat_view()
                flat.sub_(self.previous[bucket.name])
                bucket.write_flat(flat)
            self.relay_step(buckets)  # u → (u_t + Σ m) / n
            for bucket in buckets:
                flat = bucket.flat_view()
                flat.add_(self.previous[bucket.name])
                bucket.write_flat(flat)

        return hook


class RelaySumGradAlgorithm(Algorithm):
    """RelaySum/Grad over a tree topology.

    Args:
        topology: "chain" (default, the paper's), "binary_tree", "double_binary_tree"
            or a tree Topology.
        drop_rate: probability that a message is lost (simulated, as RelaySGD's).
        seed: seeds the simulated drops (rank r: ``rank_seed(seed, r)``).

    Example::

        >>> from bagua_algos.algorithms import RelaySumGradAlgorithm
        >>> RelaySumGradAlgorithm().topology
        'chain'
    """

    def __init__(self, topology="chain", drop_rate: float = 0.0, seed: int = 0):
        check_topology_arg(topology, require_tree=True)
        self.topology = topology
        self.drop_rate = check_real("drop_rate", drop_rate, 0.0, 1.0, high_open=True, what="a probability in [0, 1)")
        self.seed = check_seed(seed)

    def reify(self, process_group) -> RelaySumGradAlgorithmImpl:
        return RelaySumGradAlgorithmImpl(process_group, self.topology, self.drop_rate, self.seed)


register_algorithm(
    "relaysum_grad", RelaySumGradAlgorithm,
    "RelaySum/Grad: relay the updates over a tree, apply their delayed average",
    # A baseline of the RelaySum paper, on a chain. It communicates after the optimizer
    # step, so two workers end every step equal: "drift".
    rows=[(140, AlgorithmConfig("relaysum_grad_chain", "relaysum_grad", {"topology": "chain"}, replicas="drift"))],
)
