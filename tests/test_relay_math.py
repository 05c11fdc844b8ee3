"""RelaySum's tensor math in one process: ``relay_messages`` / ``relay_average``.

The distributed tests only run trees of degree <= 3 (chain, binary trees), so the
general path of ``relay_messages`` (four or more neighbours, messages built in the
spare buffers) is covered here: against a direct term-by-term sum at degrees 1 to 5,
for the buffer contract the algorithm relies on, by a property test over random
degrees and sizes, and by a single-process RelaySum over user-built trees (a star on
six nodes, whose centre has five neighbours, and random trees) that must reach the
exact average after ``diameter`` steps.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from bagua_algos.algorithms import RelayAlgorithm
from bagua_algos.algorithms.relay import relay_average, relay_messages
from bagua_algos.runtime.topology import check_topology_arg, resolve_topology
from topologies import Topology

PROPERTY = settings(max_examples=60, deadline=None)


# ------------------------------------------------------------------------ helpers


def spread_values(size, generator, dtype=torch.float32):
    """Values over many magnitudes, so that the order of additions shows in the rounding."""
    mantissa = torch.randn(size, generator=generator, dtype=torch.float64)
    exponent = torch.randint(-6, 7, (size,), generator=generator).to(torch.float64)
    return (mantissa * 10.0 ** exponent).to(dtype)


def direct_message(x, received, j):
    """x + Σ_{k≠j} received[k], added term by term: x first, then neighbours in order."""
    total = x.clone()
    for k, r in received.items():
        if k != j:
            total = total + r
    return total


def byte_range(t):
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def overlap(a, b):
    (a0, a1), (b0, b1) = byte_range(a), byte_range(b)
    return a0 < b1 and b0 < a1


def make_buffers(neighbors, size, generator, dtype=torch.float32):
    """Like the algorithm's per-link state: a receive buffer per neighbour and, with two
    or more neighbours, a second (spare) buffer per neighbour."""
    received = {j: spread_values(size, generator, dtype) for j in neighbors}
    spare = {}
    if len(neighbors) > 1:
        spare = {j: torch.full((size,), float("nan"), dtype=dtype) for j in neighbors}
    return received, spare


def next_spare(received, spare, targets):
    """What the algorithm keeps as each neighbour's spare: of its two buffers, the one
    not received into next."""
    if not spare:
        return {}
    return {j: spare[j] if targets[j] is received[j] else received[j] for j in received}


def check_buffer_contract(x, received, spare, messages, targets):
    """The properties RelayAlgorithmImpl.relay_step relies on."""
    neighbors = list(received)
    assert set(messages) == set(neighbors) and set(targets) == set(neighbors)
    pool = [*received.values(), *spare.values()]

    # no buffer is allocated: every message is x (one neighbour) or a buffer of the pool
    for j, m in messages.items():
        if len(neighbors) == 1:
            assert m is x, "with one neighbour the message is x itself"
        else:
            assert any(m is b for b in pool), f"message to {j} is a new tensor"
            assert not overlap(m, x)
    # messages in flight are distinct tensors
    sent = list(messages.values())
    for a in range(len(sent)):
        for b in range(a + 1, len(sent)):
            assert not overlap(sent[a], sent[b]), "two messages share memory"
    # each neighbour's next message arrives in one of its own two buffers (the caller
    # swaps the pair by identity), and no target aliases a message being sent or x
    for j in neighbors:
        assert targets[j] is received[j] or (spare and targets[j] is spare[j]), j
        for m in sent:
            assert not overlap(targets[j], m), f"receive target of {j} aliases a message being sent"
        assert not overlap(targets[j], x)
    # targets and next spares: all distinct, together exactly the pool
    spares = next_spare(received, spare, targets)
    kept = [*targets.values(), *spares.values()]
    for a in range(len(kept)):
        for b in range(a + 1, len(kept)):
            assert kept[a] is not kept[b] and not overlap(kept[a], kept[b])
    assert len(kept) == len(pool) and all(any(k is b for b in pool) for k in kept)
    return spares


# ------------------------------------------------------------ relay_messages, exact


@pytest.mark.parametrize("degree", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_messages_equal_the_term_by_term_sum(degree, dtype):
    g = torch.Generator().manual_seed(100 + degree)
    size = 1000
    neighbors = [7, 2, 11, 5, 0][:degree]  # not sorted: "in order" means dict order
    flat = spread_values(size + 10, g, dtype)
    x = flat[3:3 + size]  # a slice of the flat parameters, as in relay_step
    flat_before = flat.clone()
    received, spare = make_buffers(neighbors, size, g, dtype)
    originals = {j: r.clone() for j, r in received.items()}  # relay_messages may overwrite them
    expected = {j: direct_message(x, originals, j) for j in neighbors}

    messages, targets = relay_messages(x, dict(received), dict(spare))

    assert set(messages) == set(neighbors)
    for j in neighbors:
        assert torch.equal(messages[j], expected[j]), (degree, j)
    assert torch.equal(flat, flat_before), "x (and the flat tensor around it) must not change"
    check_buffer_contract(x, received, spare, messages, targets)

    if degree >= 3:
        # the data is order-sensitive, so the equality above checks the order: the
        # same terms added neighbours-last-first round differently somewhere
        j = neighbors[0]
        reverse = x.clone()
        for k in reversed(neighbors):
            if k != j:
                reverse = reverse + originals[k]
        assert not torch.equal(reverse, expected[j])


@pytest.mark.parametrize("degree", [4, 5, 8])
def test_general_path_builds_messages_in_the_spares_and_keeps_the_received(degree):
    """With four or more neighbours the received buffers stay intact and become the next
    targets; the messages are the spare buffers."""
    g = torch.Generator().manual_seed(degree)
    neighbors = list(range(degree))
    x = spread_values(33, g)
    received, spare = make_buffers(neighbors, 33, g)
    originals = {j: r.clone() for j, r in received.items()}
    messages, targets = relay_messages(x, received, spare)
    for j in neighbors:
        assert messages[j] is spare[j]
        assert targets[j] is received[j]
        assert torch.equal(received[j], originals[j])
    assert next_spare(received, spare, targets) == spare


def test_consecutive_steps_with_swapped_buffers():
    """Several rounds on one node, swapping the buffers as relay_step does and receiving
    new messages into the targets: every round's messages stay exact."""
    g = torch.Generator().manual_seed(5)
    for degree in range(1, 7):
        neighbors = list(range(10, 10 + degree))
        size = 50
        received, spare = make_buffers(neighbors, size, g)
        for _ in range(5):
            x = spread_values(size, g)
            originals = {j: r.clone() for j, r in received.items()}
            messages, targets = relay_messages(x, received, spare)
            for j in neighbors:
                assert torch.equal(messages[j], direct_message(x, originals, j)), degree
            spare = check_buffer_contract(x, received, spare, messages, targets)
            received = targets
            for t in received.values():  # the neighbours' next messages arrive
                t.copy_(spread_values(size, g))


