"""RelaySGD (RelaySum for model averaging) over a tree, seed 002 Alg. 2 and 5.

After the local step x½ = x − γ·∇f_i(x) (or any optimizer), worker i sends each tree
neighbor j the relayed sum of everything it heard from its other neighbors last step,

    m_{i→j} = x½ + Σ_{k∈N_i∖j} m_{k→i},    c_{i→j} = 1 + Σ_{k∈N_i∖j} c_{k→i},

receives m_{j→i}, c_{j→i} from every neighbor and averages what reached it:

    n̄ = 1 + Σ_j c_{j→i},    x = (x½ + Σ_j m_{j→i}) / n̄              (mode "count")
    x = (x½ + Σ_j m_{j→i} + (n − n̄)·x0) / n                         (mode "world_size")

with x0 the common initial model. Messages and counts start at zero, so after as many
steps as the tree's diameter n̄ = n and every worker holds the delayed uniform average
(1/n) Σ_j x_j^{t−τ_ij+½}. On a double binary tree, each tree relays half of the
coordinates with its own messages and counts. Optimizer state stays local.

Written for a leading worker dimension W (one worker in a process; every worker a
row where one process runs several) with a slot per tree neighbour: the messages of a
(bucket, tree) slice are ``[W, D, L]`` (D the largest number of tree neighbours among
the workers; a worker with fewer has zero slots, which add exact zeros). Every
message adds its terms in the order x½, then neighbors in order, and the average adds
the received messages to x½ in place in neighbor order and divides once.

Wire format: a link carries its message and, separately, its count (a float64 on the
CPU, one per tree link and step). The messages are built in a buffer of their own and
received into a second, which becomes the state; the two swap roles every step
(:class:`ExchangeDelivery`, the impl's ``delivery``, which the one-process engine replaces
with an equal-valued form of its own: ``bagua_algos/engine/relay.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..arguments import check_choice, check_real, check_seed, rank_seed
from ..runtime import comm
from ..runtime.algorithm import Algorithm, PostOptimizerStepHook
from ..runtime.topology import NeighbourTable, check_topology_arg, resolve_topology
from .model_averaging import ModelAveragingAlgorithmImpl
from .table import AlgorithmConfig, register_algorithm

if TYPE_CHECKING:
    from ..runtime.bucket import BaguaBucket
    from ..runtime.ddp import BaguaDistributedDataParallel

__all__ = ["RelayAlgorithm", "RelayAlgorithmImpl", "ExchangeDelivery", "RELAY_MODES", "relay_messages",
           "relay_average", "relay_divide", "relay_counts", "coordinate_ranges"]

RELAY_MODES = ("count", "world_size")


# ------------------------------------------------------------------ pure tensor math
#
# Written for a leading worker dimension W (one worker in a job, every worker on the
# one-process engine) and a slot per tree neighbour: ``received[:, s]`` is the last
# message from a worker's s-th neighbour (in the tree's order), zeros where a worker has
# no s-th neighbour or its message was lost, so every worker adds its own neighbours'
# terms, in order, and an absent one adds an exact zero.


def relay_messages(x: torch.Tensor, received: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The messages m_s = x + Σ_{s'≠s} received[:, s'] to every neighbour slot s, into
    ``out`` (``[W, D, L]``; ``x`` is ``[W, L]``, ``received`` ``[W, D, L]``, neither
    overlapping ``out``). Each message adds its terms in the order x, then the other
    slots in order, so it rounds exactly as summing it term by term. Returns ``out``."""
    slots = received.shape[1]
    if slots == 3:  # a binary tree's inner node: (x + r0) serves two messages, 5 adds for 6
        r0, r1, r2 = received.unbind(1)
        torch.add(x, r1, out=out[:, 0]).add_(r2)  # (x + r1) + r2
        torch.add(x, r0, out=out[:, 1])
        torch.add(out[:, 1], r1, out=out[:, 2])  # (x + r0) + r1
        out[:, 1].add_(r2)  # (x + r0) + r2
        return out
    for s in range(slots):
        others = [t for t in range(slots) if t != s]
        if not others:
            out[:, s].copy_(x)
            continue
        message = torch.add(x, received[:, others[0]], out=out[:, s])
        for t in others[1:]:
            message.add_(received[:, t])
    return out


