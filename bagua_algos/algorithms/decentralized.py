"""Decentralized SGD (D-PSGD), Bagua's ``decentralized`` algorithm, plus gossip over a
topology.

Each communicating step mixes the weights taken before forward with those of peers
while forward and backward run, then applies the gradient computed at the old weights:

    x_i^{t+1} = Σ_j W_ij x_j^t − γ ∇f_i(x_i^t).

Written as Bagua 0.9 writes it: the parameters are the Bagua tensors, in one flattened
bucket with one decentralized synchronous op. The forward pre-hook marks them ready, so
the communication thread gossips x^t into ``peer_weight`` while forward and backward
run (shift_one and a topology send x^t from the bucket, which forward and backward only
read, and build the result in ``peer_weight``; "all" copies it there and averages it in
place); the post-backward hook waits and copies the result back before the optimizer
step. Steps communicate when (step − 1) mod ``communication_interval`` = 0.

Peer selection (W):
- ``"all"``: W = (1/n) 11ᵀ, an allreduce average of the weights;
- ``"shift_one"``: each worker averages with one peer, (x_i + x_peer)/2, the pairing
  shifting at every exchange (:func:`shift_one_peer`);
- ``topology=``: the topology's Metropolis–Hastings matrix, over a neighbour exchange
  between workers.

With ``quasi_global_momentum=True`` (Lin et al. 2021) the step is instead the paper's:
the optimizer's SGD-momentum step, then the gossip over the topology, and the momentum
buffer rebuilt from the model's change (:mod:`.quasi_global_momentum`).

With ``hierarchical=True`` (Bagua's default without a topology) the weights are first
averaged within each node, the node leaders (local rank 0) gossip among nodes, and the
result is broadcast within the node; on one node that is the exact average.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..arguments import check_choice, check_flag, check_interval
from ..runtime import comm
from ..runtime.algorithm import Algorithm, ForwardPreHook, PostBackwardHook, PostOptimizerStepHook
from ..runtime.bucket import BaguaBucket
from ..runtime.ops import PEER_SELECTION_MODES, shift_one_peer
from ..runtime.topology import check_topology_arg, resolve_topology
from .model_averaging import ModelAveragingAlgorithmImpl
from .table import AlgorithmConfig, register_algorithm

if TYPE_CHECKING:
    from ..runtime.ddp import BaguaDistributedDataParallel

__all__ = ["DecentralizedAlgorithm", "DecentralizedAlgorithmImpl", "shift_one_peer", "PEER_SELECTION_MODES"]


class DecentralizedAlgorithmImpl(ModelAveragingAlgorithmImpl):
    WORLD_SIZE_RULE = {
        "step counter and exchange count (shift_one's schedule)": "carried over",
        "peer buffer (peer_weight)": "reset: refilled from the weights at the next exchange",
        "topology and peers": "rebuilt for the new world size",
    }

    needs_optimizer_step = False  # it communicates in forward and backward, not after the step

    def __init__(self, process_group, hierarchical=True, peer_selection_mode="all",
                 communication_interval=1, topology=None):
        super().__init__(process_group, communication_interval)
        self.hierarchical = hierarchical
        self.peer_selection_mode = peer_selection_mode
        self.topology = None
        if topology is not None:
            if hierarchical:
                peers, members = comm.get_world_size() // comm.get_local_size(), "the gossip between node leaders"
            else:
                peers, members = comm.get_world_size(process_group), "the process group"
            self.topology = resolve_topology(topology, peers, members=members)

    def tensors_to_buckets(self, tensors: list, do_flatten: bool) -> list[BaguaBucket]:
        tensors = [t for group in tensors for t in group]
        if not tensors:
            raise ValueError(
                "DecentralizedAlgorithm: the module has no parameter that requires grad, so there are no "
                "weights to gossip; wrap a module with trainable parameters"
            )
        return [BaguaBucket(tensors, flatten=do_flatten, name="0")]

    def init_operations(self, bagua_ddp: BaguaDistributedDataParallel, bucket: BaguaBucket) -> None:
        bucket.clear_ops()
        peer_weight = bucket.flattened_tensor().ensure_bagua_tensor("peer_weight")
        bucket._peer_weight = peer_weight  # Bagua's name: scripts and Bagua's tests read the mixed weights there
        bucket._decentralized_op = bucket.append_decentralized_synchronous_op(
            peer_weight=peer_weight,
            hierarchical=self.hierarchical,
            peer_selection_mode=self.peer_selection_mode,
            group=self.process_group,
            topology=self.topology,
        )

    def init_forward_pre_hook(self, bagua_ddp: BaguaDistributedDataParallel) -> ForwardPreHook:
        def hook(inputs):
            if self._should_communicate(bagua_ddp):
                # the op's execution announced first: a job's pairwise exchange is posted
                # from here (DecentralizedSynchronousOp.post); a subclass whose
                # init_operations appends no such op has nothing to announce
                for bucket in bagua_ddp.bagua_buckets:
                    op = getattr(bucket, "_decentralized_op", None)
                    if op is not None:
                        op.post(bucket)
                for tensor in self.tensors:
                    tensor.bagua_mark_communication_ready()

        return hook

    def init_post_backward_hook(self, bagua_ddp: BaguaDistributedDataParallel) -> PostBackwardHook:
        def hook():
            if self._should_communicate(bagua_ddp):
                bagua_ddp._bagua_backend.wait_pending_comm_ops()
                for bucket in bagua_ddp.bagua_buckets:
                    bucket._decentralized_op.copy_back_peer_weight(bucket)

        return hook

    def init_post_optimizer_step_hook(self, bagua_ddp: BaguaDistributedDataParallel) -> PostOptimizerStepHook:
        # The exchange runs during forward and backward (above): nothing after the
        # step, where model averaging's default hook would average once more.
        return lambda optimizer: None


_UNSET = object()


class DecentralizedAlgorithm(Algorithm):
    """D-PSGD with Bagua's arguments.

    Args:
        hierarchical: average within each node first and gossip between nodes only.
            Defaults to True (Bagua's default) without a topology; a topology means gossip
            between workers, so it defaults to False then.
        peer_selection_mode: ``"all"`` or ``"shift_one"`` (not used with ``topology``).
        communication_interval: communicate at steps 1, k+1, 2k+1, … (Bagua's schedule).
        topology: gossip over this topology (a name from ``topologies`` or a Topology)
            with Metropolis–Hastings weights, instead of Bagua's peer selection.
        quasi_global_momentum: D-PSGD with quasi-global momentum (QG-DSGDm, Lin et al.
            2021): gossip after the optimizer's step, over ``topology`` (required; the
            time-varying ``"one_peer_exponential"`` too), and the optimizer's momentum
            buffer (torch.optim.SGD, momentum β > 0) replaced every step by
            β m̂ + (1 − β)(x_t − x_{t+1})/η. ``communication_interval`` must stay 1.

    The exchange count (the shift_one schedule) lives in the bucket's state, so
    ``bagua_state_dict()`` saves it.
    """

    def __init__(self, hierarchical=_UNSET, peer_selection_mode: str = "all",
                 communication_interval: int = 1, topology=None, quasi_global_momentum: bool = False):
        if hierarchical is not _UNSET:
            check_flag("hierarchical", hierarchical)
        self.quasi_global_momentum = check_flag("quasi_global_momentum", quasi_global_momentum)
        if quasi_global_momentum and (topology is None or communication_interval != 1):
            raise ValueError(
                "quasi_global_momentum=True gossips every step over a topology: pass topology= (e.g. 'ring' or "
                f"'one_peer_exponential') and communication_interval=1, got topology={topology!r}, "
                f"communication_interval={communication_interval!r}"
            )
        peer_selection_mode = check_choice("peer_selection_mode", peer_selection_mode, PEER_SELECTION_MODES)
        if topology is not None:
            check_topology_arg(topology)
            if hierarchical is True:
                raise ValueError(
                    "topology= gossips between workers, hierarchical=True averages each node and gossips "
                    "between nodes: pass one of them (hierarchical=False with a topology)"
                )
        if hierarchical is _UNSET:
            hierarchical = topology is None
        self.hierarchical = hierarchical
        self.peer_selection_mode = peer_selection_mode
        self.communication_interval = check_interval(communication_interval)
        self.topology = topology

    def reify(self, process_group) -> DecentralizedAlgorithmImpl:
        if self.quasi_global_momentum:
            from .quasi_global_momentum import QuasiGlobalMomentumImpl

            return QuasiGlobalMomentumImpl(process_group, self.topology)
        return DecentralizedAlgorithmImpl(
            process_group, self.hierarchical, self.peer_selection_mode, self.communication_interval, self.topology
        )


register_algorithm(
    "decentralized", DecentralizedAlgorithm, "D-PSGD: mix weights with peers while computing gradients",
    rows=[
        # Bagua's defaults: average within each node, gossip ("all") between node leaders.
        (40, AlgorithmConfig("decentralized", "decentralized", replicas="differ", exact_alone=True)),
        (50, AlgorithmConfig("decentralized_ring", "decentralized", {"hierarchical": False, "topology": "ring"},
                             replicas="differ", exact_alone=True, in_sweep=True)),
        (60, AlgorithmConfig("decentralized_all", "decentralized",
                             {"hierarchical": False, "peer_selection_mode": "all"},
                             replicas="differ", exact_alone=True, in_sweep=True)),
        (70, AlgorithmConfig("decentralized_shift_one", "decentralized",
                             {"hierarchical": False, "peer_selection_mode": "shift_one"},
                             min_workers=2, even_workers=True, replicas="differ")),
        # A baseline of the RelaySum paper, with the others after relay's rows: D-PSGD with
        # quasi-global momentum on the ring. It gossips after the optimizer step, so two
        # workers (a ring of two mixes with weights 1/2) end every step equal: "drift".
        (110, AlgorithmConfig("decentralized_ring_qgm", "decentralized",
                              {"hierarchical": False, "topology": "ring", "quasi_global_momentum": True},
                              replicas="drift")),
    ],
)
