"""engine/forms/rows.py: a row gather as strided slices must add (and copy, and sum two
sources) exactly what a row-by-row loop does, for any index, and find few runs in the
usual topologies; the gossip's and relay's prepared steps are held to the plain formula
(and to the gloo processes by test_engine_equality.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from bagua_algos.algorithms import RelayAlgorithm
from bagua_algos.engine import Engine
from bagua_algos.runtime.gossip import NeighbourMix
from bagua_algos.engine.forms.relay import _TreeEdges
from bagua_algos.runtime.rows import MAX_RUNS, RowGather, arithmetic_runs
from bagua_algos.runtime.topology import resolve_topology


def _loop(out, src, index, weight=None, copy=False):
    out = out.clone()
    for r, i in enumerate(index):
        if i is None:
            continue
        if copy:
            out[r] = src[i]
        elif weight is None:
            out[r] += src[i]
        else:
            out[r:r + 1].addcmul_(src[i:i + 1], weight[r:r + 1])
    return out


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 40), st.integers(1, 40), st.data())
def test_a_gather_equals_the_row_by_row_loop(rows, sources, data):
    index = data.draw(st.lists(st.one_of(st.none(), st.integers(0, sources - 1)), min_size=rows, max_size=rows))
    g = torch.Generator().manual_seed(rows * 100 + sources)
    src, out, weight = torch.randn(sources, 5, generator=g), torch.randn(rows, 5, generator=g), torch.randn(rows, 1, generator=g)
    gather = RowGather(index, "cpu")
    assert torch.equal(gather.add_(out.clone(), src), _loop(out, src, index))
    assert torch.equal(gather.add_(out.clone(), src, weight), _loop(out, src, index, weight))
    assert torch.equal(gather.copy_(out.clone(), src), _loop(out, src, index, copy=True))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.one_of(st.none(), st.integers(0, 30)), max_size=40))
def test_runs_cover_every_indexed_row_once(index):
    covered = {}
    for r0, s, i0, t, m in arithmetic_runs(index):
        assert s >= 1 and t >= 1 and m >= 1
        for k in range(m):
            assert r0 + k * s not in covered
            covered[r0 + k * s] = i0 + k * t
    assert covered == {r: i for r, i in enumerate(index) if i is not None}


def test_the_fallback_gathers_an_irregular_index():
    index = [5, 0, 3, None, 1, 4, 2, None, 0, 5, 1, 3, 2, 4, None, 0, 3, 1, 5, 2]
    gather = RowGather(index, "cpu")
    assert gather.runs is None  # more runs than MAX_RUNS: index_select
    src, out = torch.randn(6, 3), torch.randn(len(index), 3)
    src[0] = float("inf")  # an absent row must take nothing, not 0 · inf
    assert torch.equal(gather.add_(out.clone(), src), _loop(out, src, index))


@pytest.mark.parametrize("topology", ["chain", "binary_tree", "double_binary_tree"])
def test_relay_messages_of_the_trees_are_a_few_runs(topology):
    for tree in resolve_topology(topology, 64, require_tree=True, members="workers").trees:
        edges = _TreeEdges(tree, 64, "cpu")
        for gather in [edges.first, edges.alone, *edges.relay_slots, *edges.in_slot_gathers]:
            assert gather.runs is not None and len(gather.runs) <= MAX_RUNS


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 40), st.integers(1, 30), st.integers(1, 30), st.data())
def test_a_sum_of_two_gathers_equals_the_row_by_row_loop(rows, first_rows, second_rows, data):
    pair = st.tuples(st.integers(0, first_rows - 1), st.integers(0, second_rows - 1))
    index = data.draw(st.lists(st.one_of(st.none(), pair), min_size=rows, max_size=rows))
    g = torch.Generator().manual_seed(rows * 1000 + first_rows * 31 + second_rows)
    first, second = torch.randn(first_rows, 5, generator=g), torch.randn(second_rows, 5, generator=g)
    out = torch.randn(rows, 5, generator=g)
    expected = out.clone()
    for r, i in enumerate(index):
        if i is not None:
            expected[r] = first[i[0]] + second[i[1]]
    gather = RowGather(index, "cpu")
    got = out.clone()
    for function, args in gather.sum_calls(got, first, second):
        function(*args)
    assert torch.equal(got, expected)
    for r0, s, i0, t, m in gather.runs or []:
        assert s >= 1 and m >= 1 and min(t) >= 1


@pytest.mark.parametrize("topology", ["ring", "exponential", "fully_connected"])
def test_the_gossip_mix_is_the_rows_formula(topology):
    n = 12
    top = resolve_topology(topology, n, members="workers")
    x = torch.randn(n, 37, generator=torch.Generator().manual_seed(3))
    expected = torch.empty_like(x)
    for i in range(n):  # w_ii x_i, then w_ij x_j in the topology's neighbour order
        weights = top.gossip_weights(i)
        expected[i] = x[i] * weights[i]
        for j in top.neighbors(i):
            expected[i:i + 1].addcmul_(x[j:j + 1], torch.tensor([[weights[j]]]))
    mix = NeighbourMix(top, "cpu")
    spare = torch.empty_like(x)
    assert torch.equal(mix.mix(x, spare), expected)
    # the form alternates storages: the result as the next x, the old x as the next out
    assert torch.equal(mix.mix(spare, x), mix.mix(expected, torch.empty_like(x)))


def test_swapped_parameters_train_as_copied_ones():
    """D-PSGD's mix becomes the parameters by swap_params (no copy): the engine's steps
    after a swap equal those after a copy of the same values, and the old storage is
    handed back untouched."""
    engines = []
    for _ in range(2):
        torch.manual_seed(0)
        engines.append(Engine(torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2)), 4,
                              RelayAlgorithm(topology="chain"), lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)))
    g = torch.Generator().manual_seed(2)
    for step in range(4):
        x, y = torch.randn(4, 6, 3, generator=g), torch.randint(0, 2, (4, 6), generator=g)
        values = engines[0].model.params.detach() * 0.5 + 0.01 * step
        before = engines[0].model.params.detach().clone()
        returned = engines[0].model.swap_params(values.clone())
        assert torch.equal(returned, before)
        engines[1].model.params.detach().copy_(values)
        for engine in engines:
            engine.step(x, y, torch.nn.functional.cross_entropy)
        assert torch.equal(engines[0].model.params, engines[1].model.params)
    with pytest.raises(ValueError, match="values: a contiguous"):
        engines[0].model.swap_params(torch.zeros(3, 3))
    with pytest.raises(ValueError, match="must not share"):
        engines[0].model.swap_params(engines[0].model.params.detach())


@pytest.mark.parametrize("topology", ["chain", "double_binary_tree"])
def test_relay_counts_stop_being_recomputed_only_at_their_fixed_point(topology):
    n, steps = 5, 9  # a chain of 5 reaches its fixed point after 4 steps
    engines = []
    for _ in range(2):
        torch.manual_seed(0)
        engines.append(Engine(torch.nn.Linear(3, 2), n, RelayAlgorithm(topology=topology),
                              lambda params: torch.optim.SGD(params, lr=0.1)))
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(n, 4, 3, generator=g), torch.randint(0, 2, (n, 4), generator=g)
        engines[1].form._counts_fixed = False  # the reference recomputes the counts every step
        for engine in engines:
            engine.step(x, y, torch.nn.functional.cross_entropy)
    assert engines[0].form._counts_fixed
    assert engines[0].form.last_counts == [float(n)] * len(engines[0].form.trees)  # everyone heard from all
    assert torch.equal(engines[0].model.params, engines[1].model.params)


@pytest.mark.parametrize("mode", ["count", "world_size"])
def test_a_chains_strips_relay_as_the_message_matrix_does(mode, monkeypatch):
    """A chain's messages built in place in moving strips (relay._ChainStrips) equal the
    general message matrix's bit for bit, across the strips' copies to their other half
    (every n − 1 = 4 steps here)."""
    from bagua_algos.engine.forms import relay

    n, engines = 5, []
    for chain_strips in (True, False):
        monkeypatch.setattr(relay, "is_chain", lambda tree, n, strips=chain_strips: strips)
        torch.manual_seed(0)
        engines.append(Engine(torch.nn.Linear(3, 2), n, RelayAlgorithm(topology="chain", mode=mode),
                              lambda params: torch.optim.SGD(params, lr=0.1)))
    assert isinstance(engines[0].form.slices[0][3], relay._ChainStrips)
    assert isinstance(engines[1].form.slices[0][3], tuple)
    g = torch.Generator().manual_seed(4)
    for _ in range(11):
        x, y = torch.randn(n, 4, 3, generator=g), torch.randint(0, 2, (n, 4), generator=g)
        for engine in engines:
            engine.step(x, y, torch.nn.functional.cross_entropy)
        assert torch.equal(engines[0].model.params, engines[1].model.params)