def relay_average(x: torch.Tensor, received: torch.Tensor, n_bar: torch.Tensor, mode: str, world_size: int,
                  x0: torch.Tensor | None) -> None:
    """x ← the relay average of x (= x½, ``[W, L]``) and the ``received`` messages
    (``[W, D, L]``, lost and absent ones zero), in place: (x + Σ m) / n̄ in mode "count",
    (x + Σ m + (n − n̄)·x0) / n in mode "world_size" (``x0`` None: zero, as for relayed
    updates). ``n_bar``: each worker's count, ``[W]`` float64."""
    for s in range(received.shape[1]):
        x.add_(received[:, s])
    relay_divide(x, n_bar, mode, world_size, x0)


def relay_divide(x: torch.Tensor, n_bar: torch.Tensor, mode: str, world_size: int, x0: torch.Tensor | None,
                 n_bar_column: torch.Tensor | None = None) -> None:
    """The average's last part, on x = x½ + Σ m: x / n̄ (mode "count"; ``n_bar_column``:
    n̄ already as ``[W, 1]`` in x's dtype, if at hand) or (x + (n − n̄)·x0) / n."""
    if mode == "count":
        if n_bar_column is None:
            n_bar_column = n_bar.to(device=x.device, dtype=x.dtype).unsqueeze(1)
        x.div_(n_bar_column)
        return
    missing = world_size - n_bar
    if x0 is not None and bool((missing != 0).any()):
        x.add_(x0 * missing.to(device=x.device, dtype=x.dtype).unsqueeze(1))
    x.div_(world_size)


def relay_counts(heard: torch.Tensor) -> torch.Tensor:
    """The counts c_s = 1 + Σ_{s'≠s} heard[:, s'] a worker sends each neighbour slot
    (``heard``: ``[W, D]`` float64, the counts received last step, zero where absent)."""
    return 1.0 + heard.sum(1, keepdim=True) - heard


