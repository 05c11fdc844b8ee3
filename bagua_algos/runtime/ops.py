"""The ops a bucket runs once it is ready (built by ``BaguaBucket.append_*``).

Each op is a callable ``op(bucket)`` run on the backend's communication thread; it may
block on collectives, which only that thread waits for. Ops reach torch.distributed
through :mod:`.comm` only.
"""

from __future__ import annotations

import threading
from typing import Optional, Sequence

import torch

from ..compression import minmax
from ..compression.scatter_gather import raise_if_marked, reduce_chunks, scatter_gather  # noqa: F401 (reduce_chunks: a name of ops)
from . import comm
from .gossip import NeighbourMix
from .topology import resolve_topology

__all__ = [
    "PythonOp",
    "CentralizedSynchronousOp",
    "DecentralizedSynchronousOp",
    "LowPrecisionDecentralizedSynchronousOp",
    "compressed_scatter_gather",
    "low_precision_difference",
    "reduce_chunks",
    "ring_peers",
    "AsyncModelAverageOp",
    "PEER_SELECTION_MODES",
    "COMPRESSIONS",
    "shift_one_peer",
]

PEER_SELECTION_MODES = ("all", "shift_one")
COMPRESSIONS = (None, "MinMaxUInt8")
MINMAX_UINT8_BITS = 8  # Bagua's MinMaxUInt8: 256 levels between a chunk's min and max


def compressed_scatter_gather(
    flat: torch.Tensor,
    bits: int,
    average: bool,
    group,
    stochastic: bool = False,
    generator=None,
) -> torch.Tensor:
    """Reduce ``flat`` over ``group`` in place through the min-max codec (Bagua's
    compressed scatter-gather), returning the decoded values of what this worker sent
    in the first stage, D(Q(c_j)) (for error feedback), shaped as ``flat``: the
    stages, bounds and stacked form are
    :func:`bagua_algos.compression.scatter_gather.scatter_gather`'s, run here over
    ``group``'s all-to-all and all-gather (on the one-process engine, a stacked group,
    the stacked communicator's row moves). ``generator``: the stochastic rounding's
    generator, in a job one, on the engine a sequence of one per worker.
    """
    return scatter_gather(
        flat, bits, average, n=comm.get_world_size(group), stacked=comm.is_stacked(group),
        alltoall=lambda send, recv: comm.alltoall(send, recv, group=group),
        allgather=lambda send, recv: comm.allgather(send, recv, group=group),
        ranks=lambda: comm.group_ranks(group), stochastic=stochastic, generator=generator)


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


