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
views (:func:`~.rows.run_calls`).

Counts c_{i→j} and n̄_i are Python floats per edge and worker, as in the per-rank form;
n̄ goes to the device as one ``[n, 1]`` tensor per tree when it changes. Without drops the
counts reach a fixed point (after about a tree's diameter of steps: c_{i→j} then counts
the workers behind i), and from then on they are not recomputed. Simulated drops draw,
per worker, from ``torch.Generator().manual_seed(rank_seed(seed, rank))`` in the
per-rank order (tree, then neighbour): a dropped message neither counts nor is relayed
next step.
"""

from __future__ import annotations

import torch

from ...algorithms.relay import coordinate_ranges
from ...arguments import rank_seed
from ...runtime.topology import resolve_topology
from .base import StackedForm
from .rows import RowGather, run_calls


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
        relayed = [[self.edge_of[(k, i)] for k in self.neighbours[i] if k != j] for i, j in self.edges]
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
        # (bucket, tree) slices: (tree, start, end, two [E, L] message matrices, zero at
        # the start); messages[parity] holds the last step's, the other receives this step's
        self.slices = []
        for bucket in engine.model.layout.buckets:
            for k, (a, b) in enumerate(coordinate_ranges(bucket.size, len(self.trees)) if self.trees else []):
                rows = len(self.trees[k].edges)
                messages = tuple(torch.zeros(rows, b - a, dtype=params.dtype, device=params.device) for _ in range(2))
                self.slices.append((k, bucket.start + a, bucket.start + b, messages))
        self.parity = 0
        self._prepared = {}  # (slice, parity, params' address) -> the calls of a step without drops
        # c_{j→i} heard last step, per tree: heard[k][(j, i)]
        self.heard = [{e: 0.0 for e in t.edges} for t in self.trees]
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
        # counts sent this step: c_{i→j} = 1 + Σ_{k∈N_i∖j} c_{k→i} (heard last step)
        sent = [{(i, j): 1.0 + sum(heard[(k, i)] for k in tree.neighbours[i] if k != j) for i, j in tree.edges}
                for tree, heard in zip(self.trees, self.heard)]
        dropped = self._draw_drops()
        heard = [{(j, i): (0.0 if (k, j, i) in dropped else c) for (j, i), c in sent[k].items()}
                 for k in range(len(self.trees))]
        # without drops the next counts depend on these alone: equal twice, equal for ever
        self._counts_fixed = self.drop_rate == 0.0 and heard == self.heard
        self.heard = heard
        n_bars = [[1.0 + sum(heard[k][(j, i)] for j in tree.neighbours[i]) for i in range(self.n)]
                  for k, tree in enumerate(self.trees)]
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
        if self.mode == "count":
            calls.append((torch.Tensor.div_, (x, self.n_bar[k])))
        else:
            calls.append((torch.Tensor.addcmul_, (x, self.x0[:, start:end], self.rest[k])))
            calls.append((torch.Tensor.div_, (x, self.n)))
        return calls

    @torch.no_grad()
    def after_step(self, step: int) -> None:
        if not self.trees:
            return
        params = self.engine.model.params.detach()
        dropped = self._count()
        for index, (k, _, _, messages) in enumerate(self.slices):
            new, old = messages[1 - self.parity], messages[self.parity]
            drop_rows = {self.trees[k].edge_of[(j, i)] for kk, j, i in dropped if kk == k}
            if drop_rows:
                run_calls(self._calls(params, index, new, old, self.trees[k].in_slot_indices(drop_rows)))
                new[sorted(drop_rows)] = 0  # a lost message is not relayed next step either
                continue
            key = (index, self.parity, params.data_ptr())
            if key not in self._prepared:
                self._prepared[key] = self._calls(params, index, new, old, self.trees[k].in_slot_gathers)
            run_calls(self._prepared[key])
        self.parity = 1 - self.parity
