"""Decentralized SGD (D-PSGD), Bagua's ``decentralized`` algorithm, plus gossip over a
topology.

Each communicating step mixes the weights taken before forward with those of peers
while forward and backward run, then applies the gradient computed at the old weights:

    x_i^{t+1} = Σ_j W_ij x_j^t − γ ∇f_i(x_i^t).

Peer selection (W):
- ``"all"``: W = (1/n) 11ᵀ, an allreduce average of the weights;
- ``"shift_one"``: each worker averages with one peer, (x_i + x_peer)/2, the pairing
  shifting at every exchange (:func:`shift_one_peer`);
- ``topology=``: the topology's Metropolis–Hastings matrix, over a neighbor exchange.

With ``hierarchical=True`` (Bagua's default) the weights are first averaged within each
node, the node leaders (local rank 0) run the exchange among nodes, and the result is
broadcast within the node; on one node that is the exact average.

Buffers: without hierarchy, "shift_one" and topology gossip send the parameters
themselves (nothing writes them while forward and backward run) and mix the received
weights into them in place once the exchange is done, with no copy of the model; "all"
and the hierarchical mode reduce a private copy of x^t, copied back at the end.
"""

from __future__ import annotations

import torch

from ..runtime import comm
from ..runtime.algorithm import Algorithm, AlgorithmImpl, GlobalAlgorithmRegistry
from .allreduce_average import check_interval
from .topology_arg import check_topology_arg, resolve_topology

__all__ = ["DecentralizedAlgorithm", "DecentralizedAlgorithmImpl", "shift_one_peer", "PEER_SELECTION_MODES"]

PEER_SELECTION_MODES = ("all", "shift_one")


def shift_one_peer(rank: int, world_size: int, step: int) -> int:
    """Bagua's shift_one pairing at exchange ``step`` (counted from 0), n even.

    Ranks below n/2 pair with the upper half: r ↦ ((step + r) mod n/2) + n/2, and
    r ≥ n/2 ↦ (r − n/2 − step) mod n/2, the inverse map, so the pairs are symmetric.
    """
    if world_size % 2:
        raise ValueError(f"shift_one needs an even number of workers, got {world_size}")
    half = world_size // 2
    if rank < half:
        return (step + rank) % half + half
    return (rank - half - step) % half


