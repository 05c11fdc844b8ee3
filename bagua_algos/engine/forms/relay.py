"""relay (RelaySGD) on the stacked state: the recurrence of
:mod:`bagua_algos.algorithms.relay` for every directed tree edge at once.

For each tree and each (bucket, tree) coordinate slice (``coordinate_ranges``, as the
per-rank form cuts a bucket between the trees), the messages of all directed edges
i → j are one ``[E, L]`` matrix, built and summed by row gathers (``rows.py``):

    m_{i→j} = x½_i + Σ_{k∈N_i∖j} m_{k→i}      (terms in the order x½, then neighbours)
    x_i    ← (x½_i + Σ_{j∈N_i} m_{j→i}) / n̄_i                       (mode "count")
    x_i    ← (x½_i + Σ_j m_{j→i} + (n − n̄_i)·x0) / n                (mode "world_size")

with the same order of terms as the per-rank code (a worker with fewer neighbours
simply has fewer terms), so each worker's numbers round as its process's do. A message
with a relayed term is built in one pass, ``x½_i + m_{k→i}`` written straight into its
row (:meth:`~.rows.RowGather.sum_calls`), a leaf's message is a copy of x½. The two
message matrices of a slice alternate (last step's, this step's), and a slice's step
(messages, sums, division) is prepared once per slice and buffer as a list of calls on
views (:func:`~.rows.run_calls`). A chain without drops keeps its messages otherwise
(:class:`_ChainStrips`): each new message is written in place over the one it relays.

Counts c_{i→j} and n̄_i are Python floats per edge and worker, as in the per-rank form;
n̄ goes to the device as one ``[n, 1]`` tensor per tree each step they are computed.
Without drops the counts reach a fixed point (after about a tree's diameter of steps:
c_{i→j} then counts the workers behind i), and from then on they are not recomputed.
Simulated drops draw, per worker, from
``torch.Generator().manual_seed(rank_seed(seed, rank))`` in the per-rank order (tree,
then neighbour): a dropped message neither counts nor is relayed next step.
"""

from __future__ import annotations

import torch

from ...algorithms.relay import coordinate_ranges
from ...arguments import rank_seed
from ...runtime.topology import resolve_topology
from .base import StackedForm
from ...runtime.rows import RowGather, run_calls


class _TreeEdges:
    """One tree's directed edges: ``edges[e] = (i, j)``, ``edge_of[(i, j)] = e``, and
    for building messages and averages the row gathers (:class:`~.rows.RowGather`)."""

    def __init__(self, tree, n, device):
        self.tree = tree
        self.device = device
        self.neighbours = [list(tree.neighbors(i)) for i in range(n)]
        self.edges = [(i, j) for i in range(n) for j in self.neighbours[i]]
        self.edge_of = {e: k for k, e in enumerate(self.edges)}
        # message i→j: x½_i + m_{k→i} for k in N_i∖j, in neighbour order: the first
        # relayed message with x½ in one pass, a leaf's message is x½ alone, the others
        # added slot by slot
        most = max((len(nb) for nb in self.neighbours), default=0)
        self.relayed = relayed = [[self.edge_of[(k, i)] for k in self.neighbours[i] if k != j] for i, j in self.edges]
        self.first = RowGather([(i, r[0]) if r else None for (i, _), r in zip(self.edges, relayed)], device)
        self.alone = RowGather([i if not r else None for (i, _), r in zip(self.edges, relayed)], device)
        self.relay_slots = [RowGather([r[s] if s < len(r) else None for r in relayed], device)
                            for s in range(1, max(most - 1, 0))]
        # worker i's average sums m_{j→i} for j in N_i, in neighbour order
        self.incoming = [[self.edge_of[(j, i)] for j in self.neighbours[i]] for i in range(n)]
        self.in_slots = [[inc[s] if s < len(inc) else None for inc in self.incoming] for s in range(most)]
        self.in_slot_gathers = [RowGather(slot, device) for slot in self.in_slots]

    def message_calls(self, new: torch.Tensor, x: torch.Tensor, old: torch.Tensor) -> list:
        """The passes that write every message of this step into ``new`` from x½ and the
        last step's messages ``old``."""
        calls = self.first.sum_calls(new, x, old) + self.alone.copy_calls(new, x)
        for relay in self.relay_slots:
            calls += relay.add_calls(new, old)
        return calls

    def in_slot_indices(self, dropped_rows: set) -> list:
        """The messages each worker adds, slot by slot; a dropped message adds nothing."""
        if not dropped_rows:
            return self.in_slot_gathers
        return [RowGather([e if e not in dropped_rows else None for e in slot], self.device)
                for slot in self.in_slots]


