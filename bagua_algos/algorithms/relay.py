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

Written for a leading worker dimension (one worker in a job, the n workers of the
one-process engine at once) with a slot per tree neighbour: the messages of a
(bucket, tree) slice are ``[W, D, L]`` (D the largest number of tree neighbours among
the workers; a worker with fewer has zero slots, which add exact zeros), so the same
functions serve a process and the engine. Every message adds its terms in the order
x½, then neighbors in order, and the average adds the received messages to x½ in
place in neighbor order and divides once.

Wire format: a link carries its message and, separately, its count (a float64 on the
CPU, one per tree link and step). The messages are built in a buffer of their own and
received into a second, which becomes the state; the two swap roles every step. On the
one-process engine every message is a row of the state already there, so each is built
straight into the receive slot it arrives in, with the same terms in the same order
(``_StackedDelivery``: no message buffer, no exchange copy; the bytes are counted as the
exchange would count them); on a chain each new message is written in place over the one
it relays (``_ChainStrips``), and the counts, a gather of the rows' own, are no longer
recomputed once fixed (no drops).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..arguments import check_choice, check_real, check_seed, rank_seed
from ..runtime import comm
from ..runtime.algorithm import Algorithm, GlobalAlgorithmRegistry, PostOptimizerStepHook
from ..runtime.comm.stacked import count_bytes, neighbor_exchange_bytes
from ..runtime.rows import RowGather, run_calls
from ..runtime.topology import NeighbourTable, check_topology_arg, resolve_topology
from .model_averaging import ModelAveragingAlgorithmImpl

if TYPE_CHECKING:
    from ..runtime.bucket import BaguaBucket
    from ..runtime.ddp import BaguaDistributedDataParallel

__all__ = ["RelayAlgorithm", "RelayAlgorithmImpl", "RELAY_MODES", "relay_messages", "relay_average", "relay_counts",
           "coordinate_ranges"]

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


