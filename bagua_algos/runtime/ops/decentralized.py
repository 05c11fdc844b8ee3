"""Bagua's decentralized synchronous op: gossip averaging of the bucket's weights
(all peers, shift_one pairs, or a topology's Metropolis–Hastings weights)."""

from __future__ import annotations

import torch

from .. import comm
from ..gossip import NeighbourMix
from ..topology import resolve_topology
from .common import effective, is_whole_world, within_nodes

__all__ = ["DecentralizedSynchronousOp", "PEER_SELECTION_MODES", "shift_one_peer"]

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


class DecentralizedSynchronousOp:
    """Gossip averaging of the bucket's weights into ``peer_weight``.

    One execution: peer_weight ← x (the bucket); with ``hierarchical`` it is averaged
    within the node and only the node leaders (local rank 0) gossip; then

    - "all": peer_weight ← mean over the peers;
    - "shift_one": peer_weight ← (peer_weight + that of one peer) / 2, the pairing
      :func:`shift_one_peer` of the number of executions so far;
    - ``topology``: peer_weight ← Σ_j W_ij x_j over the topology's neighbours, W its
      Metropolis–Hastings matrix;

    and with ``hierarchical`` the leader's result is broadcast within the node.
    ``copy_back_peer_weight(bucket)`` writes peer_weight into the bucket. On the
    one-process engine (a stacked group) the gossip itself runs at copy_back, in place
    on every worker's weights (see ``__call__``).
    """

    def __init__(self, bucket, peer_weight, hierarchical: bool, peer_selection_mode: str, group, topology=None):
        if peer_selection_mode not in PEER_SELECTION_MODES:
            raise ValueError(
                f"peer_selection_mode must be one of {list(PEER_SELECTION_MODES)}, got {peer_selection_mode!r}"
            )
        if not torch.is_tensor(peer_weight) or effective(peer_weight).numel() != bucket.numel * (bucket.workers or 1):
            raise ValueError(
                f"peer_weight must be a tensor of the bucket's {bucket.numel} elements "
                "(bucket.flattened_tensor().ensure_bagua_tensor(...) makes one)"
            )
        self.peer_weight = peer_weight
        self.hierarchical = bool(hierarchical)
        self.peer_selection_mode = peer_selection_mode
        self.group = group
        self._state = bucket.state  # checkpointed by the runtime with the bucket
        self._state.setdefault("decentralized_exchanges", 0)
        # On the one-process engine (a stacked group) the workers are one node, every row
        # leads it (its node's gossip is among one leader), and the ranks are the rows.
        self.stacked = comm.is_stacked(group)
        if self.hierarchical:
            if not is_whole_world(group):
                raise ValueError("hierarchical=True gossips between nodes of all workers; use the default group")
            local = comm.get_local_size()
            self.peer_ranks = list(range(0, comm.get_world_size(), local))  # node leaders
            self.is_leader = self.stacked or comm.get_local_rank() == 0
            self.my_index = comm.get_node_rank()
        else:
            self.peer_ranks = comm.group_ranks(group)
            self.is_leader = True
            self.my_index = comm.group_rank(group)
        # One worker in all: the gossip result is the weights themselves, which nothing
        # changes between the op and copy_back_peer_weight; only the count moves.
        self.local_only = len(self.peer_ranks) == 1 and (not self.hierarchical or comm.get_local_size() == 1)
        self.topology = None
        self._received: dict = {}
        if topology is not None:
            members = "the gossip between node leaders" if self.hierarchical else "the process group"
            self.topology = topology = resolve_topology(topology, len(self.peer_ranks), members=members)
            if self.stacked:
                self._mix = NeighbourMix(topology, bucket.device) if len(self.peer_ranks) > 1 else None
                self._spare = None
            else:
                self.weights = topology.gossip_weights(self.my_index)
                self._received = {j: torch.empty_like(effective(peer_weight)) for j in topology.neighbors(self.my_index)}
        elif peer_selection_mode == "shift_one":
            if len(self.peer_ranks) % 2:
                what = "nodes" if self.hierarchical else "workers"
                raise ValueError(f"peer_selection_mode='shift_one' needs an even number of {what}, got {len(self.peer_ranks)}")
            self._received = {"peer": torch.empty_like(effective(peer_weight))}

    def __call__(self, bucket) -> None:
        if self.local_only:
            self._state["decentralized_exchanges"] += 1
            return
        if self.stacked:
            # The one-process engine runs forward and backward between this op and
            # copy_back_peer_weight on one thread, with the weights unchanged: there is no
            # communication to overlap, so the gossip of x^t runs at copy_back, in place on
            # the weights (the two copies through peer_weight saved; it is not filled).
            self._deferred = self.step
            self._state["decentralized_exchanges"] += 1
            return
        x = effective(self.peer_weight)
        x.copy_(bucket.flat_view().view_as(x))  # (peer_weight: Bagua's flattened_tensor(), [L] in a job)
        within_nodes(x, lambda x: self._gossip(x, self.step), self._intra_if_hierarchical(), self.is_leader)
        self._state["decentralized_exchanges"] += 1

    _deferred = None  # the engine: the exchange count of the gossip copy_back runs, if one is due

    def _intra_if_hierarchical(self):
        return comm.intra_node_group() if self.hierarchical else None

    @property
    def step(self) -> int:
        """Executions so far (the shift_one schedule)."""
        return self._state["decentralized_exchanges"]

    def _gossip(self, x: torch.Tensor, step: int) -> None:
        """x ← the gossip of x at exchange ``step`` (shift_one's pairing), in place."""
        if len(self.peer_ranks) == 1:
            return  # one gossiping member (one node): the weights are the result
        if self.stacked and self.topology is not None:
            self._stacked_mix(x)
        elif self.topology is not None:
            sends, recvs = [], []
            for j, buffer in self._received.items():
                sends.append((self.peer_ranks[j], x))
                recvs.append((self.peer_ranks[j], buffer))
            comm.neighbor_exchange(sends, recvs, group=self.group)
            x.mul_(self.weights[self.my_index])
            for j, x_j in self._received.items():
                x.add_(x_j, alpha=self.weights[j])
        elif self.peer_selection_mode == "shift_one":
            size = len(self.peer_ranks)
            peer = (torch.tensor([self.peer_ranks[shift_one_peer(i, size, step)] for i in range(size)])
                    if self.stacked else self.peer_ranks[shift_one_peer(self.my_index, size, step)])
            received = self._received["peer"]
            comm.neighbor_exchange([(peer, x)], [(peer, received)], group=self.group)
            x.add_(received).mul_(0.5)
        else:
            group = comm.inter_node_group() if self.hierarchical else self.group
            comm.allreduce_inplace(x, comm.ReduceOp.AVG, group=group)

    def _stacked_mix(self, x: torch.Tensor) -> None:
        """x ← W x on the engine's rows: what each rank's exchange and multiply-adds
        compute (:class:`~.gossip.NeighbourMix`: the same terms in the same order), in
        one compiled sweep where it is loaded, else into a spare and back."""
        if self._mix.mix_in_place_(x):
            return
        if self._spare is None or self._spare.shape != x.shape:
            self._spare = torch.empty_like(x)
        x.copy_(self._mix.mix(x, self._spare))

    def copy_back_peer_weight(self, bucket) -> None:
        """The bucket's weights ← the gossip result (with one worker, they are it)."""
        if self.local_only:
            return
        if self.stacked:
            step, self._deferred = self._deferred, None
            if step is not None:
                x = bucket.flat_view()
                within_nodes(x, lambda x: self._gossip(x, step), self._intra_if_hierarchical(), self.is_leader)
                bucket.write_flat(x)
            return
        bucket.write_flat(effective(self.peer_weight))