def coordinate_ranges(numel: int, parts: int) -> list[tuple[int, int]]:
    """Split [0, numel) into ``parts`` contiguous ranges whose sizes differ by at most one."""
    base, extra = divmod(numel, parts)
    ranges, start = [], 0
    for k in range(parts):
        end = start + base + (1 if k < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


# ---------------------------------------------------------------------- algorithm


class _Tree:
    """One tree as this process's workers see it: each worker's neighbours in slots
    (``[W, D]`` group ranks, -1 where a worker has fewer than D), and the peer of each
    slot as ``comm`` takes it: every worker's global rank, a ``[W]`` long tensor (-1:
    none)."""

    def __init__(self, tree, rows: list, global_rank: list):
        table = NeighbourTable(tree, rows)  # the gossip's table; relay reads its slots only
        self.slots, self.neighbours = table.slots, table.neighbours
        to_global = torch.tensor(list(global_rank) + [-1], dtype=torch.long)  # (index -1: none)
        self.peers = [to_global[self.neighbours[:, s]] for s in range(self.slots)]
        self.present = self.neighbours >= 0  # [W, D]


class ExchangeDelivery:
    """How a RelaySum round's messages reach their receivers in a process: the impl's
    :attr:`RelayAlgorithmImpl.delivery`, the one part of the step a backend may replace
    with an equal-valued form of its own (the impl never asks which backend runs it).

    Each (bucket, tree) slice's messages are built with :func:`relay_messages` in a
    buffer of their own and sent to the slot peers by ``comm``'s neighbour exchange,
    into a second buffer, which becomes the state ``bucket.state["relay_received"][k]``
    (the two swap every step); the counts :func:`relay_counts` travel beside them on the
    CPU, both exchanges in flight at once; then every slice is averaged
    (:func:`relay_average`).

    A delivery answers three calls of the impl: ``init_bucket(bucket)`` (a bucket's
    slices before any message arrived: zeros, in ``bucket.state["relay_received"]``),
    ``round(buckets)`` (one round on the buckets' parameters, in place; returns n̄ per
    tree, ``[W]`` float64 each, from :meth:`RelayAlgorithmImpl.take_counts`) and
    ``counts_loaded()`` (the counts were replaced from a checkpoint)."""

    def __init__(self, impl: RelayAlgorithmImpl):
        self.impl = impl
        self._spare: dict = {}  # (bucket name, tree) → the buffer the next messages arrive in
        self._messages: dict = {}  # (bucket name, tree) → the buffer this step's messages are built in

    def init_bucket(self, bucket) -> None:
        impl, received = self.impl, bucket.state["relay_received"]
        for k, (tree, (start, end)) in enumerate(zip(impl.slot_trees, impl.ranges[bucket.name])):
            shape = (len(impl.rows), tree.slots, end - start)
            received[k] = torch.zeros(shape, dtype=bucket.dtype, device=bucket.device)
            self._spare[(bucket.name, k)] = torch.zeros(shape, dtype=bucket.dtype, device=bucket.device)
            self._messages[(bucket.name, k)] = torch.empty(shape, dtype=bucket.dtype, device=bucket.device)

    def round(self, buckets) -> list:
        impl = self.impl
        flats = [bucket.flat_view() for bucket in buckets]
        sends, recvs = [], []
        for bucket, flat in zip(buckets, flats):
            for k, tree in enumerate(impl.slot_trees):
                start, end = impl.ranges[bucket.name][k]
                messages = relay_messages(flat[:, start:end], bucket.state["relay_received"][k],
                                          self._messages[(bucket.name, k)])
                target = self._spare[(bucket.name, k)]
                for s, peer in enumerate(tree.peers):
                    sends.append((peer, messages[:, s]))
                    recvs.append((peer, target[:, s]))
        count_sends, count_recvs, incoming = [], [], []
        for tree, heard in zip(impl.slot_trees, impl.heard):
            outgoing, arriving = relay_counts(heard), torch.zeros_like(heard)
            incoming.append(arriving)
            for s, peer in enumerate(tree.peers):
                count_sends.append((peer, outgoing[:, s].contiguous()))
                count_recvs.append((peer, arriving[:, s]))
        # Messages on the model's device, counts on the CPU: two exchanges in flight at once.
        arriving_columns = [recv for _, recv in count_recvs]
        count_buffers = [torch.empty_like(t) for t in arriving_columns]
        counts = comm.start_neighbor_exchange(count_sends, [(peer, buf) for (peer, _), buf in
                                                            zip(count_recvs, count_buffers)], group=impl.process_group)
        comm.neighbor_exchange(sends, recvs, group=impl.process_group)
        counts.wait()
        for column, buf in zip(arriving_columns, count_buffers):
            column.copy_(buf)
        dropped, n_bars = impl.take_counts(incoming)
        for bucket, flat in zip(buckets, flats):
            for k in range(len(impl.slot_trees)):
                start, end = impl.ranges[bucket.name][k]
                arrived = self._arrive(bucket, k, dropped)
                relay_average(flat[:, start:end], arrived, n_bars[k], impl.mode, impl.world_size,
                              impl.x0_slice(bucket, start, end))
            bucket.write_flat(flat)
        return n_bars

    def _arrive(self, bucket, k: int, dropped) -> torch.Tensor:
        """The messages of tree k that arrived (the spare buffer), lost ones zeroed, made
        the state; last step's buffer becomes the spare. Returns them."""
        key = (bucket.name, k)
        arrived = self._spare[key]
        if bool(dropped[k].any()):  # a lost message neither counts nor is relayed next step
            arrived.masked_fill_(dropped[k].to(arrived.device).unsqueeze(2), 0)
        self._spare[key], bucket.state["relay_received"][k] = bucket.state["relay_received"][k], arrived
        return arrived

    def counts_loaded(self) -> None:
        """Nothing to forget: every round exchanges the counts afresh."""


class RelayAlgorithmImpl(ModelAveragingAlgorithmImpl):
    """Per bucket, in ``bucket.state`` (saved by ``bagua_state_dict()`` with no code of
    its own): ``relay_received`` (tree → the last messages received, ``[W, D, L]``, a
    slot per tree neighbour) and, in mode "world_size", ``relay_x0``. The rest is the
    same for every bucket and is the algorithm's ``state_dict()``: step, counts heard
    per tree link, last n̄ per tree, drops and the drop generator.

    Written once for a leading worker dimension: a job's process is one worker (W = 1);
    a process running n workers as rows runs this same impl for all of them (W = n, the
    rows' neighbours in slots, ``comm`` answering for the rows).

    Two rank spaces: the trees' nodes, and every ``j`` called a neighbor or a peer
    here, are *group ranks* (0 … world_size − 1 inside the process group, as
    ``self.rank``); ``comm``'s ``group=`` calls take *global ranks*, so a peer is
    translated by ``global_rank_of_peer[j]`` where a message is posted, and nowhere else.
    """
    WORLD_SIZE_RULE = {
        "step counter, relay step, drops counted": "carried over",
        "x0 (mode 'world_size')": "carried over (the common initial model)",
        "messages and counts per tree link, last n̄": "reset to zero (sums over the old tree's links)",
        "drop generator": "reset to rank_seed(seed, the new rank)",
        "trees": "rebuilt for the new world size",
    }
    RESET_STATE_KEYS = frozenset({"last_counts", "received_counts", "generator"})
    RESET_BUCKET_KEYS = frozenset({"relay_received"})
    relays_models = True  # what travels is x½; RelaySum/Grad relays updates (a missing one is zero)

    def __init__(self, process_group, topology, mode, drop_rate, seed):
        super().__init__(process_group)
        self.global_rank_of_peer: list[int] = comm.group_ranks(process_group)  # group rank → global rank
        self.topology = resolve_topology(topology, self.world_size, require_tree=True)
        self.trees = self.topology.trees
        self.mode = mode
        self.drop_rate = drop_rate
        self.rows = self.row_ranks  # the workers this process runs: [rank], or every one on the engine
        # the simulated drops: a generator per worker
        self.generators = [torch.Generator().manual_seed(rank_seed(seed, r)) for r in self.rows]
        self.step = 0
        self.last_counts: list = [torch.ones(len(self.rows), dtype=torch.float64) for _ in self.trees]  # n̄
        self.dropped = 0
        self.slot_trees = [_Tree(tree, self.rows, self.global_rank_of_peer) for tree in self.trees]
        # c_{j→i} heard last step, per tree: [W, D] float64 on the CPU (read on the host
        # every step, so on a GPU they travel over gloo beside the messages instead of
        # costing a device synchronisation)
        self._heard = [torch.zeros(len(self.rows), t.slots, dtype=torch.float64) for t in self.slot_trees]
        self.ranges: dict = {}  # bucket name → the coordinate range [start, end) of each tree
        self.delivery = ExchangeDelivery(self)

    @property
    def generator(self) -> torch.Generator:
        """This rank's drop generator (in a job; the first worker's on the engine)."""
        return self.generators[0]

    @property
    def heard(self) -> list:
        """Per tree, the counts c_{j→i} heard last step (``[W, D]`` float64, zero where a
        worker has no such neighbour or its message was lost): what :func:`relay_counts`
        relays next step. The list is the impl's own (:meth:`take_counts` refills it)."""
        return self._heard

    def init_operations(self, bagua_ddp: BaguaDistributedDataParallel, bucket: BaguaBucket) -> None:
        # No bucket ops: the relay runs on the training thread after the optimizer step.
        bucket.clear_ops()
        self.ranges[bucket.name] = coordinate_ranges(bucket.numel, len(self.trees))
        bucket.state["relay_received"] = {}
        self.delivery.init_bucket(bucket)
        if self.mode == "world_size" and self.relays_models:
            # with_bagua broadcast the parameters before calling us: this is the common x0.
            bucket.state["relay_x0"] = bucket.flat_view().detach().clone()

    def init_post_optimizer_step_hook(self, bagua_ddp: BaguaDistributedDataParallel) -> PostOptimizerStepHook:
        def hook(optimizer):
            self.relay_step(bagua_ddp.bagua_buckets)

        return hook

    def relay_step(self, buckets) -> None:
        """One RelaySum round on the parameters after the local step (its messages moved
        and averaged by :attr:`delivery`)."""
        if buckets:
            self.last_counts = self.delivery.round(buckets)
        self.step += 1

    def take_counts(self, incoming: list) -> tuple:
        """This step's counts from what arrived (``incoming``: per tree, c_{j→i} as
        ``[W, D]`` float64): the drops drawn, :attr:`heard` set (a lost message's count
        zero) and n̄ = 1 + Σ_j c_{j→i} per tree. Returns (dropped: ``[W, D]`` bool per
        tree, n̄: ``[W]`` float64 per tree)."""
        dropped = self._simulate_drops()  # [W, D] per tree: the messages lost this step
        n_bars = []
        for k, (tree, arriving) in enumerate(zip(self.slot_trees, incoming)):
            kept = tree.present & ~dropped[k]
            self._heard[k] = torch.where(kept, arriving, torch.zeros_like(arriving))
            n_bars.append(1.0 + self._heard[k].sum(1))
        return dropped, n_bars

    @staticmethod
    def x0_slice(bucket, start: int, end: int):
        """The common initial model's columns [start, end) of ``bucket`` (mode
        "world_size"), or None (mode "count": no x0 enters the average)."""
        return bucket.state["relay_x0"][:, start:end] if "relay_x0" in bucket.state else None

    def _simulate_drops(self) -> list:
        """Per tree, ``[W, D]`` bool: the messages of this step that are lost (each
        worker draws from its own generator, tree by tree, neighbour by neighbour)."""
        dropped = [torch.zeros(len(self.rows), t.slots, dtype=torch.bool) for t in self.slot_trees]
        if self.drop_rate == 0.0:
            return dropped
        for w, generator in enumerate(self.generators):
            for k, tree in enumerate(self.slot_trees):
                for s in range(tree.slots):
                    if tree.present[w, s] and torch.rand((), generator=generator).item() < self.drop_rate:
                        dropped[k][w, s] = True
        self.dropped += int(sum(int(d.sum()) for d in dropped))
        return dropped

    # --- checkpointing (the messages and x0 are in bucket.state) ----------------------
    def _count_keys(self) -> list:
        """(tree, worker row, slot, "k/i/j") of every tree link (i → j, group ranks)."""
        keys = []
        for k, tree in enumerate(self.slot_trees):
            for w, rank in enumerate(self.rows):
                for s in range(tree.slots):
                    j = int(tree.neighbours[w, s])
                    if j >= 0:
                        keys.append((k, w, s, f"{k}/{rank}/{j}"))
        return keys

    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "last_counts": [c.tolist() for c in self.last_counts],  # per tree, a row's each
            "dropped": self.dropped,
            "generator": [g.get_state() for g in self.generators],  # a row's each
            # last step's counts c_{j→i} (per tree/neighbor)
            "received_counts": {key: float(self._heard[k][w, s]) for k, w, s, key in self._count_keys()},
        }

    def load_state_dict(self, state: dict) -> None:
        # Loaded before the buckets' state: a checkpoint of another topology is refused
        # here, before its messages would be copied into this one's buffers.
        # A key missing is one that WORLD_SIZE_RULE resets: it keeps its set-up value.
        super().load_state_dict(state)
        self.delivery.counts_loaded()  # the loaded counts may be any step's
        if "received_counts" in state:
            keys = self._count_keys()
            saved = state["received_counts"]
            if len(self.rows) == 1 and set(saved) == {_old_job_key(key) for *_, key in keys}:
                # a job's checkpoint written before the keys named the row ("k/j")
                saved = {key: saved[_old_job_key(key)] for *_, key in keys}
            if set(saved) != {key for *_, key in keys}:
                raise ValueError("relay state does not match this model's topology")
            for k, w, s, key in keys:
                self._heard[k][w, s] = float(saved[key])
        self.step = int(state["step"])
        self.dropped = int(state["dropped"])
        if "last_counts" in state:
            self.last_counts = [torch.tensor(c if isinstance(c, list) else [c], dtype=torch.float64)
                                for c in state["last_counts"]]
        if "generator" in state:
            saved = state["generator"] if isinstance(state["generator"], list) else [state["generator"]]
            for generator, value in zip(self.generators, saved):
                generator.set_state(value)