class _StackedDelivery:
    """The engine's accelerator of one tree's step: every message m_{j→i} is built
    straight into the slot of the receive buffer it arrives in (row i, i's slot for j),
    from j's rows, with the terms its process adds in their order, so the engine's
    workers hold what the exchange of built messages would give them, bit for bit,
    without the message buffer, the messages no worker receives, and the exchange's
    row-gather copy. A row without a slot keeps what it holds there (zeros).

    A message of j adds x_j, then j's *own* neighbours' slots other than the receiver's,
    ascending: as :func:`relay_messages` in j's process, whose slots are j's neighbours
    (the engine's padded slots hold zeros, which j's process does not add: a leaf's
    message is a copy of x_j). Of a worker with three neighbours (slots a < b < c), as in
    :func:`relay_messages`, (x + r_a) serves two messages: m_b = (x + r_a) + r_c and
    m_c = (x + r_a) + r_b, the latter read from where m_b is being built.

    The plan, in passes over rows (each a :class:`~bagua_algos.runtime.rows.RowGather`; a
    tree's rows are a few arithmetic runs: a few strided passes each): first every
    message's first term (a copy of x_j, or x_j + its first relayed slot), then the
    messages that start from another's (x + r_a), then the remaining terms, the k-th
    term of every message in the k-th round. :meth:`average` adds each slot to x on the
    rows that have it (the others hold zeros, a term their processes never add), then
    divides. The passes are prepared once per (x, received, target) and kept: the two
    buffers swap every step, so a slice has two plans."""

    def __init__(self, neighbours: torch.Tensor):
        table, slots = neighbours.tolist(), neighbours.shape[1]
        rows = len(table)
        self.rows, self.slots = rows, slots
        present = [[t for t in range(slots) if row[t] >= 0] for row in table]

        def entry(groups, key):
            return groups.setdefault(key, [None] * rows)

        # the passes, as index lists keyed by what they read and write:
        first: dict = {}  # (receive slot s, first relayed slot t or None: a copy) → row i ← sender j
        derived: dict = {}  # (receive slot s, slot s_b of the message it starts from, slot b) → i ← (i_b, j)
        more: dict = {}  # (round k ≥ 1, receive slot s, relayed slot t) → i ← j
        for j, row in enumerate(table):
            own = present[j]
            to = {q: (row[q], table[row[q]].index(j)) for q in own}  # sender slot q → (receiver i, its slot s)
            if len(own) == 3:
                a, b, c = own
                (i_a, s_a), (i_b, s_b), (i_c, s_c) = to[a], to[b], to[c]
                entry(first, (s_a, b))[i_a] = j  # m_a = (x + r_b) + r_c
                entry(more, (1, s_a, c))[i_a] = j
                entry(first, (s_b, a))[i_b] = j  # m_b = (x + r_a) + r_c
                entry(derived, (s_c, s_b, b))[i_c] = (i_b, j)  # m_c = (x + r_a) + r_b, before m_b adds r_c
                entry(more, (1, s_b, c))[i_b] = j
                continue
            for q in own:
                i, s = to[q]
                terms = [t for t in own if t != q]
                entry(first, (s, terms[0] if terms else None))[i] = j
                for k, t in enumerate(terms[1:], 1):
                    entry(more, (k, s, t))[i] = j
        self._first = sorted(first.items(), key=lambda item: (item[0][0], -1 if item[0][1] is None else item[0][1]))
        self._derived = sorted(derived.items())
        self._more = sorted(more.items())
        # per slot, the rows that have it (None: every row), for the average
        self._present = [None if all(row[s] >= 0 for row in table) else
                         [i if row[s] >= 0 else None for i, row in enumerate(table)] for s in range(slots)]
        # the counts: c_{j→i} is sender j's outgoing[j, q], i's arriving[i, s]
        self._count_source = torch.tensor([[row[s] * slots + table[row[s]].index(i) if row[s] >= 0 else 0
                                            for s in range(slots)] for i, row in enumerate(table)],
                                          dtype=torch.long).reshape(rows, slots)
        self._count_absent = neighbours < 0
        self._gathers: dict = {}  # device → the RowGathers of the passes
        self._plans: dict = {}  # (x, received, target) → the message passes; (x, received) → the average's adds
        self._spare: dict = {}  # slice → the buffer its next messages arrive in
        self._n_bar = None  # (n̄, n̄ as a column in x's dtype) of the last step

    def new_state(self, key, shape: tuple, dtype, device) -> torch.Tensor:
        """A slice's messages before any arrived (zeros, ``[W, D, L]``: its state in
        ``bucket.state``), and the spare buffer its next messages arrive in."""
        self._spare[key] = torch.zeros(shape, dtype=dtype, device=device)
        return torch.zeros(shape, dtype=dtype, device=device)

    def step(self, key, x: torch.Tensor, received: torch.Tensor, n_bar: torch.Tensor, mode: str, world_size: int,
             x0: torch.Tensor | None, dropped: torch.Tensor | None = None) -> torch.Tensor:
        """One step of slice ``key``: the messages from x½ and the last ones (``received``,
        the state) into the spare buffer, the lost ones (``dropped``, ``[W, D]``) zeroed,
        and x ← the average. Returns the buffer they arrived in, the new state;
        ``received`` becomes the spare."""
        arrived = self._spare[key]
        self._spare[key] = received
        self.deliver(x, received, arrived)
        if dropped is not None and bool(dropped.any()):  # a lost message neither counts nor is relayed
            arrived.masked_fill_(dropped.to(arrived.device).unsqueeze(2), 0)
        self.average(x, arrived, n_bar, mode, world_size, x0)
        return arrived

    def _gathers_on(self, device) -> dict:
        key = str(device)
        if key not in self._gathers:
            self._gathers[key] = {
                "first": [(k, RowGather(index, device)) for k, index in self._first],
                "derived": [(k, RowGather(index, device)) for k, index in self._derived],
                "more": [(k, RowGather(index, device)) for k, index in self._more],
                "present": [None if rows is None else RowGather(rows, device) for rows in self._present]}
        return self._gathers[key]

    def _plan(self, key: tuple, build) -> list:
        if key not in self._plans:
            if len(self._plans) >= 64 + 4 * self.rows:  # the parameters moved: forget the old tensors' plans
                self._plans.clear()
            self._plans[key] = build()
        return self._plans[key]

    def _message_calls(self, x: torch.Tensor, received: torch.Tensor, target: torch.Tensor) -> list:
        gathers, calls = self._gathers_on(x.device), []
        for (s, t), gather in gathers["first"]:
            calls += (gather.copy_calls(target[:, s], x) if t is None else
                      gather.sum_calls(target[:, s], x, received[:, t]))
        for (s, s_b, b), gather in gathers["derived"]:
            calls += gather.sum_calls(target[:, s], target[:, s_b], received[:, b])
        for (_, s, t), gather in gathers["more"]:
            calls += gather.add_calls(target[:, s], received[:, t])
        return calls

    def _average_calls(self, x: torch.Tensor, received: torch.Tensor) -> list:
        calls = []
        for s, gather in enumerate(self._gathers_on(x.device)["present"]):
            calls += [(torch.Tensor.add_, (x, received[:, s]))] if gather is None else gather.add_calls(x, received[:, s])
        return calls

    def deliver(self, x: torch.Tensor, received: torch.Tensor, target: torch.Tensor) -> None:
        """target[i, s] ← m_{j→i}, j = i's s-th neighbour (``x`` ``[W, L]``, the buffers
        ``[W, D, L]``; target overlaps neither)."""
        run_calls(self._plan(("deliver", _identity(x), _identity(received), _identity(target)),
                             lambda: self._message_calls(x, received, target)))

    def average(self, x: torch.Tensor, received: torch.Tensor, n_bar: torch.Tensor, mode: str, world_size: int,
                x0: torch.Tensor | None) -> None:
        """:func:`relay_average` of the engine's rows: slot s added on the rows that have
        it, in slot order, then the division."""
        run_calls(self._plan(("average", _identity(x), _identity(received)), lambda: self._average_calls(x, received)))
        relay_divide(x, n_bar, mode, world_size, x0, self._column(n_bar, x))

    def _column(self, n_bar: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """n̄ as ``[W, 1]`` in x's dtype, kept while n̄ is the same tensor (the counts at
        their fixed point)."""
        kept = self._n_bar
        if kept is None or kept[0] is not n_bar or kept[1].dtype != x.dtype or kept[1].device != x.device:
            self._n_bar = kept = (n_bar, n_bar.to(device=x.device, dtype=x.dtype).unsqueeze(1))
        return kept[1]

    def deliver_counts(self, outgoing: torch.Tensor) -> torch.Tensor:
        """The counts each row receives (``[W, D]`` float64, zero where it has no
        neighbour) from every row's ``outgoing`` (:func:`relay_counts`): the exchange's
        result, a gather of the same values."""
        return outgoing.reshape(-1)[self._count_source].masked_fill_(self._count_absent, 0.0)


def _identity(t: torch.Tensor) -> tuple:
    """What a prepared pass depends on: the tensor's memory and layout."""
    return t.data_ptr(), t.shape, t.stride(), t.dtype, t.device



CHAIN_CHUNK_BYTES = 3 << 19
"""The bytes of a chunk of a chain's rows (x's and both messages'): 1.5 MiB, inside this
CPU's 2 MiB L2, so that a chunk's later passes read what its first ones brought."""


class _ChainStrips(_StackedDelivery):
    """The engine's accelerator of a chain (worker i's neighbours i − 1, then i + 1; n ≥
    3): each new message is written in place over the one it relays.

    On a chain m_{i→i+1} = r_i = x_i + r_{i−1} and m_{i→i−1} = l_i = x_i + l_{i+1}, each
    message one add over the one it relays (a + b == b + a exactly, so adding x_i into
    r_{i−1} rounds as x_i + r_{i−1}); the end workers' messages are copies of their x.
    In the state ``[W, 2, L]`` row i's slot 0 holds r_{i−1} (row 0's: l_1, its one
    neighbour's) and slot 1 holds l_{i+1} (rows 1 … n − 2; zeros on the end rows). The
    state is a view of one storage of 4n rows, each slot a run of n consecutive rows
    (slot 0 from row o0, slot 1 from row o1): a step moves slot 0 one row down (r_i takes
    the row of r_{i−1}) and slot 1 one row up (l_i takes the row of l_{i+1}), so the two
    long passes add in place, a row at each end is copied or zeroed, and no second buffer
    is written. After n steps the two runs are copied back to the middle (two passes every
    n steps). An in-place add costs about two thirds of one into another buffer on this
    CPU (docs/engine.md, "Relay on the engine, again")."""

    @staticmethod
    def fits(neighbours: torch.Tensor) -> bool:
        n = neighbours.shape[0]
        return n >= 3 and neighbours.tolist() == [[1, -1]] + [[i - 1, i + 1] for i in range(1, n - 1)] + [[n - 2, -1]]

    def __init__(self, neighbours: torch.Tensor):
        super().__init__(neighbours)
        self._strips: dict = {}  # slice → [storage, steps since the runs were in the middle, the state's view]

    def new_state(self, key, shape: tuple, dtype, device) -> torch.Tensor:
        n, _, width = shape
        storage = torch.zeros(4 * n, width, dtype=dtype, device=device)
        view = self._view(storage, 0)
        self._strips[key] = [storage, 0, view]
        return view

    def _view(self, storage: torch.Tensor, moved: int) -> torch.Tensor:
        """The state ``[n, 2, L]`` after ``moved`` steps: slot 0 from row n − moved, slot 1
        from row 2n + moved."""
        n, width = self.rows, storage.shape[1]
        o0, o1 = n - moved, 2 * n + moved
        return storage.as_strided((n, 2, width), (width, (o1 - o0) * width, 1), o0 * width)

    def step(self, key, x: torch.Tensor, received: torch.Tensor, n_bar: torch.Tensor, mode: str, world_size: int,
             x0: torch.Tensor | None, dropped: torch.Tensor | None = None) -> torch.Tensor:
        strip = self._strips[key]
        storage, moved, view = strip
        if received is not view:  # the state was replaced rather than loaded into its tensor
            view.copy_(received)
        n = self.rows
        if moved == n:  # the runs reached the storage's ends: back to the middle
            storage[n:2 * n].copy_(storage[:n])
            storage[2 * n:3 * n].copy_(storage[3 * n:])
            moved = 0
        o0, o1 = n - moved, 2 * n + moved  # this step's state: slot 0 from row o0, slot 1 from o1
        torch.add(x[1], storage[o1 + 1], out=storage[o0 - 1])  # l_1 = x_1 + l_2, to row 0's slot 0
        storage[o0].copy_(x[0])  # r_0 = x_0 (over l_1, which nobody relays)
        storage[o1 + n - 1].copy_(x[n - 1])  # l_{n−1} = x_{n−1} (over a zero)
        storage[o1 + 1].zero_()  # row 0's slot 1 (was l_2, relayed into l_1 above)
        storage[o1 + n].zero_()  # row n − 1's slot 1
        strip[1], strip[2] = moved + 1, self._view(storage, moved + 1)
        arrived = strip[2]  # slot 0 from row o0 − 1, slot 1 from o1 + 1
        if dropped is not None and bool(dropped.any()):
            storage[o0 + 1:o0 + n - 1].add_(x[1:n - 1])  # r_i = x_i + r_{i−1}, i = 1 … n − 2, in place
            storage[o1 + 2:o1 + n - 1].add_(x[2:n - 1])  # l_i = x_i + l_{i+1}, i = 2 … n − 2, in place
            arrived.masked_fill_(dropped.to(arrived.device).unsqueeze(2), 0)  # lost: neither counted nor relayed
            self.average(x, arrived, n_bar, mode, world_size, x0)
            return arrived
        # Chunk by chunk of rows, so that the average's passes find the rows in cache: the
        # messages of x's rows a … b − 1, then the average of every row whose messages are
        # all built and whose x no message still needs (row i needs r_{i−1} and l_{i+1}).
        column = self._column(n_bar, x)
        chunk = max(1, CHAIN_CHUNK_BYTES // (3 * x.shape[1] * x.element_size()))
        done = 0  # rows averaged so far
        for a in range(1, n - 1, chunk):
            b = min(a + chunk, n - 1)
            storage[o0 + a:o0 + b].add_(x[a:b])  # r_i = x_i + r_{i−1}, in place
            storage[o1 + max(a, 2):o1 + b].add_(x[max(a, 2):b])  # l_i = x_i + l_{i+1}, in place (i ≥ 2)
            end = b - 1 if b < n - 1 else n
            x[done:end].add_(storage[o0 - 1 + done:o0 - 1 + end])  # slot 0, every row
            inner = slice(max(done, 1), min(end, n - 1))
            x[inner].add_(storage[o1 + 1 + inner.start:o1 + 1 + inner.stop])  # slot 1, rows 1 … n − 2
            relay_divide(x[done:end], n_bar[done:end], mode, world_size, None if x0 is None else x0[done:end],
                         column[done:end])
            done = end
        return arrived

    def average(self, x: torch.Tensor, received: torch.Tensor, n_bar: torch.Tensor, mode: str, world_size: int,
                x0: torch.Tensor | None) -> None:
        x.add_(received[:, 0])  # every row has a slot 0
        x[1:-1].add_(received[1:-1, 1])  # the inner rows a slot 1
        relay_divide(x, n_bar, mode, world_size, x0, self._column(n_bar, x))


class RelayAlgorithmImpl(ModelAveragingAlgorithmImpl):
    """Per bucket, in ``bucket.state`` (saved by ``bagua_state_dict()`` with no code of
    its own): ``relay_received`` (tree → the last messages received, ``[W, D, L]``, a
    slot per tree neighbour) and, in mode "world_size", ``relay_x0``. The rest is the
    same for every bucket and is the algorithm's ``state_dict()``: step, counts heard
    per tree link, last n̄ per tree, drops and the drop generator.

    Written once for a leading worker dimension: a job's process is one worker (W = 1),
    the one-process engine runs this same impl for its n workers at once (W = n: the
    rows' neighbours in slots, the exchange the stacked communicator's row gather).

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
        self._trees = [_Tree(tree, self.rows, self.global_rank_of_peer) for tree in self.trees]
        # the engine: each tree's messages built where they arrive (None in a job). The
        # one branch on the backend left in an algorithm: on the engine every receiver's
        # slot is a row of the same process, so building there saves the message buffer
        # and the exchange's copy (docs/engine.md, "Relay on the engine, again")
        self._delivery = ([(_ChainStrips if _ChainStrips.fits(t.neighbours) else _StackedDelivery)(t.neighbours)
                           for t in self._trees] if comm.is_stacked(process_group) else None)
        # c_{j→i} heard last step, per tree: [W, D] float64 on the CPU (read on the host
        # every step, so on a GPU they travel over gloo beside the messages instead of
        # costing a device synchronisation)
        self._heard = [torch.zeros(len(self.rows), t.slots, dtype=torch.float64) for t in self._trees]
        self._ranges: dict = {}  # bucket name → the coordinate range of each tree
        self._spare: dict = {}  # (bucket name, tree) → the buffer the next messages arrive in
        self._messages: dict = {}  # (bucket name, tree) → the buffer this step's messages are built in
        # the engine: no drops and the counts at their fixed point (then not recomputed),
        # and the bytes a step counts, per layout
        self._counts_fixed = False
        self._bytes_key, self._step_bytes = None, 0

    @property
    def generator(self) -> torch.Generator:
        """This rank's drop generator (in a job; the first worker's on the engine)."""
        return self.generators[0]

    def init_operations(self, bagua_ddp: BaguaDistributedDataParallel, bucket: BaguaBucket) -> None:
        # No bucket ops: the relay runs on the training thread after the optimizer step.
        bucket.clear_ops()
        self._ranges[bucket.name] = coordinate_ranges(bucket.numel, len(self.trees))
        received = bucket.state["relay_received"] = {}
        for k, (tree, (start, end)) in enumerate(zip(self._trees, self._ranges[bucket.name])):
            shape = (len(self.rows), tree.slots, end - start)
            if self._delivery is not None:  # the engine builds its messages where they arrive
                received[k] = self._delivery[k].new_state((bucket.name, k), shape, bucket.dtype, bucket.device)
                continue
            received[k] = torch.zeros(shape, dtype=bucket.dtype, device=bucket.device)
            self._spare[(bucket.name, k)] = torch.zeros(shape, dtype=bucket.dtype, device=bucket.device)
            self._messages[(bucket.name, k)] = torch.empty(shape, dtype=bucket.dtype, device=bucket.device)
        if self.mode == "world_size" and self.relays_models:
            # with_bagua broadcast the parameters before calling us: this is the common x0.
            bucket.state["relay_x0"] = bucket.flat_view().detach().clone()

    def init_post_optimizer_step_hook(self, bagua_ddp: BaguaDistributedDataParallel) -> PostOptimizerStepHook:
        def hook(optimizer):
            self.relay_step(bagua_ddp.bagua_buckets)

        return hook

    def relay_step(self, buckets) -> None:
        """One RelaySum round on the parameters after the local step."""
        if not buckets:
            self.step += 1
            return
        if self._delivery is not None:
            self._stacked_step(buckets)
            return
        flats = [bucket.flat_view() for bucket in buckets]
        sends, recvs = [], []
        for bucket, flat in zip(buckets, flats):
            for k, tree in enumerate(self._trees):
                start, end = self._ranges[bucket.name][k]
                messages = relay_messages(flat[:, start:end], bucket.state["relay_received"][k],
                                          self._messages[(bucket.name, k)])
                target = self._spare[(bucket.name, k)]
                for s, peer in enumerate(tree.peers):
                    sends.append((peer, messages[:, s]))
                    recvs.append((peer, target[:, s]))
        count_sends, count_recvs, incoming = [], [], []
        for tree, heard in zip(self._trees, self._heard):
            outgoing, arriving = relay_counts(heard), torch.zeros_like(heard)
            incoming.append(arriving)
            for s, peer in enumerate(tree.peers):
                count_sends.append((peer, outgoing[:, s].contiguous()))
                count_recvs.append((peer, arriving[:, s]))
        # Messages on the model's device, counts on the CPU: two exchanges in flight at once.
        arriving_columns = [recv for _, recv in count_recvs]
        count_buffers = [torch.empty_like(t) for t in arriving_columns]
        counts = comm.start_neighbor_exchange(count_sends, [(peer, buf) for (peer, _), buf in
                                                            zip(count_recvs, count_buffers)], group=self.process_group)
        comm.neighbor_exchange(sends, recvs, group=self.process_group)
        counts.wait()
        for column, buf in zip(arriving_columns, count_buffers):
            column.copy_(buf)
        dropped, n_bars = self._take_counts(incoming)
        for bucket, flat in zip(buckets, flats):
            for k in range(len(self._trees)):
                start, end = self._ranges[bucket.name][k]
                arrived = self._arrive(bucket, k, dropped)
                relay_average(flat[:, start:end], arrived, n_bars[k], self.mode, self.world_size,
                              self._x0(bucket, start, end))
            bucket.write_flat(flat)
        self.last_counts = n_bars
        self.step += 1

    def _stacked_step(self, buckets) -> None:
        """relay_step on the one-process engine, every row a worker: the same values
        (``_StackedDelivery``), the messages built where they arrive, the counts a gather
        of the rows' counts, the same bytes counted. Without drops the counts reach a
        fixed point (after about the tree's diameter in steps: c_{i→j} then counts the
        workers behind i), from where they are not recomputed."""
        flats = [bucket.flat_view() for bucket in buckets]
        count_bytes(self._stacked_bytes(buckets, flats))
        # the counts first (they do not depend on the messages): each slice's step then
        # knows its drops and n̄, and builds, delivers and averages in one sweep
        if self._counts_fixed:
            dropped, n_bars = None, self.last_counts
        else:
            before = list(self._heard)
            dropped, n_bars = self._take_counts([delivery.deliver_counts(relay_counts(heard))
                                                 for delivery, heard in zip(self._delivery, self._heard)])
            # without drops the next counts depend on these alone: equal twice, equal for ever
            self._counts_fixed = self.drop_rate == 0.0 and all(map(torch.equal, before, self._heard))
        world_size = self.world_size
        for bucket, flat in zip(buckets, flats):
            received = bucket.state["relay_received"]
            for k, delivery in enumerate(self._delivery):
                start, end = self._ranges[bucket.name][k]
                received[k] = delivery.step((bucket.name, k), flat[:, start:end], received[k], n_bars[k], self.mode,
                                            world_size, self._x0(bucket, start, end),
                                            None if dropped is None or self.drop_rate == 0.0 else dropped[k])
            bucket.write_flat(flat)
        self.last_counts = n_bars
        self.step += 1

    def _stacked_bytes(self, buckets, flats) -> int:
        """The bytes one step's exchanges count on the engine (messages and counts), as
        comm's stacked exchange counts them; computed once per layout."""
        key = tuple((bucket.name, flat.shape[1], flat.dtype) for bucket, flat in zip(buckets, flats))
        if self._bytes_key != key:
            nbytes = 0
            for bucket, flat in zip(buckets, flats):
                for k, tree in enumerate(self._trees):
                    start, end = self._ranges[bucket.name][k]
                    nbytes += neighbor_exchange_bytes(
                        self.process_group, [(peer, flat[:, start:end]) for peer in tree.peers])
            for tree, heard in zip(self._trees, self._heard):
                nbytes += neighbor_exchange_bytes(
                    self.process_group, [(peer, heard[:, s].contiguous()) for s, peer in enumerate(tree.peers)])
            self._bytes_key, self._step_bytes = key, nbytes
        return self._step_bytes

    def _take_counts(self, incoming: list) -> tuple:
        """This step's counts: the drops drawn, c_{j→i} heard (a lost message's zero) and
        n̄ per tree. Returns (dropped: ``[W, D]`` bool per tree, n̄: ``[W]`` per tree)."""
        dropped = self._simulate_drops()  # [W, D] per tree: the messages lost this step
        n_bars = []
        for k, (tree, arriving) in enumerate(zip(self._trees, incoming)):
            kept = tree.present & ~dropped[k]
            self._heard[k] = torch.where(kept, arriving, torch.zeros_like(arriving))
            n_bars.append(1.0 + self._heard[k].sum(1))
        return dropped, n_bars

    def _arrive(self, bucket, k: int, dropped) -> torch.Tensor:
        """The messages of tree k that arrived (the spare buffer), lost ones zeroed, made
        the state; last step's buffer becomes the spare. Returns them."""
        key = (bucket.name, k)
        arrived = self._spare[key]
        if bool(dropped[k].any()):  # a lost message neither counts nor is relayed next step
            arrived.masked_fill_(dropped[k].to(arrived.device).unsqueeze(2), 0)
        self._spare[key], bucket.state["relay_received"][k] = bucket.state["relay_received"][k], arrived
        return arrived

    @staticmethod
    def _x0(bucket, start: int, end: int):
        return bucket.state["relay_x0"][:, start:end] if "relay_x0" in bucket.state else None

    def _simulate_drops(self) -> list:
        """Per tree, ``[W, D]`` bool: the messages of this step that are lost (each
        worker draws from its own generator, tree by tree, neighbour by neighbour)."""
        dropped = [torch.zeros(len(self.rows), t.slots, dtype=torch.bool) for t in self._trees]
        if self.drop_rate == 0.0:
            return dropped
        for w, generator in enumerate(self.generators):
            for k, tree in enumerate(self._trees):
                for s in range(tree.slots):
                    if tree.present[w, s] and torch.rand((), generator=generator).item() < self.drop_rate:
                        dropped[k][w, s] = True
        self.dropped += int(sum(int(d.sum()) for d in dropped))
        return dropped

    # --- checkpointing (the messages and x0 are in bucket.state) ----------------------
    def _count_keys(self) -> list:
        """(tree, worker row, slot, "k/i/j") of every tree link (i → j, group ranks)."""
        keys = []
        for k, tree in enumerate(self._trees):
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
        self._counts_fixed = False  # the loaded counts may be any step's
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


GlobalAlgorithmRegistry.register(
    "relay", RelayAlgorithm, "RelaySGD: relay model sums over a tree for an exact delayed average"
)