def within_nodes(x: torch.Tensor, leader_work, intra=None, is_leader: bool = True,
                 op=comm.ReduceOp.AVG) -> None:
    """Bagua's hierarchical pattern on ``x``, in place: reduce it within the node
    (``op`` over ``intra``), let the node leader run ``leader_work(x)``, broadcast the
    leader's ``x`` back within the node. ``intra=None`` (not hierarchical): only
    ``leader_work(x)``, where ``is_leader``. A node of one process skips its
    collectives, which would change nothing."""
    within = intra is not None and intra.nranks() > 1
    if within:
        comm.allreduce_inplace(x, op, group=intra)
    if is_leader:
        leader_work(x)
    if within:
        comm.broadcast(x, src=comm.get_node_rank() * comm.get_local_size(), group=intra)


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
    """Sum (``average=False``) or mean of the bucket over the group, in place.

    ``compression="MinMaxUInt8"`` (Bagua's low-precision op): the reduction goes
    through :func:`compressed_scatter_gather` at 8 bits, nearest rounding; with
    ``hierarchical`` the bucket is first reduced exactly within each node, the node
    leaders (local rank 0) run the compressed reduction among themselves, and each
    leader broadcasts the result within its node.
    """

    def __init__(self, hierarchical: bool, average: bool, scattergather: bool, compression: Optional[str], group):
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression must be one of {list(COMPRESSIONS)}, got {compression!r}")
        if hierarchical and not _is_whole_world(group):
            raise ValueError("hierarchical=True reduces over all workers (nodes of LOCAL_WORLD_SIZE); use the default group")
        self.hierarchical = bool(hierarchical)
        self.average = bool(average)
        self.op = comm.ReduceOp.AVG if average else comm.ReduceOp.SUM
        self.scattergather = bool(scattergather)
        self.compression = compression
        self.group = group
        # One worker: the (exact) reduction is the bucket itself, so the op does nothing.
        # Not so for the flat compressed reduction, which still quantizes (twice).
        self.local_only = comm.get_world_size(group) == 1 and (compression is None or self.hierarchical)
        if compression is not None and self.hierarchical:
            # Node groups are created collectively: here, on every rank, not on first use.
            self._intra = comm.intra_node_group()
            # (the one-process engine's workers are one node: its rows all lead it)
            leads = comm.is_stacked(group) or comm.get_local_rank() == 0
            self._leaders = comm.inter_node_group() if leads else None

    def __call__(self, bucket) -> None:
        if self.local_only:
            return
        flat = bucket.flat_view()
        if self.compression is not None:
            self._compressed(flat)
        elif self.hierarchical:
            comm.hierarchical_allreduce_inplace(flat, self.op)
        elif self.scattergather:
            self._reduce_scatter_gather(flat)
        else:
            comm.allreduce_inplace(flat, self.op, group=self.group)
        bucket.write_flat(flat)

    def _compressed(self, flat: torch.Tensor) -> None:
        x = flat if flat.dtype == torch.float32 else flat.float()
        if not self.hierarchical:
            compressed_scatter_gather(x, MINMAX_UINT8_BITS, self.average, self.group)
        else:
            def among_leaders(x):
                if self._leaders.nranks() > 1:  # (one node: the exact node average is already the result)
                    compressed_scatter_gather(x, MINMAX_UINT8_BITS, self.average, self._leaders)

            within_nodes(x, among_leaders, self._intra, self._leaders is not None, self.op)
        if x.data_ptr() != flat.data_ptr():
            flat.copy_(x)

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
    ``copy_back_peer_weight(bucket)`` writes peer_weight into the bucket. On the
    one-process engine (a stacked group) the gossip itself runs at copy_back, in place
    on every worker's weights (see ``__call__``).
    """

    def __init__(self, bucket, peer_weight, hierarchical: bool, peer_selection_mode: str, group, topology=None):
        if peer_selection_mode not in PEER_SELECTION_MODES:
            raise ValueError(
                f"peer_selection_mode must be one of {list(PEER_SELECTION_MODES)}, got {peer_selection_mode!r}"
            )
        if not torch.is_tensor(peer_weight) or _effective(peer_weight).numel() != bucket.numel * (bucket.workers or 1):
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
            if not _is_whole_world(group):
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
                self._received = {j: torch.empty_like(_effective(peer_weight)) for j in topology.neighbors(self.my_index)}
        elif peer_selection_mode == "shift_one":
            if len(self.peer_ranks) % 2:
                what = "nodes" if self.hierarchical else "workers"
                raise ValueError(f"peer_selection_mode='shift_one' needs an even number of {what}, got {len(self.peer_ranks)}")
            self._received = {"peer": torch.empty_like(_effective(peer_weight))}

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
        x = _effective(self.peer_weight)
        x.copy_(bucket.flat_view())
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
        bucket.write_flat(_effective(self.peer_weight))


def ring_peers(index: int, size: int) -> tuple:
    """(left, right) neighbours of position ``index`` on a ring of ``size``."""
    return (index - 1) % size, (index + 1) % size


def low_precision_difference(x: torch.Tensor, weight: torch.Tensor, left: Optional[torch.Tensor] = None,
                             right: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The change a low-precision decentralized worker quantizes and sends, a new tensor:

        z = (x − x̂) + ((x̂_left + x̂ + x̂_right) / 3 − x̂) = x + x̂_left / 3 + x̂_right / 3 − 5 x̂ / 3

    on the ring: the local steps since the last exchange (x − x̂, as x̂ is where they
    started) plus the ring's mixing of the copies, so x̂ + z = W x̂ − γ Σ g (Tang et al.'s
    DCD-PSGD); summed in Bagua's kernel's order (x, then x̂_left, x̂_right, x̂ with
    factors 1/3, 1/3, −5/3). z = x − x̂ for a worker without ring neighbours (one
    gossiping worker: the ring of one). Elementwise, so the rows of stacked workers
    (``[n, d]``, neighbours' rows gathered) give each worker's own z."""
    if left is None and right is None:
        return x - weight
    if left is None or right is None:
        raise ValueError("left and right go together: give both ring neighbours' copies, or neither")
    return torch.add(x, left, alpha=1 / 3).add_(right, alpha=1 / 3).add_(weight, alpha=-5 / 3)