def _old_job_key(key: str) -> str:
    """A count's key "k/i/j" as a job's checkpoint wrote it before it named the row: "k/j"."""
    k, _, j = key.split("/")
    return f"{k}/{j}"


class RelayAlgorithm(Algorithm):
    """RelaySGD over a tree topology.

    Args:
        topology: "chain", "binary_tree", "double_binary_tree" or a tree Topology.
        mode: "count" divides by the number of models received (n̄); "world_size" fills
            the models not yet received with the initial model x0 and divides by n.
        drop_rate: probability that a message is lost (simulated, for robustness studies).
        seed: seeds the simulated drops: rank r draws from a CPU generator seeded
            ``rank_seed(seed, r)`` (r its rank in the process group).
    """

    def __init__(self, topology="double_binary_tree", mode: str = "count", drop_rate: float = 0.0, seed: int = 0):
        check_topology_arg(topology, require_tree=True)
        self.topology = topology
        self.mode = check_choice("mode", mode, RELAY_MODES)
        self.drop_rate = check_real("drop_rate", drop_rate, 0.0, 1.0, high_open=True,
                                    what="a probability in [0, 1)")
        self.seed = check_seed(seed)

    def reify(self, process_group) -> RelayAlgorithmImpl:
        return RelayAlgorithmImpl(process_group, self.topology, self.mode, self.drop_rate, self.seed)


register_algorithm(
    "relay", RelayAlgorithm, "RelaySGD: relay model sums over a tree for an exact delayed average",
    rows=[
        (80, AlgorithmConfig("relay_chain", "relay", {"topology": "chain"}, replicas="drift", exact_alone=True,
                             in_sweep=True)),
        (90, AlgorithmConfig("relay_binary_tree", "relay", {"topology": "binary_tree"}, replicas="drift",
                             exact_alone=True, in_sweep=True)),
        (100, AlgorithmConfig("relay_double_binary_tree", "relay", {"topology": "double_binary_tree"},
                              replicas="drift", exact_alone=True, in_sweep=True)),
    ],
)