class DecentralizedAlgorithmImpl(AlgorithmImpl):
    def __init__(self, process_group, hierarchical, peer_selection_mode, communication_interval, topology):
        super().__init__(process_group)
        self.hierarchical = hierarchical
        self.peer_selection_mode = peer_selection_mode
        self.communication_interval = communication_interval
        self.exchanges = 0  # executed exchanges: the shift_one schedule's step
        self._pending = None
        self._buffers: dict[str, dict] = {}
        ranks = comm.group_ranks(process_group)
        if hierarchical:
            if process_group is not None:
                raise ValueError("hierarchical=True runs over all workers; pass process_group=None")
            local = comm.get_local_size()
            self.peer_ranks = list(range(0, comm.get_world_size(), local))  # node leaders
            self.is_leader = comm.get_local_rank() == 0
            self.my_index = comm.get_node_rank()
        else:
            self.peer_ranks = ranks
            self.is_leader = True
            self.my_index = comm.group_rank(process_group)
        self.topology = None
        if topology is not None:
            self.topology = resolve_topology(topology, len(self.peer_ranks))
            self.weights = self.topology.gossip_weights(self.my_index)
        elif peer_selection_mode == "shift_one" and len(self.peer_ranks) % 2:
            what = "nodes" if hierarchical else "workers"
            raise ValueError(
                f"peer_selection_mode='shift_one' needs an even number of {what}, got {len(self.peer_ranks)}"
            )

    # Weights are what this algorithm communicates; gradients stay local.
    def init_backward_hook(self, bagua_ddp):
        return lambda name, param: None

    def init_operations(self, bagua_ddp, bucket):
        bucket.clear_ops()
        buffer = lambda: torch.empty(bucket.numel, dtype=bucket.dtype, device=bucket.device)  # noqa: E731
        if self.topology is not None:
            peers = self.topology.neighbors(self.my_index)
        elif self.peer_selection_mode == "shift_one":
            peers = ["peer"]
        else:
            peers = []
        # "work": a private copy of x^t, reduced in place while forward and backward read
        # the parameters: needed by the node average (hierarchical) and by the allreduce
        # ("all"). Gossip without hierarchy sends the parameters themselves (they do not
        # change before the exchange is finished) and mixes into them in place.
        needs_work = self.hierarchical or (self.topology is None and self.peer_selection_mode == "all")
        self._buffers[bucket.name] = {
            "work": buffer() if needs_work else None,
            "own": None,  # what this worker contributes to the exchange in flight
            "recv": {j: buffer() for j in peers},
        }

    def init_forward_pre_hook(self, bagua_ddp):
        def hook(inputs):
            if self._pending is not None:  # a forward without backward: finish that exchange
                self._finish(bagua_ddp)
            if bagua_ddp.bagua_train_step_counter % self.communication_interval == 0:
                self._pending = self._start_exchange(bagua_ddp)

        return hook

    def init_post_backward_hook(self, bagua_ddp):
        def hook():
            if self._pending is not None:
                self._finish(bagua_ddp)

        return hook

    # --- exchange -------------------------------------------------------------------
    def _start_exchange(self, bagua_ddp) -> list:
        handles, sends, recvs = [], [], []
        if self.topology is None and self.peer_selection_mode == "shift_one":
            peer = self.peer_ranks[shift_one_peer(self.my_index, len(self.peer_ranks), self.exchanges)]
        for bucket in bagua_ddp.buckets:
            buffers = self._buffers[bucket.name]
            own = bucket.flat_params()  # x^t
            if buffers["work"] is not None:
                own = buffers["work"].copy_(own)
            buffers["own"] = own
            if self.hierarchical:
                comm.allreduce_inplace(own, comm.ReduceOp.AVG, group=comm.intra_node_group())
                if not self.is_leader:
                    continue
            if self.topology is not None:
                for j, received in buffers["recv"].items():
                    sends.append((self.peer_ranks[j], own))
                    recvs.append((self.peer_ranks[j], received))
            elif self.peer_selection_mode == "shift_one":
                sends.append((peer, own))
                recvs.append((peer, buffers["recv"]["peer"]))
            else:
                group = comm.inter_node_group() if self.hierarchical else self.process_group
                handles.append(comm.allreduce_inplace(own, comm.ReduceOp.AVG, group=group, async_op=True))
        if sends:
            handles.append(comm.start_neighbor_exchange(sends, recvs))
        return handles

    def _finish(self, bagua_ddp) -> None:
        for handle in self._pending:
            handle.wait()
        self._pending = None
        for bucket in bagua_ddp.buckets:
            buffers = self._buffers[bucket.name]
            own = buffers["own"]
            if self.is_leader:
                self._mix(own, buffers["recv"])
            if self.hierarchical:
                comm.broadcast(own, src=comm.get_node_rank() * comm.get_local_size(), group=comm.intra_node_group())
            bucket.set_params_from_flat(own)  # a no-op when own is the parameter buffer
            buffers["own"] = None
        self.exchanges += 1

    def _mix(self, own, received) -> None:
        """own ← Σ_j W_ij x_j, in place (for "all" the allreduce already left the mean in own)."""
        if self.topology is not None:
            own.mul_(self.weights[self.my_index])
            for j, x_j in received.items():
                own.add_(x_j, alpha=self.weights[j])
        elif self.peer_selection_mode == "shift_one":
            own.add_(received["peer"]).mul_(0.5)

    # --- checkpointing -------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"exchanges": self.exchanges}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.exchanges = int(state["exchanges"])


class DecentralizedAlgorithm(Algorithm):
    """D-PSGD with Bagua's arguments.

    Args:
        hierarchical: average within each node first and exchange between nodes only.
        peer_selection_mode: ``"all"`` or ``"shift_one"`` (ignored when ``topology`` is given).
        communication_interval: exchange every this many steps.
        topology: gossip over this topology (a name from ``topologies`` or a Topology)
            with Metropolis–Hastings weights, instead of Bagua's peer selection.
    """

    def __init__(self, hierarchical: bool = True, peer_selection_mode: str = "all",
                 communication_interval: int = 1, topology=None):
        if peer_selection_mode not in PEER_SELECTION_MODES:
            raise ValueError(
                f"peer_selection_mode must be one of {list(PEER_SELECTION_MODES)}, got {peer_selection_mode!r}"
            )
        if topology is not None:
            check_topology_arg(topology)
        self.hierarchical = bool(hierarchical)
        self.peer_selection_mode = peer_selection_mode
        self.communication_interval = check_interval(communication_interval)
        self.topology = topology

    def reify(self, process_group) -> DecentralizedAlgorithmImpl:
        return DecentralizedAlgorithmImpl(
            process_group, self.hierarchical, self.peer_selection_mode, self.communication_interval, self.topology
        )


GlobalAlgorithmRegistry.register(
    "decentralized", DecentralizedAlgorithm, "D-PSGD: mix weights with peers while computing gradients"
)
