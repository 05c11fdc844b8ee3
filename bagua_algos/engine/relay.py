"""Relay's form on the one-process engine: the impl's ``delivery``
(:class:`~bagua_algos.algorithms.relay.ExchangeDelivery` in a process) replaced by
:class:`StackedRelayDelivery`, which gives every worker the values the exchange would,
bit for bit, with fewer passes over memory.

On the engine every receiver's slot is a row of the same process, so each message
m_{j→i} is built straight into the receive slot it arrives in, with the terms its
sender's process adds, in their order (:class:`_StackedDelivery`: no message buffer, no
exchange copy; the bytes are counted as the exchange would count them); on a chain each
new message is written in place over the one it relays (:class:`_ChainStrips`); and the
counts, a gather of the rows' own, are no longer recomputed once fixed (no drops: the
next counts depend on these alone). docs/engine.md ("Relay on the engine, again") has
the figures.
"""

from __future__ import annotations

import torch

from ..algorithms.relay import RelayAlgorithmImpl, relay_counts, relay_divide
from ..algorithms.relaysum_grad import RelaySumGradAlgorithmImpl
from .forms import register_form
from .rows import RowGather, run_calls
from .transport import count_bytes, neighbor_exchange_bytes

__all__ = ["StackedRelayDelivery", "CHAIN_CHUNK_BYTES"]


class _StackedDelivery:
    """The engine's accelerator of one tree's step: every message m_{j→i} is built
    straight into the slot of the receive buffer it arrives in (row i, i's slot for j),
    from j's rows, with the terms its process adds in their order, so the engine's
    workers hold what the exchange of built messages would give them, bit for bit,
    without the message buffer, the messages no worker receives, and the exchange's
    row-gather copy. A row without a slot keeps what it holds there (zeros).

    A message of j adds x_j, then j's *own* neighbours' slots other than the receiver's,
    ascending: as :func:`~bagua_algos.algorithms.relay.relay_messages` in j's process, whose slots are j's neighbours
    (the engine's padded slots hold zeros, which j's process does not add: a leaf's
    message is a copy of x_j). Of a worker with three neighbours (slots a < b < c), as in
    :func:`~bagua_algos.algorithms.relay.relay_messages`, (x + r_a) serves two messages: m_b = (x + r_a) + r_c and
    m_c = (x + r_a) + r_b, the latter read from where m_b is being built.

    The plan, in passes over rows (each a ``RowGather``; a
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
        """:func:`~bagua_algos.algorithms.relay.relay_average` of the engine's rows: slot s added on the rows that have
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
        neighbour) from every row's ``outgoing`` (:func:`~bagua_algos.algorithms.relay.relay_counts`): the exchange's
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


class StackedRelayDelivery:
    """The engine's delivery of a relay round (the impl's ``delivery`` on the engine,
    installed by :func:`relay_form`): a :class:`_StackedDelivery` per tree (a chain's
    :class:`_ChainStrips`), the counts first (they do not depend on the messages), so
    that each slice then knows its drops and n̄ and builds, delivers and averages in one
    sweep; the bytes a step counts are the exchange's. Without drops the counts reach a
    fixed point (after about the tree's diameter in steps: c_{i→j} then counts the
    workers behind i), from where they are not recomputed; a checkpoint's counts
    (:meth:`counts_loaded`) may be any step's, so they are recomputed again until they
    repeat."""

    def __init__(self, impl: RelayAlgorithmImpl):
        self.impl = impl
        self.trees = [(_ChainStrips if _ChainStrips.fits(t.neighbours) else _StackedDelivery)(t.neighbours)
                      for t in impl.slot_trees]
        self.counts_fixed = False  # no drops and the counts at their fixed point
        self._bytes_key, self._step_bytes = None, 0  # the bytes a step counts, per layout

    def init_bucket(self, bucket) -> None:
        impl, received = self.impl, bucket.state["relay_received"]
        for k, (tree, (start, end)) in enumerate(zip(impl.slot_trees, impl.ranges[bucket.name])):
            shape = (len(impl.rows), tree.slots, end - start)
            received[k] = self.trees[k].new_state((bucket.name, k), shape, bucket.dtype, bucket.device)

    def round(self, buckets) -> list:
        impl = self.impl
        flats = [bucket.flat_view() for bucket in buckets]
        count_bytes(self._bytes(buckets, flats))
        if self.counts_fixed:
            dropped, n_bars = None, impl.last_counts
        else:
            heard = impl.heard
            before = list(heard)
            dropped, n_bars = impl.take_counts([delivery.deliver_counts(relay_counts(h))
                                                for delivery, h in zip(self.trees, heard)])
            # without drops the next counts depend on these alone: equal twice, equal for ever
            self.counts_fixed = impl.drop_rate == 0.0 and all(map(torch.equal, before, impl.heard))
        mode, world_size = impl.mode, impl.world_size
        no_drops = dropped is None or impl.drop_rate == 0.0
        for bucket, flat in zip(buckets, flats):
            received, ranges = bucket.state["relay_received"], impl.ranges[bucket.name]
            for k, delivery in enumerate(self.trees):
                start, end = ranges[k]
                received[k] = delivery.step((bucket.name, k), flat[:, start:end], received[k], n_bars[k], mode,
                                            world_size, impl.x0_slice(bucket, start, end),
                                            None if no_drops else dropped[k])
            bucket.write_flat(flat)
        return n_bars

    def counts_loaded(self) -> None:
        """A checkpoint's counts may be any step's: recompute them until they repeat."""
        self.counts_fixed = False

    def _bytes(self, buckets, flats) -> int:
        """The bytes one step's exchanges count on the engine (messages and counts), as
        comm's stacked exchange counts them; computed once per layout."""
        key = tuple((bucket.name, flat.shape[1], flat.dtype) for bucket, flat in zip(buckets, flats))
        if self._bytes_key != key:
            impl, nbytes = self.impl, 0
            for bucket, flat in zip(buckets, flats):
                for k, tree in enumerate(impl.slot_trees):
                    start, end = impl.ranges[bucket.name][k]
                    nbytes += neighbor_exchange_bytes(
                        impl.process_group, [(peer, flat[:, start:end]) for peer in tree.peers])
            for tree, heard in zip(impl.slot_trees, impl.heard):
                nbytes += neighbor_exchange_bytes(
                    impl.process_group, [(peer, heard[:, s].contiguous()) for s, peer in enumerate(tree.peers)])
            self._bytes_key, self._step_bytes = key, nbytes
        return self._step_bytes


@register_form(RelayAlgorithmImpl)
@register_form(RelaySumGradAlgorithmImpl)
def relay_form(impl: RelayAlgorithmImpl) -> None:
    """Relay on the engine: its rounds delivered by :class:`StackedRelayDelivery`.
    RelaySum/Grad's too: it runs relay's own round (mode "world_size", no x0) on the
    updates, between hooks of its own, so the same delivery serves it."""
    impl.delivery = StackedRelayDelivery(impl)
