"""RelaySum's tensor math in one process: ``relay_messages`` / ``relay_average`` /
``relay_counts``, on a leading worker dimension and a slot per tree neighbour.

The distributed tests only run trees of degree <= 3 (chain, binary trees), so higher
degrees are covered here: against a direct term-by-term sum at degrees 1 to 5, with
workers of different degrees stacked (their absent slots zero), by a property test over
random degrees and sizes, and by a single-process RelaySum over user-built trees (a star
on six nodes, whose centre has five neighbours, and random trees) that must reach the
exact average after ``diameter`` steps.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from bagua_algos.algorithms import RelayAlgorithm
from bagua_algos.algorithms.relay import _Tree, relay_average, relay_counts, relay_messages
from bagua_algos.engine.relay import _StackedDelivery
from bagua_algos.runtime import comm
from bagua_algos.engine.transport import StackedGroup
from bagua_algos.runtime.topology import check_topology_arg, resolve_topology
from topologies import Topology

PROPERTY = settings(max_examples=60, deadline=None)


# ------------------------------------------------------------------------ helpers


def spread_values(size, generator, dtype=torch.float32):
    """Values over many magnitudes, so that the order of additions shows in the rounding."""
    mantissa = torch.randn(size, generator=generator, dtype=torch.float64)
    exponent = torch.randint(-6, 7, (size,), generator=generator).to(torch.float64)
    return (mantissa * 10.0 ** exponent).to(dtype)


def direct_message(x, slots, s):
    """x + Σ_{t≠s} slots[t], added term by term: x first, then the other slots in order."""
    total = x.clone()
    for t, r in enumerate(slots):
        if t != s:
            total = total + r
    return total


# ------------------------------------------------------------ relay_messages, exact


@pytest.mark.parametrize("degree", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_messages_equal_the_term_by_term_sum(degree, dtype):
    g = torch.Generator().manual_seed(100 + degree)
    size = 1000
    flat = spread_values(size + 10, g, dtype)
    x = flat[3:3 + size].view(1, size)  # a slice of the flat parameters, as in relay_step
    flat_before = flat.clone()
    received = spread_values(degree * size, g, dtype).view(1, degree, size)
    received_before = received.clone()
    out = torch.full((1, degree, size), float("nan"), dtype=dtype)
    messages = relay_messages(x, received, out)
    assert messages is out
    for s in range(degree):
        assert torch.equal(messages[0, s], direct_message(x[0], list(received[0]), s)), (degree, s)
    assert torch.equal(flat, flat_before), "x (and the flat tensor around it) must not change"
    assert torch.equal(received, received_before)
    if degree >= 3:
        # the data is order-sensitive, so the equality above checks the order: the
        # same terms added last slot first round differently somewhere
        reverse = x[0].clone()
        for t in reversed(range(1, degree)):
            reverse = reverse + received[0, t]
        assert not torch.equal(reverse, messages[0, 0])


def test_stacked_workers_of_other_degrees_each_get_their_own_messages():
    """Workers of degrees 1, 2 and 3 stacked with three slots: the absent slots hold
    zeros, which add exactly nothing, so each row's messages are its own term-by-term
    sums (the one-process engine's rows equal each process's)."""
    g = torch.Generator().manual_seed(7)
    degrees, size = [1, 3, 2], 64
    x = spread_values(3 * size, g).view(3, size)
    received = torch.zeros(3, 3, size)
    for w, d in enumerate(degrees):
        received[w, :d] = spread_values(d * size, g).view(d, size)
    messages = relay_messages(x, received, torch.empty(3, 3, size))
    for w, d in enumerate(degrees):
        own = list(received[w, :d])
        for s in range(d):
            assert torch.equal(messages[w, s], direct_message(x[w], own, s)), (w, s)


@PROPERTY
@given(degree=st.integers(1, 9), size=st.integers(1, 40), workers=st.integers(1, 4), double=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_property_messages_are_exact(degree, size, workers, double, seed):
    dtype = torch.float64 if double else torch.float32
    g = torch.Generator().manual_seed(seed)
    x = spread_values(workers * size, g, dtype).view(workers, size)
    received = spread_values(workers * degree * size, g, dtype).view(workers, degree, size)
    messages = relay_messages(x, received, torch.empty(workers, degree, size, dtype=dtype))
    for w in range(workers):
        for s in range(degree):
            assert torch.equal(messages[w, s], direct_message(x[w], list(received[w]), s))


# ------------------------------------------------------------------- relay_average


def test_relay_average_adds_in_order_and_divides_once():
    g = torch.Generator().manual_seed(1)
    x = spread_values(200, g)
    heard = [spread_values(200, g) for _ in range(5)]
    expected = x.clone()
    for m in heard:
        expected = expected + m
    expected = expected / 6.0
    out = x.clone().view(1, 200)
    relay_average(out, torch.stack(heard).unsqueeze(0), torch.tensor([6.0], dtype=torch.float64), "count", 9, None)
    assert torch.equal(out[0], expected)
    # world_size mode fills the missing models with x0
    x0 = spread_values(200, g)
    out = x.clone().view(1, 200)
    relay_average(out, torch.stack(heard[:2]).unsqueeze(0), torch.tensor([3.0], dtype=torch.float64), "world_size", 5,
                  x0.view(1, 200))
    filled = x.clone()
    for m in heard[:2]:
        filled = filled + m
    torch.testing.assert_close(out[0], (filled + 2.0 * x0) / 5.0)


def test_relay_counts_are_one_plus_what_the_other_slots_heard():
    heard = torch.tensor([[2.0, 5.0, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    assert relay_counts(heard).tolist() == [[6.0, 3.0, 8.0], [1.0, 2.0, 2.0]]


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
    """One worker's relay state over a tree, kept as RelayAlgorithmImpl keeps it (W = 1,
    a slot per neighbour)."""

    def __init__(self, rank, neighbors, size, dtype):
        self.rank = rank
        self.neighbors = list(neighbors)
        self.recv = torch.zeros(1, len(self.neighbors), size, dtype=dtype)
        self.heard_counts = torch.zeros(1, len(self.neighbors), dtype=torch.float64)
        self.x = torch.zeros(1, size, dtype=dtype)  # the parameters, x½ after the local step


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
            messages = relay_messages(node.x, node.recv, torch.empty_like(node.recv))
            counts = relay_counts(node.heard_counts)
            for s, j in enumerate(node.neighbors):
                outgoing[(node.rank, j)] = (messages[0, s], float(counts[0, s]))
        # the exchange: every message lands in the receiver's slot for its sender
        for (i, j), (message, count) in outgoing.items():
            s = nodes[j].neighbors.index(i)
            nodes[j].recv[0, s].copy_(message)
            nodes[j].heard_counts[0, s] = count
        step = []
        for node in nodes:
            n_bar = 1.0 + node.heard_counts.sum(1)
            relay_average(node.x, node.recv, n_bar, mode, n, None if x0 is None else x0.view(1, -1))
            step.append((node.x[0].clone(), float(n_bar)))
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



# ------------------------------------------------------------ the engine's delivery


def _star(n):
    class Star(Topology):
        name = "star"

        def _candidate_neighbors(self, rank):
            return list(range(1, self.world_size)) if rank == 0 else [0]

    return Star(n)


def _own_slots(shape_tree, i) -> int:
    """Worker i's number of neighbours: its process's number of slots."""
    return int(shape_tree.present[i].sum())


@pytest.mark.parametrize("tree", ["chain", "binary_tree", "double_binary_tree", "star"])
@pytest.mark.parametrize("n", [2, 5, 13, 64])
def test_the_engines_delivery_is_each_process_messages_exchanged(tree, n):
    """On the engine relay builds each message in the receive slot it arrives in
    (``_StackedDelivery``): the same bits as each worker's process building its messages
    (relay_messages over its own slots) and sending them, for every tree of a topology,
    the engine's padded slots not read (they hold values here), nothing written to a
    row's absent slots; and the counts each row receives are its neighbours'."""
    topology = _star(n) if tree == "star" else resolve_topology(tree, n, require_tree=True)
    g = torch.Generator().manual_seed(n)
    for t in topology.trees:
        shape_tree = _Tree(t, list(range(n)), list(range(n)))
        slots, neighbours = shape_tree.slots, shape_tree.neighbours.tolist()
        x = spread_values(n * 41, g).view(n, 41)
        received = spread_values(n * slots * 41, g).view(n, slots, 41)
        expected = torch.full((n, slots, 41), 7.0)
        outgoing = torch.randint(0, 50, (n, slots), generator=g).double()
        expected_counts = torch.zeros(n, slots, dtype=torch.float64)
        for j in range(n):
            own = _own_slots(shape_tree, j)
            messages = relay_messages(x[j:j + 1], received[j:j + 1, :own].clone(), torch.empty(1, own, 41))
            for q in range(own):
                i = neighbours[j][q]
                expected[i, neighbours[i].index(j)] = messages[0, q]
                expected_counts[i, neighbours[i].index(j)] = outgoing[j, q]
        delivery = _StackedDelivery(shape_tree.neighbours)
        for _ in range(2):  # the second time from the prepared plan
            by_delivery = torch.full((n, slots, 41), 7.0)
            delivery.deliver(x, received, by_delivery)
            assert torch.equal(by_delivery, expected)
        assert torch.equal(delivery.deliver_counts(outgoing), expected_counts)


@pytest.mark.parametrize("tree", ["chain", "binary_tree", "star"])
@pytest.mark.parametrize("mode", ["count", "world_size"])
def test_the_engines_average_is_each_process_average(tree, mode):
    """On the engine the average adds slot s only on the rows that have it (the others
    hold zeros, as in a run): each row as its process's relay_average over its own slots."""
    n = 13
    topology = _star(n) if tree == "star" else resolve_topology(tree, n, require_tree=True)
    shape_tree = _Tree(topology, list(range(n)), list(range(n)))
    g = torch.Generator().manual_seed(5)
    x = spread_values(n * 29, g).view(n, 29)
    received = spread_values(n * shape_tree.slots * 29, g).view(n, shape_tree.slots, 29) \
        * shape_tree.present.unsqueeze(2)
    n_bar = 1.0 + torch.randint(0, n, (n,), generator=g).double()
    x0 = spread_values(n * 29, g).view(n, 29) if mode == "world_size" else None
    expected = x.clone()
    for i in range(n):
        relay_average(expected[i:i + 1], received[i:i + 1, :_own_slots(shape_tree, i)], n_bar[i:i + 1], mode, n,
                      None if x0 is None else x0[i:i + 1])
    got = x.clone()
    _StackedDelivery(shape_tree.neighbours).average(got, received, n_bar, mode, n, x0)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("topology,kwargs,chunk_bytes", [
    ("chain", {}, None), ("chain", {}, 1), ("chain", {"mode": "world_size"}, 1), ("binary_tree", {}, None),
    ("double_binary_tree", {}, None), ("double_binary_tree", {"drop_rate": 0.3, "seed": 5}, None),
    ("chain", {"drop_rate": 0.2, "seed": 1}, None)])