def is_chain(tree, n: int) -> bool:
    """Whether worker i's neighbours are i − 1, then i + 1 (those that exist)."""
    return all(list(tree.neighbors(i)) == [j for j in (i - 1, i + 1) if 0 <= j < n] for i in range(n))


class _ChainStrips:
    """A chain's messages of one slice, built in place (drop_rate 0).

    r_i = m_{i→i+1} (i < n − 1) and l_i = m_{i→i−1} (i > 0) are n − 1 consecutive rows of
    a strip of 2(n − 1) rows each: r_i at row ``r0 + i``, l_i at ``l0 + i − 1``. The
    recurrence r_i ← x½_i + r_{i−1}, l_i ← x½_i + l_{i+1} then writes each new message
    over the one it relays, one in-place add per direction: the rightward messages' start
    moves one row up a step, the leftward ones' one row down, and x½ of the chain's first
    (last) worker takes the row freed at that end. When a start reaches its strip's edge,
    the messages are copied to the other half (once every n − 1 steps). The message
    matrix instead adds into a second buffer, a write to memory not in cache: about twice
    an in-place add's time on this CPU (docs/benchmarks.md)."""

    def __init__(self, n, width, dtype, device):
        self.n = n
        self.right = torch.zeros(2 * (n - 1), width, dtype=dtype, device=device)
        self.left = torch.zeros(2 * (n - 1), width, dtype=dtype, device=device)
        self.r0, self.l0 = n - 1, 0  # each start has n − 1 rows to move through

    def messages_(self, x: torch.Tensor) -> tuple:
        """This step's messages from x½ (``[n, L]``): returns (r_0..r_{n−2}, l_1..l_{n−1}),
        the message each worker i > 0 hears from i − 1 and each i < n − 1 from i + 1."""
        n, k = self.n, self.n - 1
        if self.r0 == 0:
            self.right[k:].copy_(self.right[:k])
            self.r0 = k
        if self.l0 == k:
            self.left[:k].copy_(self.left[k:])
            self.l0 = 0
        self.r0 -= 1
        self.l0 += 1
        r0, l0 = self.r0, self.l0
        self.right[r0 + 1:r0 + n - 1].add_(x[1:n - 1])  # old r_{i−1} + x½_i = x½_i + r_{i−1}
        self.right[r0].copy_(x[0])
        self.left[l0:l0 + n - 2].add_(x[1:n - 1])  # old l_{i+1} + x½_i
        self.left[l0 + n - 2].copy_(x[n - 1])
        return self.right[r0:r0 + k], self.left[l0:l0 + k]


