"""runtime/rows.py: a row gather as strided slices must add (and copy) exactly what a
row-by-row loop does, for any index, and find few runs in the usual topologies; the
gossip mix of stacked workers (runtime/gossip.py) is held to the plain formula (and to
the gloo processes by test_engine_equality.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from bagua_algos.engine.gossip import StackedMix
from bagua_algos.engine.rows import MAX_RUNS, RowGather, arithmetic_runs, run_calls
from bagua_algos.runtime.topology import NeighbourTable, resolve_topology


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
    other = torch.randn(sources, 5, generator=g)  # out[r] = src[i] + other[i]: one add a row
    summed = _loop(out, src, index, copy=True)
    for r, i in enumerate(index):
        if i is not None:
            summed[r] = torch.add(src[i], other[i])
    got = out.clone()
    run_calls(gather.sum_calls(got, src, other))
    assert torch.equal(got, summed)


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
    mix = StackedMix(NeighbourTable(top, range(top.world_size)))
    spare = torch.empty_like(x)
    assert torch.equal(mix.mix(x, spare), expected)
    # the form alternates storages: the result as the next x, the old x as the next out
    assert torch.equal(mix.mix(spare, x), mix.mix(expected, torch.empty_like(x)))




@pytest.mark.parametrize("index", [
    [None, (0, 1), (2, 2), (4, 3), None, (6, 4)],  # a run: rows step 1, sources (2, 1)
    [None] + [(6 - i % 7, 5 - i % 6) for i in range(20)]])  # rows whose sources fall: the fallback
def test_a_gather_of_pairs_sums_two_sources_at_rows_of_their_own(index):
    """sum_calls over an index of (a_row, b_row) pairs: out[r] = a[a_row] + b[b_row] (relay's
    messages that start from another message: (x + r_a) + r_b)."""
    g = torch.Generator().manual_seed(len(index))
    a, b, out = torch.randn(7, 5, generator=g), torch.randn(6, 5, generator=g), torch.randn(len(index), 5, generator=g)
    expected = out.clone()
    for r, pair in enumerate(index):
        if pair is not None:
            expected[r] = torch.add(a[pair[0]], b[pair[1]])
    gather = RowGather(index, "cpu")
    assert (gather.runs is None) == (len(index) > 6)  # (the second's runs: more than MAX_RUNS)
    got = out.clone()
    run_calls(gather.sum_calls(got, a, b))
    assert torch.equal(got, expected)
    with pytest.raises(ValueError, match="pairs serve sum_calls"):
        gather.add_calls(out, a)