def test_the_engines_step_is_the_exchange_path_on_the_same_rows(topology, kwargs, chunk_bytes, monkeypatch):
    """The engine's relay step (``_StackedDelivery``, ``_ChainStrips``, the counts
    gathered, then not recomputed once fixed) against the exchange path (relay_messages,
    comm's stacked neighbour exchange, relay_average over the padded slots) on the same
    stacked rows: the same parameters bit for bit, the same bytes counted, the same
    state, past the counts' fixed point (and a chain's with chunks of one row)."""
    from bagua_algos.algorithms.relay import ExchangeDelivery
    from bagua_algos.engine import Engine
    from bagua_algos.engine import relay as engine_relay

    if chunk_bytes is not None:
        monkeypatch.setattr(engine_relay, "CHAIN_CHUNK_BYTES", chunk_bytes)

    n, steps = 9, 23  # a chain of 9: its counts fixed by step 10, its strips back in the middle at 10 and 19
    runs = []
    for accelerated in (True, False):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 3))
        engine = Engine(net, n, RelayAlgorithm(topology=topology, **kwargs),
                        lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))
        impl = engine.runtime.bagua_algorithm
        assert [type(d).__name__ for d in impl.delivery.trees] == (
            ["_ChainStrips"] if topology == "chain" else ["_StackedDelivery"] * len(impl.delivery.trees))
        if not accelerated:  # the exchange path, as in a job, on the stacked rows
            impl.delivery = ExchangeDelivery(impl)
            for bucket in engine.runtime.bagua_buckets:
                impl.delivery.init_bucket(bucket)
        g = torch.Generator().manual_seed(3)
        sent = []
        for _ in range(steps):
            x, y = torch.randn(n, 4, 6, generator=g), torch.randint(0, 3, (n, 4), generator=g)
            comm.reset_bytes_sent()
            engine.step(x, y, torch.nn.functional.cross_entropy)
            sent.append(comm.reset_bytes_sent())
        buckets = engine.runtime.bagua_buckets
        assert getattr(impl.delivery, "counts_fixed", False) == (accelerated and not kwargs.get("drop_rate"))
        runs.append((torch.cat([b.flat_view().clone() for b in buckets], 1), sent, impl.state_dict(),
                     [{k: v.clone() for k, v in b.state["relay_received"].items()} for b in buckets]))
    (params, sent, state, received), (params_x, sent_x, state_x, received_x) = runs
    assert torch.equal(params, params_x)
    assert sent == sent_x and sent[0] > 0
    generators, generators_x = state.pop("generator"), state_x.pop("generator")
    assert state == state_x and all(map(torch.equal, generators, generators_x))
    assert all(torch.equal(a[k], b[k]) for a, b in zip(received, received_x) for k in a)