class LowPrecisionDecentralizedSynchronousOp:
    """Bagua's low-precision decentralized SGD step on a ring, run after the optimizer
    step (Bagua's ``decentralized_low_precision_synchronous``).

    Each worker i keeps w = x̂_i, the copy of its weights its peers also hold, and
    replicas l = x̂_{i-1}, r = x̂_{i+1} of its ring neighbours' (all equal to the
    initial model). With x the weights after the local step (x_t − γ g_t):

        z   = x + l / 3 + r / 3 − 5 w / 3        ((x − w) + (l + w + r) / 3 − w: the
                                                  local steps plus the ring's mixing)
        send Q(z) to both neighbours, receive Q(z_{i-1}), Q(z_{i+1})
        w  ← w + D(Q(z)),  l ← l + D(Q(z_{i-1})),  r ← r + D(Q(z_{i+1}))
        x  ← w

    Q is the MinMaxUInt8 codec (8 bits, nearest rounding, one header for the bucket),
    D its decoding: only compressed differences travel, and every replica moves by
    exactly what its owner applied, so l and r stay equal to the neighbours' w. With
    two workers the left and right neighbour are the same one (weights 1/3 and 2/3,
    as in Bagua); with one gossiping worker z = x − w. With ``hierarchical`` the
    weights are first averaged within each node, the node leaders run the ring among
    themselves and broadcast the result within their node.

    w, l and r are ``weight``, ``left_peer_weight`` and ``right_peer_weight`` (Bagua
    tensors of the bucket's length); they are put in ``bucket.state`` so a checkpoint
    holds them.
    """

    def __init__(self, bucket, weight, left_peer_weight, right_peer_weight, hierarchical: bool,
                 compression: str, group):
        if compression != "MinMaxUInt8":
            raise ValueError(f"compression must be 'MinMaxUInt8' for the low-precision decentralized op, got {compression!r}")
        for name, t in (("weight", weight), ("left_peer_weight", left_peer_weight),
                        ("right_peer_weight", right_peer_weight)):
            if not torch.is_tensor(t) or _effective(t).numel() != bucket.numel * (bucket.workers or 1):
                raise ValueError(
                    f"{name} must be a tensor of the bucket's {bucket.numel} elements "
                    "(bucket.flattened_tensor().ensure_bagua_tensor(...) makes one), got "
                    f"{type(t).__name__ if not torch.is_tensor(t) else tuple(t.shape)}"
                )
            if not _effective(t).is_floating_point():
                raise ValueError(f"{name} must be a float tensor, got {_effective(t).dtype}")
        self.hierarchical = bool(hierarchical)
        self.compression = compression
        self.group = group
        # the one-process engine: one node whose rows all lead it; the ranks are the rows
        self.stacked = comm.is_stacked(group)
        if self.hierarchical:
            if not _is_whole_world(group):
                raise ValueError("hierarchical=True gossips between nodes of all workers; use the default group")
            self._intra = comm.intra_node_group()
            self.is_leader = self.stacked or comm.get_local_rank() == 0
            local = comm.get_local_size()
            self.peer_ranks = list(range(0, comm.get_world_size(), local))
            my_index = comm.get_node_rank()
        else:
            self._intra = None
            self.is_leader = True
            self.peer_ranks = comm.group_ranks(group)
            my_index = comm.group_rank(group)
        left, right = ring_peers(my_index, len(self.peer_ranks))  # (the rows' [n] tensors on the engine)
        if torch.is_tensor(left):
            ranks = torch.tensor(self.peer_ranks)
            self.left_rank, self.right_rank = ranks[left], ranks[right]
        else:
            self.left_rank, self.right_rank = self.peer_ranks[left], self.peer_ranks[right]
        self._me = comm.get_rank()
        self._state = bucket.state
        self._state["low_precision_weight"] = _effective(weight)
        self._state["low_precision_left_peer_weight"] = _effective(left_peer_weight)
        self._state["low_precision_right_peer_weight"] = _effective(right_peer_weight)

    def __call__(self, bucket) -> None:
        flat = bucket.flat_view()
        one_worker = (self._intra is None or self._intra.nranks() == 1) and len(self.peer_ranks) == 1
        if one_worker and flat.dtype == torch.float32:
            x = flat.detach()  # one worker: the step reads x once and ends writing x ← w
        else:
            x = flat.detach().clone() if flat.dtype == torch.float32 else flat.detach().float()
        within_nodes(x, self._ring_step, self._intra, self.is_leader)
        if x.data_ptr() != flat.data_ptr():
            with torch.no_grad():
                flat.copy_(x)
        bucket.write_flat(flat)

    # One gossiping worker on a GPU: nobody waits for its mark, so it is not read back
    # at once (that would make the host wait for the GPU every step): it is copied to
    # pinned memory and read at the next step, which raises then.
    _pending_mark = None

    def _check_pending_mark(self) -> None:
        pending, self._pending_mark = self._pending_mark, None
        if pending is not None:
            host, event, peers = pending
            event.synchronize()
            raise_if_marked([(host, "the weights")], peers)

    def _ring_step(self, x: torch.Tensor) -> None:
        w = self._state["low_precision_weight"]
        left = self._state["low_precision_left_peer_weight"]
        right = self._state["low_precision_right_peer_weight"]
        with torch.no_grad():
            z = low_precision_difference(x, w, *((left, right) if len(self.peer_ranks) > 1 else ()))
            # one encoding (one header) a worker: W = 1 in a job, the n rows on the engine
            width = z.shape[0] if self.stacked else 1
            rows = z.reshape(width, -1)
            # NaN/inf: the mark; tell the neighbours, then raise with them (see compression.scatter_gather.raise_if_marked)
            mine = minmax.encode_chunks(rows, MINMAX_UINT8_BITS, non_finite="mark")
            if self.stacked:
                mine = mine.view(width, -1)

            def decode(buf):
                return minmax.decode_chunks(buf.reshape(-1), width, bits=MINMAX_UINT8_BITS,
                                            numel=rows.shape[1]).view(z.shape)

            def marked(buf):
                return minmax.marked(buf.reshape(-1), width)

            ranks = (lambda r: r.tolist()) if self.stacked else (lambda r: [r])  # noqa: E731
            if len(self.peer_ranks) > 1:
                from_left, from_right = torch.empty_like(mine), torch.empty_like(mine)
                # Two messages to the same peer when n = 2: they pair up in posting order.
                comm.neighbor_exchange([(self.left_rank, mine), (self.right_rank, mine)],
                                       [(self.left_rank, from_left), (self.right_rank, from_right)],
                                       group=self.group)
                if self.stacked:  # (a batched encode marks every row for one bad row: named from the values)
                    bad = ~torch.isfinite(rows).all(dim=1)
                    marks = torch.cat([bad[self.left_rank], bad[self.right_rank], bad])
                else:
                    marks = torch.cat([marked(buf) for buf in (from_left, from_right, mine)])
                raise_if_marked([(marks, "the weights")],
                                ranks(self.left_rank) + ranks(self.right_rank) + ranks(self._me))
                left.add_(decode(from_left).to(left.dtype))
                right.add_(decode(from_right).to(right.dtype))
            elif z.is_cuda:
                self._check_pending_mark()
                host = torch.empty(width, dtype=torch.bool, pin_memory=True)
                host.copy_(marked(mine), non_blocking=True)
                event = torch.cuda.Event()
                event.record()
                self._pending_mark = (host, event, ranks(self._me))
            else:
                raise_if_marked([(marked(mine), "the weights")], ranks(self._me))
            w.add_(decode(mine).to(w.dtype))
            x.copy_(w)