@PROPERTY
@given(
    neighbors=st.lists(st.integers(0, 63), min_size=1, max_size=9, unique=True),
    size=st.integers(1, 40),
    offset=st.integers(0, 5),
    double=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_messages_are_exact_and_buffers_disjoint(neighbors, size, offset, double, seed):
    dtype = torch.float64 if double else torch.float32
    g = torch.Generator().manual_seed(seed)
    flat = spread_values(size + offset + 3, g, dtype)
    x = flat[offset:offset + size]
    flat_before = flat.clone()
    received, spare = make_buffers(neighbors, size, g, dtype)
    originals = {j: r.clone() for j, r in received.items()}
    messages, targets = relay_messages(x, received, spare)
    assert set(messages) == set(neighbors)
    for j in neighbors:
        assert torch.equal(messages[j], direct_message(x, originals, j))
    assert torch.equal(flat, flat_before)
    check_buffer_contract(x, received, spare, messages, targets)


# ------------------------------------------------------------------- relay_average


def test_relay_average_adds_in_order_and_divides_once():
    g = torch.Generator().manual_seed(1)
    x = spread_values(200, g)
    heard = [spread_values(200, g) for _ in range(5)]
    expected = x.clone()
    for m in heard:
        expected = expected + m
    expected = expected / 6.0
    out = x.clone()
    relay_average(out, heard, 6.0, "count", 9, None)
    assert torch.equal(out, expected)
    # world_size mode fills the missing models with x0
    x0 = spread_values(200, g)
    out = x.clone()
    relay_average(out, heard[:2], 3.0, "world_size", 5, x0)
    filled = x.clone()
    for m in heard[:2]:
        filled = filled + m
    torch.testing.assert_close(out, (filled + 2.0 * x0) / 5.0)


# ------------------------------------------------------------ user-built topologies


class StarTopology(Topology):
    """Rank 0 is the centre, every other rank a leaf."""

    name = "star"

    def _candidate_neighbors(self, rank):
        return list(range(1, self.world_size)) if rank == 0 else [0]


class ParentTree(Topology):
    """Any tree, given by ``parent[r] < r`` for every rank r > 0."""

    name = "parent_tree"

    def __init__(self, parents):
        super().__init__(len(parents) + 1)
        self.parents = list(parents)

    def _candidate_neighbors(self, rank):
        up = [self.parents[rank - 1]] if rank > 0 else []
        return up + [child for child in range(1, self.world_size) if self.parents[child - 1] == rank]


class StarPlusEdge(StarTopology):
    name = "star_plus_edge"

    def _candidate_neighbors(self, rank):
        extra = {1: [2], 2: [1]}.get(rank, [])
        return super()._candidate_neighbors(rank) + extra


def test_a_star_built_by_the_user_is_an_accepted_tree():
    star = StarTopology(6)
    assert star.neighbors(0) == [1, 2, 3, 4, 5]
    assert all(star.neighbors(r) == [0] for r in range(1, 6))
    assert star.degree(0) == 5
    assert star.edges() == [(0, r) for r in range(1, 6)]
    assert star.is_tree() and star.diameter() == 2 and star.trees == (star,)
    check_topology_arg(star)
    assert resolve_topology(star, 6, require_tree=True) is star
    assert RelayAlgorithm(topology=star).topology is star
    with pytest.raises(ValueError, match="6 ranks but the process group has 4"):
        resolve_topology(star, 4, require_tree=True)
    with pytest.raises(ValueError, match="not a tree"):
        resolve_topology(StarPlusEdge(6), 6, require_tree=True)


def test_relay_refuses_a_topology_that_is_not_a_tree_when_constructed():
    trees = "one of ['chain', 'binary_tree', 'double_binary_tree'], or a Topology whose is_tree() is True"
    with pytest.raises(ValueError) as typo:
        RelayAlgorithm(topology="double_binary_tre")
    assert str(typo.value) == "unknown topology 'double_binary_tre'; valid names: ['chain', 'binary_tree', 'double_binary_tree']"
    with pytest.raises(ValueError) as ring:
        RelayAlgorithm(topology="ring")  # a name of a gossip topology: a tree on two ranks at most
    assert str(ring.value) == f"topology 'ring' is not a tree; RelaySGD needs a tree: {trees}"
    with pytest.raises(ValueError) as own:
        RelayAlgorithm(topology=StarPlusEdge(6))
    assert str(own.value) == f"topology StarPlusEdge(world_size=6) is not a tree; RelaySGD needs a tree: {trees}"
    with pytest.raises(TypeError, match=r"topology must be a Topology or one of \['chain', 'binary_tree', 'double_binary_tree'\]"):
        RelayAlgorithm(topology=3)


# ------------------------------------------------- single-process RelaySum on a tree


class Node:
    """One worker's relay state over a tree, kept as RelayAlgorithmImpl keeps it."""

    def __init__(self, rank, neighbors, size, dtype):
        self.rank = rank
        self.neighbors = list(neighbors)
        self.recv = {j: torch.zeros(size, dtype=dtype) for j in self.neighbors}
        self.spare = {}
        if len(self.neighbors) > 1:
            self.spare = {j: torch.zeros(size, dtype=dtype) for j in self.neighbors}
        self.heard_counts = {j: 0.0 for j in self.neighbors}
        self.x = torch.zeros(size, dtype=dtype)  # the parameters, x½ after the local step


def simulate_constant_models(topology, models, steps, mode="count", x0=None):
    """RelaySum where worker i's local step always yields ``models[i]``; returns each
    step's averaged model of every worker and its count n̄."""
    n = topology.world_size
    size, dtype = models[0].numel(), models[0].dtype
    nodes = [Node(i, topology.neighbors(i), size, dtype) for i in range(n)]
    history = []
    for _ in range(steps):
        outgoing = {}  # (i, j) -> (message, count)
        for node in nodes:
            node.x.copy_(models[node.rank])
            messages, targets = relay_messages(node.x, node.recv, node.spare)
            spares = check_buffer_contract(node.x, node.recv, node.spare, messages, targets)
            node.spare, node.recv = spares, targets
            for j in node.neighbors:
                count = 1.0 + sum(c for k, c in node.heard_counts.items() if k != j)
                outgoing[(node.rank, j)] = (messages[j], count)
        # the exchange: every message lands in the receiver's target for its sender
        for (i, j), (message, count) in outgoing.items():
            nodes[j].recv[i].copy_(message)
            nodes[j].heard_counts[i] = count
        step = []
        for node in nodes:
            n_bar = 1.0 + sum(node.heard_counts.values())
            relay_average(node.x, [node.recv[j] for j in node.neighbors], n_bar, mode, n, x0)
            step.append((node.x.clone(), n_bar))
        history.append(step)
    return history


def integer_models(n, size, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    # integers: every partial sum is exact, so every worker's sum is the same number
    return [torch.randint(-1000, 1001, (size,), generator=g).to(dtype) for _ in range(n)]


@pytest.mark.parametrize("mode", ["count", "world_size"])
def test_relaysum_on_a_star_gives_the_exact_average_after_diameter_steps(mode):
    star = StarTopology(6)
    diameter = star.diameter()
    models = integer_models(6, 17, seed=3)
    mean = torch.stack(models).sum(0) / 6
    x0 = torch.zeros(17)
    history = simulate_constant_models(star, models, diameter + 3, mode, x0)
    # before: the leaves have only heard from the centre
    first = history[0]
    assert first[0][1] == 6.0 and all(first[leaf][1] == 2.0 for leaf in range(1, 6))
    assert torch.equal(first[0][0], mean)  # the centre hears everyone at once
    for leaf in range(1, 6):
        expected = (models[leaf] + models[0]) / 2 if mode == "count" else (models[leaf] + models[0]) / 6
        assert torch.equal(first[leaf][0], expected)
        assert not torch.equal(first[leaf][0], mean)
    # from step `diameter` on: everyone holds exactly the mean, having heard all six
    for step in history[diameter - 1:]:
        for x, n_bar in step:
            assert n_bar == 6.0
            assert torch.equal(x, mean)


@PROPERTY
@example(parents=(0, 0, 0, 0, 0), seed=1)  # star: centre of degree 5
@example(parents=(0, 0, 0, 0, 1, 1, 1, 1), seed=2)  # degrees 4 and 5, diameter 3
@example(parents=(0, 1, 2, 3), seed=3)  # chain
@given(
    parents=st.integers(1, 9).flatmap(
        lambda m: st.tuples(*[st.integers(0, r) for r in range(m)])),
    seed=st.integers(0, 1000),
)
def test_relaysum_on_random_trees_gives_the_exact_average(parents, seed):
    tree = ParentTree(parents)
    n = tree.world_size
    assert tree.is_tree()
    assert resolve_topology(tree, n, require_tree=True) is tree
    diameter = tree.diameter()
    models = integer_models(n, 5, seed)
    mean = torch.stack(models).sum(0) / n
    history = simulate_constant_models(tree, models, diameter + 1)
    if diameter >= 2:
        # one step earlier, the two ends of a longest path have not heard each other
        assert min(n_bar for _, n_bar in history[diameter - 2]) < n
    for step in history[diameter - 1:]:
        for x, n_bar in step:
            assert n_bar == n
            assert torch.equal(x, mean)

