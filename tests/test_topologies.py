"""Tests for the pure-Python ``topologies`` package."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from topologies import (
    BinaryTreeTopology,
    ChainTopology,
    DoubleBinaryTreeTopology,
    ExponentialTopology,
    OnePeerExponentialTopology,
    FullyConnectedTopology,
    MirroredTopology,
    RingTopology,
    Topology,
    available_topologies,
    get_topology,
)

NAMES = [
    "chain",
    "binary_tree",
    "double_binary_tree",
    "ring",
    "fully_connected",
    "exponential",
    "one_peer_exponential",
]
CLASSES = [
    ChainTopology,
    BinaryTreeTopology,
    DoubleBinaryTreeTopology,
    RingTopology,
    FullyConnectedTopology,
    ExponentialTopology,
    OnePeerExponentialTopology,
]
SIZES = range(1, 34)


def spanning_tree_checks(topo):
    n = topo.world_size
    assert topo.is_tree()
    assert topo.is_connected()
    assert len(topo.edges()) == n - 1
    assert {r for e in topo.edges() for r in e} == (set(range(n)) if n > 1 else set())
    assert all(topo.degree(r) <= 3 for r in range(n))


# ------------------------------------------------------------------ registry
def test_available_topologies_lists_all_names():
    assert available_topologies() == NAMES


def test_the_tree_names_are_trees_on_every_size_and_the_others_are_not():
    trees = available_topologies(trees_only=True)
    assert trees == ["chain", "binary_tree", "double_binary_tree"]
    for name in trees:
        assert all(get_topology(name, n).is_tree() for n in SIZES), name
    for name in set(NAMES) - set(trees):
        assert not get_topology(name, 5).is_tree(), name


@pytest.mark.parametrize("name,cls", list(zip(NAMES, CLASSES)))
def test_get_topology_builds_the_named_class(name, cls):
    topo = get_topology(name, 5)
    assert type(topo) is cls
    assert topo.name == name
    assert topo.world_size == 5
    assert repr(topo) == f"{cls.__name__}(world_size=5)"


@pytest.mark.parametrize("bad", ["no_such_graph", "", None, 3])
def test_get_topology_unknown_name_lists_valid_names(bad):
    with pytest.raises(ValueError) as info:
        get_topology(bad, 4)
    message = str(info.value)
    for name in NAMES:
        assert name in message


# ---------------------------------------------------------------- validation
@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("bad", [0, -1, 2.5, True, False, "4", None])
def test_bad_world_size_rejected(cls, bad):
    with pytest.raises(ValueError, match="world_size") as info:
        cls(bad)
    assert repr(bad) in str(info.value)
    assert ">= 1" in str(info.value)


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("bad", [-1, 4, 100, 1.0, True, "0", None])
def test_bad_rank_rejected(cls, bad):
    topo = cls(4)
    for method in (topo.neighbors, topo.degree, topo.gossip_weights, topo.distances_from):
        with pytest.raises(ValueError, match="rank") as info:
            method(bad)
        assert repr(bad) in str(info.value)
        assert "[0, 4)" in str(info.value)


# ---------------------------------------------------------- graph invariants
@pytest.mark.parametrize("cls", CLASSES)
def test_graph_invariants_for_every_small_size(cls):
    for n in SIZES:
        topo = cls(n)
        nbrs = [topo.neighbors(r) for r in range(n)]
        for r in range(n):
            assert r not in nbrs[r]
            assert len(set(nbrs[r])) == len(nbrs[r])
            assert all(0 <= p < n for p in nbrs[r])
            assert topo.degree(r) == len(nbrs[r])
            for p in nbrs[r]:
                assert r in nbrs[p], (cls.name, n, r, p)
        expected_edges = sorted({(min(r, p), max(r, p)) for r in range(n) for p in nbrs[r]})
        assert topo.edges() == expected_edges
        assert all(i < j for i, j in topo.edges())
        assert sum(topo.degree(r) for r in range(n)) == 2 * len(topo.edges())
        assert topo.is_connected()


@pytest.mark.parametrize("cls", CLASSES)
def test_world_size_one_has_no_neighbors(cls):
    topo = cls(1)
    assert topo.neighbors(0) == []
    assert topo.degree(0) == 0
    assert topo.edges() == []
    assert topo.diameter() == 0
    assert topo.is_connected()
    assert topo.gossip_matrix() == [[1.0]]
    for tree in topo.trees:
        assert tree.neighbors(0) == []


@pytest.mark.parametrize("cls", CLASSES)
def test_gossip_matrix_is_symmetric_doubly_stochastic(cls):
    for n in SIZES:
        topo = cls(n)
        w = topo.gossip_matrix()
        assert len(w) == n and all(len(row) == n for row in w)
        for i in range(n):
            assert abs(sum(w[i]) - 1.0) <= 1e-12
            assert abs(sum(w[j][i] for j in range(n)) - 1.0) <= 1e-12
            for j in range(n):
                assert w[i][j] >= 0.0
                assert w[i][j] == w[j][i]
                if i != j and j not in topo.neighbors(i):
                    assert w[i][j] == 0.0
            assert w[i][i] > 0.0
            assert topo.gossip_weights(i) == {
                j: w[i][j] for j in [i] + topo.neighbors(i)
            }


def test_gossip_matrix_metropolis_hastings_values():
    # chain of 3: degrees 1, 2, 1 -> edge weight 1/3 on both edges
    w = ChainTopology(3).gossip_matrix()
    third = 1 / 3
    assert w[0] == pytest.approx([2 * third, third, 0.0], abs=1e-15)
    assert w[1] == pytest.approx([third, third, third], abs=1e-15)
    assert w[2] == pytest.approx([0.0, third, 2 * third], abs=1e-15)
    # ring of 2: a single edge, degrees 1 -> weight 1/2
    assert RingTopology(2).gossip_matrix() == [[0.5, 0.5], [0.5, 0.5]]
    # complete graph on n: uniform 1/n
    for n in (2, 5, 8):
        for row in FullyConnectedTopology(n).gossip_matrix():
            assert row == pytest.approx([1 / n] * n, abs=1e-15)


# --------------------------------------------------------------------- trees
@pytest.mark.parametrize("n", SIZES)
def test_tree_topologies_are_spanning_trees(n):
    spanning_tree_checks(ChainTopology(n))
    spanning_tree_checks(BinaryTreeTopology(n))
    double = DoubleBinaryTreeTopology(n)
    assert len(double.trees) == 2
    for tree in double.trees:
        spanning_tree_checks(tree)
    assert double.is_tree()


@settings(max_examples=40, deadline=None)
@given(n=st.integers(min_value=1, max_value=200))
def test_tree_properties_random_sizes(n):
    tree = BinaryTreeTopology(n)
    spanning_tree_checks(tree)
    for w in range(1, n):
        assert tree.neighbors(w)[0] == w // 2
    double = DoubleBinaryTreeTopology(n)
    tree_a, tree_b = double.trees
    for tree in double.trees:
        spanning_tree_checks(tree)
    for r in range(n):
        assert tree_b.neighbors(r) == [n - 1 - x for x in tree_a.neighbors(n - 1 - r)]
        assert double.neighbors(r) == sorted(set(tree_a.neighbors(r)) | set(tree_b.neighbors(r)))
    assert double.diameter() == max(tree_a.diameter(), tree_b.diameter())


def test_trees_property_defaults_to_self():
    for cls in CLASSES:
        if cls is DoubleBinaryTreeTopology:
            continue
        topo = cls(6)
        assert topo.trees == (topo,)


def test_chain_neighbors_and_diameter():
    assert [ChainTopology(4).neighbors(r) for r in range(4)] == [[1], [0, 2], [1, 3], [2]]
    for n in SIZES:
        assert ChainTopology(n).diameter() == n - 1


def test_binary_tree_neighbors_n7():
    tree = BinaryTreeTopology(7)
    assert [tree.neighbors(r) for r in range(7)] == [
        [1],
        [0, 2, 3],
        [1, 4, 5],
        [1, 6],
        [2],
        [2],
        [3],
    ]


@pytest.mark.parametrize(
    "n,diameter", [(1, 0), (2, 1), (3, 2), (4, 2), (5, 3), (7, 4), (8, 4), (9, 5), (16, 6), (17, 7)]
)
def test_binary_tree_diameter_known_values(n, diameter):
    assert BinaryTreeTopology(n).diameter() == diameter


def test_double_binary_tree_n7():
    double = DoubleBinaryTreeTopology(7)
    tree_a, tree_b = double.trees
    assert isinstance(tree_a, BinaryTreeTopology)
    assert isinstance(tree_b, MirroredTopology)
    assert tree_b.base is tree_a
    assert tree_b.name == "mirrored_binary_tree"
    assert repr(tree_b) == "MirroredTopology(BinaryTreeTopology(world_size=7))"
    assert [tree_b.neighbors(r) for r in range(7)] == [
        [3],
        [4],
        [4],
        [5, 0],
        [5, 2, 1],
        [6, 4, 3],
        [5],
    ]
    assert [double.neighbors(r) for r in range(7)] == [
        [1, 3],
        [0, 2, 3, 4],
        [1, 4, 5],
        [0, 1, 5, 6],
        [1, 2, 5],
        [2, 3, 4, 6],
        [3, 5],
    ]
    # the union has cycles, but each tree is a tree
    assert len(double.edges()) > 6
    assert double.is_tree()
    assert double.diameter() == 4


# -------------------------------------------------------------------- gossip
def test_ring_neighbors():
    assert RingTopology(2).neighbors(0) == [1]
    assert RingTopology(2).neighbors(1) == [0]
    assert RingTopology(2).edges() == [(0, 1)]
    assert RingTopology(5).neighbors(0) == [4, 1]
    assert RingTopology(5).edges() == [(0, 1), (0, 4), (1, 2), (2, 3), (3, 4)]
    for n in range(3, 34):
        ring = RingTopology(n)
        assert all(ring.degree(r) == 2 for r in range(n))
        assert ring.diameter() == n // 2
        assert not ring.is_tree()


def test_fully_connected_neighbors():
    for n in SIZES:
        topo = FullyConnectedTopology(n)
        for r in range(n):
            assert topo.neighbors(r) == [p for p in range(n) if p != r]
        assert topo.diameter() == min(1, n - 1)
        assert len(topo.edges()) == n * (n - 1) // 2


def test_exponential_neighbors():
    assert sorted(ExponentialTopology(8).neighbors(0)) == [1, 2, 4, 6, 7]
    assert sorted(ExponentialTopology(5).neighbors(0)) == [1, 2, 3, 4]
    assert ExponentialTopology(2).neighbors(0) == [1]
    for n in SIZES:
        topo = ExponentialTopology(n)
        for r in range(n):
            expected = set()
            k = 0
            while 2 ** k < n:
                expected |= {(r + 2 ** k) % n, (r - 2 ** k) % n}
                k += 1
            expected.discard(r)
            assert set(topo.neighbors(r)) == expected


# ------------------------------------------------------------------ the base
class _TwoIslands(Topology):
    name = "two_islands"

    def _candidate_neighbors(self, rank):
        return [rank ^ 1] if (rank ^ 1) < self.world_size else []


def test_disconnected_topology():
    topo = _TwoIslands(4)
    assert topo.edges() == [(0, 1), (2, 3)]
    assert not topo.is_connected()
    assert not topo.is_tree()
    assert topo.distances_from(0) == [0, 1, None, None]
    with pytest.raises(ValueError, match="disconnected"):
        topo.diameter()


def test_neighbors_returns_a_copy():
    topo = ChainTopology(3)
    topo.neighbors(1).append(99)
    assert topo.neighbors(1) == [0, 2]


def test_package_has_no_torch_or_numpy_import():
    import pathlib

    import topologies

    root = pathlib.Path(topologies.__file__).parent
    for path in root.glob("*.py"):
        source = path.read_text()
        assert "import torch" not in source and "import numpy" not in source, path


@pytest.mark.parametrize("n", SIZES)
def test_one_peer_exponential_pairs_are_shifts_covering_the_exponential_graph(n):
    """Each exchange sends every rank's message to exactly one rank and receives exactly
    one (a cyclic shift, so the mix (I + P_t)/2 is doubly stochastic and push-sum's
    weights stay 1); in_peer inverts out_peer; a period's peers are the exponential
    graph's neighbours."""
    topo = OnePeerExponentialTopology(n)
    assert topo.time_varying and not ExponentialTopology(n).time_varying
    union = {r: set() for r in range(n)}
    for step in range(2 * max(topo.period, 1)):
        outs = [topo.out_peer(r, step) for r in range(n)]
        assert sorted(outs) == list(range(n))
        for r in range(n):
            assert topo.in_peer(topo.out_peer(r, step), step) == r
            if outs[r] != r:
                union[r] |= {outs[r], topo.in_peer(r, step)}
    assert all(union[r] == set(topo.neighbors(r)) for r in range(n))
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        topo.out_peer(0, -1)
