"""The ops a bucket runs once it is ready (built by ``BaguaBucket.append_*``).

Each op is a callable ``op(bucket)`` run on the backend's communication thread; it may
block on collectives, which only that thread waits for. Ops reach torch.distributed
through :mod:`.comm` only.
"""

from __future__ import annotations

import threading
from typing import Optional

import torch

from . import comm

__all__ = [
    "PythonOp",
    "CentralizedSynchronousOp",
    "DecentralizedSynchronousOp",
    "AsyncModelAverageOp",
    "PEER_SELECTION_MODES",
    "COMPRESSIONS",
    "shift_one_peer",
]

PEER_SELECTION_MODES = ("all", "shift_one")
COMPRESSIONS = (None, "MinMaxUInt8")


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


def _is_whole_world(group) -> bool:
    return group is None or comm.group_ranks(group) == list(range(comm.get_world_size()))


def _effective(tensor: torch.Tensor) -> torch.Tensor:
    if hasattr(tensor, "is_bagua_tensor") and tensor.is_bagua_tensor():
        return tensor.bagua_getter_closure()
    return tensor


class PythonOp:
    """``python_function(bucket_name)``."""

    def __init__(self, python_function):
        self.python_function = python_function

    def __call__(self, bucket) -> None:
        self.python_function(bucket.name)


