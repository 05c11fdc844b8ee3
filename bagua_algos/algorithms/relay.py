"""RelaySGD (RelaySum for model averaging) over a tree, seed 002 Alg. 2 and 5.

After the local step x½ = x − γ·∇f_i(x) (or any optimizer), worker i sends each tree
neighbor j the relayed sum of everything it heard from its other neighbors last step,

    m_{i→j} = x½ + Σ_{k∈N_i∖j} m_{k→i},    c_{i→j} = 1 + Σ_{k∈N_i∖j} c_{k→i},

receives m_{j→i}, c_{j→i} from every neighbor and averages what reached it:

    n̄ = 1 + Σ_j c_{j→i},    x = (x½ + Σ_j m_{j→i}) / n̄              (mode "count")
    x = (x½ + Σ_j m_{j→i} + (n − n̄)·x0) / n                         (mode "world_size")

with x0 the common initial model. Messages and counts start at zero, so after as many
steps as the tree's diameter n̄ = n and every worker holds the delayed uniform average
(1/n) Σ_j x_j^{t−τ_ij+½}. Each message carries its count as one extra element, so a
link carries one tensor per step. On a double binary tree, each tree relays half of
the coordinates with its own messages and counts. Optimizer state stays local.
"""

from __future__ import annotations

import math

import torch

from ..runtime import comm
from ..runtime.algorithm import Algorithm, AlgorithmImpl, GlobalAlgorithmRegistry
from .topology_arg import check_topology_arg, resolve_topology

__all__ = ["RelayAlgorithm", "RelayAlgorithmImpl", "RELAY_MODES", "relay_messages", "relay_average", "coordinate_ranges"]

RELAY_MODES = ("count", "world_size")


# ------------------------------------------------------------------ pure tensor math


def relay_messages(x_ext: torch.Tensor, received: dict, out: dict) -> None:
    """out[j] ← x_ext + Σ_{k≠j} received[k] for every neighbor j (x_ext ends with count 1)."""
    for j, message in out.items():
        message.copy_(x_ext)
        for k, heard in received.items():
            if k != j:
                message.add_(heard)


def relay_average(x: torch.Tensor, received: dict, mode: str, world_size: int, x0: torch.Tensor | None) -> float:
    """x ← the relay average of x (= x½) and the received messages, in place; returns n̄."""
    if not received:
        return 1.0
    total = None
    for heard in received.values():
        total = heard.clone() if total is None else total.add_(heard)
    n_bar = 1.0 + float(total[-1])
    x.add_(total[:-1])
    if mode == "count":
        x.div_(n_bar)
    else:
        if n_bar != world_size:
            x.add_(x0, alpha=world_size - n_bar)
        x.div_(world_size)
    return n_bar


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


class _Link:
    """One (bucket, tree) slice: its coordinates and the buffers of its tree neighbors."""

    def __init__(self, start, end, neighbors, dtype, device):
        self.start, self.end = start, end
        size = end - start + 1  # the message and its count
        self.x_ext = torch.zeros(size, dtype=dtype, device=device)
        self.send = {j: torch.zeros(size, dtype=dtype, device=device) for j in neighbors}
        self.recv = {j: torch.zeros(size, dtype=dtype, device=device) for j in neighbors}