class RelayForm(StackedForm):
    def __init__(self, algorithm, engine):
        super().__init__(algorithm, engine)
        if self.n == 1:
            self.trees = []
        else:
            topology = resolve_topology(algorithm.topology, self.n, require_tree=True,
                                        members="the engine's workers")
            self.trees = [_TreeEdges(t, self.n, engine.device) for t in topology.trees]
        self.mode = algorithm.mode
        self.drop_rate = algorithm.drop_rate
        self.generators = [torch.Generator().manual_seed(rank_seed(algorithm.seed, i)) for i in range(self.n)]
        self.dropped = 0
        params = engine.model.params.detach()
        self.x0 = params.clone() if self.mode == "world_size" else None
        # (bucket, tree) slices: (tree, start, end, messages, zero at the start): a chain's
        # strips without drops (_ChainStrips), else two [E, L] message matrices, of which
        # messages[parity] holds the last step's and the other receives this step's
        self.slices = []
        for bucket in engine.model.layout.buckets:
            for k, (a, b) in enumerate(coordinate_ranges(bucket.size, len(self.trees)) if self.trees else []):
                if self.drop_rate == 0.0 and is_chain(self.trees[k].tree, self.n):
                    messages = _ChainStrips(self.n, b - a, params.dtype, params.device)
                else:
                    rows = len(self.trees[k].edges)
                    messages = tuple(torch.zeros(rows, b - a, dtype=params.dtype, device=params.device)
                                     for _ in range(2))
                self.slices.append((k, bucket.start + a, bucket.start + b, messages))
        self.parity = 0
        self._prepared = {}  # (slice, parity) -> the calls of a step without drops ...
        self._prepared_for = None  # ... on the parameters at this address
        # c_{j→i} heard last step, per tree and edge: heard[k][edge_of[(j, i)]]
        self.heard = [[0.0] * len(t.edges) for t in self.trees]
        self.last_counts = [1.0] * len(self.trees)
        self._counts_fixed = False  # no drops and the counts at their fixed point
        # n̄_i per tree, and n − n̄_i for mode "world_size", as [n, 1] columns
        self.n_bar = [torch.ones(self.n, 1, dtype=params.dtype, device=params.device) for _ in self.trees]
        self.rest = [torch.full((self.n, 1), self.n - 1.0, dtype=params.dtype, device=params.device)
                     for _ in self.trees]

    def _draw_drops(self) -> set:
        """(tree, j, i): the message j → i of this step is lost (drawn by worker i)."""
        if self.drop_rate == 0.0:
            return set()
        dropped = set()
        for i in range(self.n):
            for k, tree in enumerate(self.trees):
                for j in tree.neighbours[i]:
                    if torch.rand((), generator=self.generators[i]).item() < self.drop_rate:
                        dropped.add((k, j, i))
        self.dropped += len(dropped)
        return dropped

    def _count(self) -> set:
        """This step's counts (heard, n̄) and drops; returns the dropped (tree, j, i)."""
        if self._counts_fixed:
            return set()
        # counts sent this step: c_{i→j} = 1 + Σ_{k∈N_i∖j} c_{k→i} (heard last step); lists
        # by edge index (the counts are whole numbers: every order of the sums is exact)
        sent = [[1.0 + sum(heard[e] for e in relayed) for relayed in tree.relayed]
                for tree, heard in zip(self.trees, self.heard)]
        dropped = self._draw_drops()
        for k, j, i in dropped:
            sent[k][self.trees[k].edge_of[(j, i)]] = 0.0
        heard = sent
        # without drops the next counts depend on these alone: equal twice, equal for ever
        self._counts_fixed = self.drop_rate == 0.0 and heard == self.heard
        self.heard = heard
        n_bars = [[1.0 + sum(h[e] for e in incoming) for incoming in tree.incoming]
                  for tree, h in zip(self.trees, heard)]
        for k, n_bar in enumerate(n_bars):
            column = torch.tensor(n_bar, dtype=self.n_bar[k].dtype).unsqueeze(1)
            self.n_bar[k].copy_(column)
            self.rest[k].copy_(self.n - column)
        self.last_counts = [sum(nb) / self.n for nb in n_bars]
        return dropped

    def _calls(self, params: torch.Tensor, index: int, new: torch.Tensor, old: torch.Tensor, in_gathers) -> list:
        """One step of slice ``index``: the messages into ``new``, x½ plus the messages
        heard, the division."""
        k, start, end, _ = self.slices[index]
        tree = self.trees[k]
        x = params[:, start:end]
        calls = tree.message_calls(new, x, old)
        for heard in in_gathers:  # x½ + Σ_j m_{j→i}, in place as the per-rank form
            calls += heard.add_calls(x, new)
        return calls + self._divide_calls(x, k, start, end)

    def _divide_calls(self, x: torch.Tensor, k: int, start: int, end: int) -> list:
        """x ← x / n̄ (mode "count") or (x + (n − n̄)·x0) / n (mode "world_size")."""
        if self.mode == "count":
            return [(torch.Tensor.div_, (x, self.n_bar[k]))]
        return [(torch.Tensor.addcmul_, (x, self.x0[:, start:end], self.rest[k])), (torch.Tensor.div_, (x, self.n))]

    @torch.no_grad()
    def after_step(self, step: int) -> None:
        if not self.trees:
            return
        params = self.engine.model.params.detach()
        dropped = self._count()
        for index, (k, start, end, messages) in enumerate(self.slices):
            if isinstance(messages, _ChainStrips):
                x = params[:, start:end]
                from_left, from_right = messages.messages_(x)
                x[1:].add_(from_left)  # worker i hears i − 1 first, then i + 1
                x[:-1].add_(from_right)
                run_calls(self._divide_calls(x, k, start, end))
                continue
            new, old = messages[1 - self.parity], messages[self.parity]
            drop_rows = {self.trees[k].edge_of[(j, i)] for kk, j, i in dropped if kk == k}
            if drop_rows:
                run_calls(self._calls(params, index, new, old, self.trees[k].in_slot_indices(drop_rows)))
                new[sorted(drop_rows)] = 0  # a lost message is not relayed next step either
                continue
            if self._prepared_for != params.data_ptr():  # the parameters moved (swap_params)
                self._prepared, self._prepared_for = {}, params.data_ptr()
            key = (index, self.parity)
            if key not in self._prepared:
                self._prepared[key] = self._calls(params, index, new, old, self.trees[k].in_slot_gathers)
            run_calls(self._prepared[key])
        self.parity = 1 - self.parity