class CentralizedSynchronousOp:
    """Sum (``average=False``) or mean of the bucket over the group, in place."""

    def __init__(self, hierarchical: bool, average: bool, scattergather: bool, compression: Optional[str], group):
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {list(COMPRESSIONS)}, got {compression!r}")
        if compression is not None:
            raise NotImplementedError(
                f"compression={compression!r} needs the MinMaxUInt8 codec, which this version of "
                "bagua-algos does not have yet; use compression=None"
            )
        if hierarchical and not _is_whole_world(group):
            raise ValueError("hierarchical=True reduces over all workers (nodes of LOCAL_WORLD_SIZE); use the default group")
        self.hierarchical = bool(hierarchical)
        self.op = comm.ReduceOp.AVG if average else comm.ReduceOp.SUM
        self.scattergather = bool(scattergather)
        self.group = group

    def __call__(self, bucket) -> None:
        flat = bucket.flat_view()
        if self.hierarchical:
            comm.hierarchical_allreduce_inplace(flat, self.op)
        elif self.scattergather:
            self._reduce_scatter_gather(flat)
        else:
            comm.allreduce_inplace(flat, self.op, group=self.group)
        bucket.write_flat(flat)

    def _reduce_scatter_gather(self, flat: torch.Tensor) -> None:
        """Each worker reduces one chunk, then every worker gathers all chunks."""
        size = comm.get_world_size(self.group)
        chunk = -(-flat.numel() // size)
        padded = flat if chunk * size == flat.numel() else torch.cat([flat, flat.new_zeros(chunk * size - flat.numel())])
        mine = flat.new_empty(chunk)
        comm.reduce_scatter(padded, mine, self.op, group=self.group)
        comm.allgather(mine, padded, group=self.group)
        if padded is not flat:
            flat.copy_(padded[: flat.numel()])


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
    ``copy_back_peer_weight(bucket)`` writes peer_weight into the bucket.
    """

    def __init__(self, bucket, peer_weight, hierarchical: bool, peer_selection_mode: str, group, topology=None):
        if peer_selection_mode not in PEER_SELECTION_MODES:
            raise ValueError(
                f"peer_selection_mode must be one of {list(PEER_SELECTION_MODES)}, got {peer_selection_mode!r}"
            )
        if not torch.is_tensor(peer_weight) or _effective(peer_weight).numel() != bucket.numel:
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
        if self.hierarchical:
            if not _is_whole_world(group):
                raise ValueError("hierarchical=True gossips between nodes of all workers; use the default group")
            local = comm.get_local_size()
            self.peer_ranks = list(range(0, comm.get_world_size(), local))  # node leaders
            self.is_leader = comm.get_local_rank() == 0
            self.my_index = comm.get_node_rank()
        else:
            self.peer_ranks = comm.group_ranks(group)
            self.is_leader = True
            self.my_index = comm.group_rank(group)
        self.topology = None
        self._received: dict = {}
        if topology is not None:
            from topologies import Topology, get_topology

            if isinstance(topology, str):
                topology = get_topology(topology, len(self.peer_ranks))
            if not isinstance(topology, Topology) or topology.world_size != len(self.peer_ranks):
                raise ValueError(
                    f"topology must be a Topology over the {len(self.peer_ranks)} gossiping "
                    f"{'nodes' if self.hierarchical else 'workers'}, got {topology!r}"
                )
            self.topology = topology
            self.weights = topology.gossip_weights(self.my_index)
            self._received = {j: torch.empty_like(_effective(peer_weight)) for j in topology.neighbors(self.my_index)}
        elif peer_selection_mode == "shift_one":
            if len(self.peer_ranks) % 2:
                what = "nodes" if self.hierarchical else "workers"
                raise ValueError(f"peer_selection_mode='shift_one' needs an even number of {what}, got {len(self.peer_ranks)}")
            self._received = {"peer": torch.empty_like(_effective(peer_weight))}

    def __call__(self, bucket) -> None:
        x = _effective(self.peer_weight)
        x.copy_(bucket.flat_view())
        if self.hierarchical:
            comm.allreduce_inplace(x, comm.ReduceOp.AVG, group=comm.intra_node_group())
        if self.is_leader:
            self._gossip(x)
        if self.hierarchical:
            comm.broadcast(x, src=comm.get_node_rank() * comm.get_local_size(), group=comm.intra_node_group())
        self._state["decentralized_exchanges"] += 1

    @property
    def step(self) -> int:
        """Executions so far (the shift_one schedule)."""
        return self._state["decentralized_exchanges"]

    def _gossip(self, x: torch.Tensor) -> None:
        if self.topology is not None:
            sends, recvs = [], []
            for j, buffer in self._received.items():
                sends.append((self.peer_ranks[j], x))
                recvs.append((self.peer_ranks[j], buffer))
            comm.neighbor_exchange(sends, recvs)
            x.mul_(self.weights[self.my_index])
            for j, x_j in self._received.items():
                x.add_(x_j, alpha=self.weights[j])
        elif self.peer_selection_mode == "shift_one":
            peer = self.peer_ranks[shift_one_peer(self.my_index, len(self.peer_ranks), self.step)]
            received = self._received["peer"]
            comm.neighbor_exchange([(peer, x)], [(peer, received)])
            x.add_(received).mul_(0.5)
        else:
            group = comm.inter_node_group() if self.hierarchical else self.group
            comm.allreduce_inplace(x, comm.ReduceOp.AVG, group=group)

    def copy_back_peer_weight(self, bucket) -> None:
        """The bucket's weights ← the gossip result."""
        bucket.write_flat(_effective(self.peer_weight))


class AsyncModelAverageOp:
    """One round of asynchronous model averaging (Bagua's async op, on gloo too).

    A round copies the weights s under the weight lock, averages the copies over the
    group, and, under the lock again, moves the weights by the average's change:
    x ← x + (mean_j s_j − s), so local steps taken meanwhile are kept. Every round's
    allreduce also carries a stop flag: once any worker has called :meth:`abort`, all
    of them learn it in the same round and stop after it, so every worker runs the
    same number of collectives and nobody is left waiting.
    """

    def __init__(self, bucket, peer_selection_mode: str, group):
        if peer_selection_mode != "all":
            raise ValueError(f"the asynchronous model average supports peer_selection_mode='all' only, got {peer_selection_mode!r}")
        self.peer_selection_mode = peer_selection_mode
        self.group = group
        self._lock = threading.Lock()
        self._locked = False
        self._abort_requested = False
        self._stopped = False
        self.rounds = 0

    # --- the weight lock (training thread: forward to optimizer step) -----------------
    def lock_weight(self) -> None:
        if not self._locked:
            self._lock.acquire()
            self._locked = True

    def unlock_weight(self) -> None:
        if self._locked:
            self._locked = False
            self._lock.release()

    # --- life cycle -----------------------------------------------------------------------
    def get_status(self) -> bool:
        """True while rounds still run (no worker has aborted)."""
        return not self._stopped

    def abort(self) -> None:
        """Ask every worker to stop after the next round."""
        self._abort_requested = True

    def reset(self) -> None:
        """Run rounds again after an abort."""
        self._abort_requested = False
        self._stopped = False

    def __call__(self, bucket) -> None:
        if self._stopped:
            return
        with self._lock:
            snapshot = bucket.flattened_tensor()
        message = torch.cat([snapshot, snapshot.new_full((1,), 1.0 if self._abort_requested else 0.0)])
        comm.allreduce_inplace(message, comm.ReduceOp.SUM, group=self.group)
        size = comm.get_world_size(self.group)
        change = message[:-1].div_(size).sub_(snapshot)
        with self._lock:
            flat = bucket.flat_view()
            flat.add_(change)
            bucket.write_flat(flat)
        self.rounds += 1
        if message[-1].item() > 0:
            self._stopped = True