class _WeightLock:
    """A host lock whose hand-over also orders the CUDA work of the two threads.

    The training thread queues its steps on its stream and the communication thread its
    rounds on another; holding a ``threading.Lock`` orders only when they are *queued*.
    So each release records an event on the releasing thread's current stream, and the
    next holder's stream waits for it before touching the weights: on the GPU, too, a
    round never overlaps a step (the host never blocks on the GPU for it)."""

    def __init__(self, device: torch.device):
        self._lock = threading.Lock()
        self._device = device
        self._released = None  # torch.cuda.Event of the last release (CUDA only)

    def acquire(self) -> None:
        self._lock.acquire()
        if self._released is not None:
            torch.cuda.current_stream(self._device).wait_event(self._released)

    def release(self) -> None:
        if self._device.type == "cuda":
            self._released = torch.cuda.Event()
            self._released.record(torch.cuda.current_stream(self._device))
        self._lock.release()

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


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
        # One worker: a round moves the weights by s/1 - s = 0 and reads nothing else,
        # so it only counts (and learns of an abort); nothing to lock against.
        self.local_only = comm.get_world_size(group) == 1
        self._lock = _WeightLock(bucket.device)
        self._locked = False
        self._abort_requested = False
        self._stopped = False
        self.rounds = 0

    # --- the weight lock (training thread: forward to optimizer step) -----------------
    def lock_weight(self) -> None:
        if not self._locked and not self.local_only:
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
        if self.local_only:
            self.rounds += 1
            self._stopped = self._abort_requested
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