class RelayAlgorithmImpl(AlgorithmImpl):
    def __init__(self, process_group, topology, mode, drop_rate, seed):
        super().__init__(process_group)
        self.global_ranks = comm.group_ranks(process_group)
        self.n = len(self.global_ranks)
        self.me = comm.group_rank(process_group)
        self.topology = resolve_topology(topology, self.n, require_tree=True)
        self.trees = self.topology.trees
        self.mode = mode
        self.drop_rate = drop_rate
        self.generator = torch.Generator().manual_seed(seed * 1_000_003 + self.me)
        self.step = 0
        self.last_counts: list[float] = [1.0] * len(self.trees)  # n̄ of each tree, last step
        self.dropped = 0
        self._links: dict[tuple[str, int], _Link] = {}
        self._x0: dict[str, torch.Tensor] = {}

    def init_backward_hook(self, bagua_ddp):
        return lambda name, param: None

    def init_post_backward_hook(self, bagua_ddp):
        return lambda: None

    def init_operations(self, bagua_ddp, bucket):
        bucket.clear_ops()
        ranges = coordinate_ranges(bucket.numel, len(self.trees))
        for k, (tree, (start, end)) in enumerate(zip(self.trees, ranges)):
            self._links[(bucket.name, k)] = _Link(start, end, tree.neighbors(self.me), bucket.dtype, bucket.device)
        if self.mode == "world_size":
            # with_bagua broadcast the parameters before calling us: this is the common x0.
            self._x0[bucket.name] = bucket.flat_params().detach().clone()

    def init_post_optimizer_step_hook(self, bagua_ddp):
        def hook(optimizer):
            self.relay_step(bagua_ddp.buckets)

        return hook

    def relay_step(self, buckets) -> None:
        """One RelaySum round on the parameters after the local step."""
        flats = [bucket.flat_params() for bucket in buckets]
        sends, recvs = [], []
        for bucket, flat in zip(buckets, flats):
            for k in range(len(self.trees)):
                link = self._links[(bucket.name, k)]
                link.x_ext[:-1].copy_(flat[link.start:link.end])
                link.x_ext[-1] = 1
                relay_messages(link.x_ext, link.recv, link.send)
                for j in link.send:
                    sends.append((self.global_ranks[j], link.send[j]))
                    recvs.append((self.global_ranks[j], link.recv[j]))
        comm.neighbor_exchange(sends, recvs)
        dropped = self._simulate_drops()
        for bucket, flat in zip(buckets, flats):
            for k in range(len(self.trees)):
                link = self._links[(bucket.name, k)]
                received = {j: m for j, m in link.recv.items() if (k, j) not in dropped}
                x0 = self._x0[bucket.name][link.start:link.end] if self.mode == "world_size" else None
                self.last_counts[k] = relay_average(flat[link.start:link.end], received, self.mode, self.n, x0)
                for tree_index, peer in dropped:
                    if tree_index == k:
                        link.recv[peer].zero_()  # not relayed next step either
            bucket.set_params_from_flat(flat)
        self.step += 1

    def _simulate_drops(self) -> set:
        """The (tree, neighbor) links whose message of this step is lost."""
        if self.drop_rate == 0.0:
            return set()
        dropped = set()
        for k, tree in enumerate(self.trees):
            for j in tree.neighbors(self.me):
                if torch.rand((), generator=self.generator).item() < self.drop_rate:
                    dropped.add((k, j))
        self.dropped += len(dropped)
        return dropped

    # --- checkpointing -------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "last_counts": list(self.last_counts),
            "dropped": self.dropped,
            "generator": self.generator.get_state(),
            "received": {f"{b}/{k}/{j}": t.clone() for (b, k), link in self._links.items() for j, t in link.recv.items()},
            "x0": {b: t.clone() for b, t in self._x0.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        mine = self.state_dict()
        if set(state["received"]) != set(mine["received"]) or set(state["x0"]) != set(mine["x0"]):
            raise ValueError("relay state does not match this model's buckets and topology")
        for (b, k), link in self._links.items():
            for j, t in link.recv.items():
                t.copy_(state["received"][f"{b}/{k}/{j}"])
        for b, t in self._x0.items():
            t.copy_(state["x0"][b])
        self.step = int(state["step"])
        self.last_counts = list(state["last_counts"])
        self.dropped = int(state["dropped"])
        self.generator.set_state(state["generator"])


class RelayAlgorithm(Algorithm):
    """RelaySGD over a tree topology.

    Args:
        topology: "chain", "binary_tree", "double_binary_tree" or a tree Topology.
        mode: "count" divides by the number of models received (n̄); "world_size" fills
            the models not yet received with the initial model x0 and divides by n.
        drop_rate: probability that a message is lost (simulated, for robustness studies).
        seed: seeds the simulated drops.
    """

    def __init__(self, topology="double_binary_tree", mode: str = "count", drop_rate: float = 0.0, seed: int = 0):
        check_topology_arg(topology)
        if mode not in RELAY_MODES:
            raise ValueError(f"mode must be one of {list(RELAY_MODES)}, got {mode!r}")
        if not isinstance(drop_rate, (int, float)) or math.isnan(drop_rate) or not 0.0 <= drop_rate < 1.0:
            raise ValueError(f"drop_rate must be a probability in [0, 1), got {drop_rate!r}")
        self.topology = topology
        self.mode = mode
        self.drop_rate = float(drop_rate)
        self.seed = int(seed)

    def reify(self, process_group) -> RelayAlgorithmImpl:
        return RelayAlgorithmImpl(process_group, self.topology, self.mode, self.drop_rate, self.seed)


GlobalAlgorithmRegistry.register(
    "relay", RelayAlgorithm, "RelaySGD: relay model sums over a tree for an exact delayed average"
)
