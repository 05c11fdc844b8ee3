"""The one gossip (bagua_algos/runtime/gossip.py): its neighbour table, its three kinds of
W_t on the engine's stacked rows against the plain formulas, and the engine's neighbour
allreduce (StackedMix, from the rows themselves) against the exchange path a process
takes: the same terms in the same order, so equal bit for bit (torch passes; the compiled sweep is held to them in
test_engine_cpu_passes.py). The processes' side is test_engine_equality.py's (every
gossiping algorithm, engine against gloo processes) and test_model_averaging.py's."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import topologies
from bagua_algos.runtime import comm
from bagua_algos.engine.gossip import StackedMix
from bagua_algos.engine.rows import torch_passes_only
from bagua_algos.engine.transport import StackedGroup
from bagua_algos.runtime.comm.process import exchange_and_combine
from bagua_algos.runtime.gossip import Gossip, pairwise_average_, pairwise_average_and_copy_
from bagua_algos.runtime.topology import NeighbourTable
from topologies import ShiftOneTopology, get_topology, shift_one_peer

FIXED = ["chain", "binary_tree", "ring", "fully_connected", "exponential"]


def _dense_w(topology) -> torch.Tensor:
    n = topology.world_size
    w = torch.zeros(n, n, dtype=torch.float64)
    for i in range(n):
        for j, value in topology.gossip_weights(i).items():
            w[i, j] = value
    return w


def _gossip(topology, n):
    world = StackedGroup(n)
    return world, Gossip(topology, list(range(n)), list(range(n)), world)


# ---------------------------------------------------------------- the table
@pytest.mark.parametrize("name", FIXED)
@pytest.mark.parametrize("n", [2, 5, 9])
def test_the_table_pads_with_minus_one_and_zero_weights(name, n):
    topology = get_topology(name, n)
    table = NeighbourTable(topology, range(n))
    assert table.neighbours.dtype == torch.long and table.weight.dtype == torch.float64
    assert table.neighbours.shape == table.weight.shape == (n, max(topology.degree(i) for i in range(n)))
    for i in range(n):
        row = table.neighbours[i].tolist()
        degree = topology.degree(i)
        assert row[:degree] == topology.neighbors(i) and row[degree:] == [-1] * (table.slots - degree)
        weights = topology.gossip_weights(i)
        assert table.weight[i].tolist() == [weights[j] for j in row[:degree]] + [0.0] * (table.slots - degree)
        assert table.self_weight[i].item() == weights[i]
        assert table.slot(0)[i] == (row[0] if row[0] >= 0 else None)


def test_a_table_of_some_rows_is_those_rows():
    topology = get_topology("chain", 6)
    full, mine = NeighbourTable(topology, range(6)), NeighbourTable(topology, [4])
    assert mine.slots == topology.degree(4) == 2
    assert mine.neighbours.tolist() == [topology.neighbors(4)]
    assert torch.equal(mine.weight[0], full.weight[4])
    ends = NeighbourTable(topology, [0])  # a chain's end has one neighbour: one slot, no padding
    assert ends.neighbours.tolist() == [[1]]


def test_bad_rows_and_topologies_are_named():
    with pytest.raises(ValueError, match=r"rows must be ranks of .* got 6"):
        NeighbourTable(get_topology("ring", 6), [0, 6])
    with pytest.raises(TypeError, match="topology must be a Topology, got str"):
        NeighbourTable("ring", [0])


# ---------------------------------------------------------------- shift_one
def test_shift_one_is_a_time_varying_topology_of_bagua_pairing():
    for n in (2, 4, 8, 10):
        t = ShiftOneTopology(n)
        assert t.time_varying and t.period == n // 2
        for step in range(2 * n):
            assert [t.out_peer(r, step) for r in range(n)] == [shift_one_peer(r, n, step) for r in range(n)]
            assert [t.in_peer(r, step) for r in range(n)] == [t.out_peer(r, step) for r in range(n)]
        half = n // 2
        assert t.neighbors(0) == list(range(half, n)) and sorted(t.neighbors(n - 1)) == list(range(half))
        assert t.is_connected()
    with pytest.raises(ValueError, match="shift_one needs an even number of workers, got world_size=5"):
        ShiftOneTopology(5)
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        ShiftOneTopology(4).out_peer(0, -1)


# ---------------------------------------------------------------- the three kinds of W_t
@pytest.mark.parametrize("name", FIXED)
@pytest.mark.parametrize("n", [2, 7, 12])
def test_a_fixed_topology_is_its_metropolis_hastings_matrix(name, n):
    world, gossip = _gossip(get_topology(name, n), n)
    x = torch.randn(n, 33, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    expected = _dense_w(gossip.topology) @ x
    with comm.using_transport(world):
        gossip.mix_(x)
    torch.testing.assert_close(x, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("topology", [ShiftOneTopology(6), topologies.OnePeerExponentialTopology(6)],
                         ids=["shift_one", "one_peer_exponential"])
def test_a_time_varying_topology_averages_each_pair(topology):
    n = topology.world_size
    world, gossip = _gossip(topology, n)
    x = torch.randn(n, 9, generator=torch.Generator().manual_seed(1))
    for step in range(4):
        expected = torch.stack([(x[i] + x[topology.in_peer(i, step)]) * 0.5 for i in range(n)])
        with comm.using_transport(world):
            gossip.mix_(x, step)
        assert torch.equal(x, expected)


def test_all_is_the_members_average():
    n = 5
    world = StackedGroup(n)
    gossip = Gossip(None, list(range(n)), list(range(n)), world)
    x = torch.randn(n, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    expected = x.mean(0, keepdim=True).expand_as(x)
    with comm.using_transport(world):
        gossip.mix_(x)
    torch.testing.assert_close(x, expected)


def test_pairwise_average_is_the_mean_of_two():
    x, y = torch.tensor([1.0, -3.0, 0.5]), torch.tensor([2.0, 3.0, 0.25])
    assert torch.equal(pairwise_average_(x, y), torch.tensor([1.5, 0.0, 0.375]))


# ---------------------------------------------------------------- the engine's mix
@pytest.mark.parametrize("name", FIXED)
@pytest.mark.parametrize("n", [2, 7, 12])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_engines_mix_equals_the_exchange_bit_for_bit(name, n, dtype):
    """Gossip on the engine (its transport's neighbour allreduce, from the rows) and the
    path a process takes (the exchange into receive buffers, then the product and a
    multiply-add per slot: exchange_and_combine over the engine's exchange, W = n): the
    same bits and the same bytes counted, three exchanges in a row, on strided rows (the
    bucket's columns of a wider matrix)."""
    world, gossip = _gossip(get_topology(name, n), n)
    wide = torch.randn(n, 50, generator=torch.Generator().manual_seed(3)).to(dtype)
    a, b = wide.clone()[:, 4:41], wide.clone()[:, 4:41]
    self_weight, weight = gossip.table.weights_as(b)
    pairs = [(peer, weight[:, s:s + 1]) for s, peer in enumerate(gossip._peers)]
    received = torch.zeros(n, len(pairs), b.shape[1], dtype=dtype)
    with comm.using_transport(world), torch_passes_only():
        for step in range(3):
            comm.reset_bytes_sent()
            gossip.mix_(a, step)
            counted = comm.reset_bytes_sent()
            exchange_and_combine(world.neighbor_exchange, b, b, self_weight, pairs, received)
            assert counted == comm.reset_bytes_sent() > 0  # the mix counts the exchange's bytes
            assert torch.equal(a, b)


@pytest.mark.parametrize("topology", [ShiftOneTopology(6), topologies.OnePeerExponentialTopology(8),
                                      get_topology("ring", 5), get_topology("exponential", 8), None],
                         ids=["shift_one", "one_peer_exponential", "ring", "exponential", "all"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_mix_into_is_the_copy_then_mix_bit_for_bit(topology, dtype):
    """mix_into(x, out) (the decentralized op's path in a job: x sent from the bucket,
    the result built in peer_weight) leaves x as it was and out as out.copy_(x) then
    mix_(out) would, bit for bit."""
    n = 5 if topology is None else topology.world_size
    world = StackedGroup(n)
    into, inplace = (Gossip(topology, list(range(n)), list(range(n)), world) for _ in range(2))
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(n, 33, generator=g) * torch.logspace(-6, 6, 33)).to(dtype)
    with comm.using_transport(world):
        for step in range(4):
            before, out, expected = x.clone(), torch.full_like(x, float("nan")), x.clone()
            into.mix_into(x, out, step)
            inplace.mix_(expected, step)
            assert torch.equal(x, before)
            assert torch.equal(out, expected)
            x = out


@pytest.mark.parametrize("topology", [ShiftOneTopology(4), topologies.OnePeerExponentialTopology(8),
                                      get_topology("ring", 5), None],
                         ids=["shift_one", "one_peer_exponential", "ring", "all"])
def test_exchange_into_then_finish_is_mix_into_then_the_copy_back(topology):
    """exchange_into(x, out) and finish(x) (the decentralized op's exchange and its
    copy_back) leave out and x as mix_into(x, out) then x.copy_(out) would, bit for bit;
    finish(None) leaves x alone."""
    n = 5 if topology is None else topology.world_size
    world = StackedGroup(n)
    split, whole = (Gossip(topology, list(range(n)), list(range(n)), world) for _ in range(2))
    x = torch.randn(n, 70_001, generator=torch.Generator().manual_seed(5)) * 10
    with comm.using_transport(world):
        for step in range(3):
            expected_out, expected_x = torch.full_like(x, float("nan")), x.clone()
            whole.mix_into(expected_x, expected_out, step)
            expected_x.copy_(expected_out)
            out, before = torch.full_like(x, float("nan")), x.clone()
            finish = split.exchange_into(x, out, step)
            if step == 2:
                finish(None)
                assert torch.equal(x, before) and torch.equal(out, expected_out)
                break
            finish(x)
            assert torch.equal(out, expected_out) and torch.equal(x, expected_x)


@given(numel=st.integers(1, 3 * (1 << 16) + 7), target=st.sampled_from(["x", "other", "strided"]),
       dtype=st.sampled_from([torch.float32, torch.float64]))
@settings(max_examples=25, deadline=None)
def test_the_pairwise_average_and_copy_in_one_sweep_is_the_passes_bit_for_bit(numel, target, dtype):
    """pairwise_average_and_copy_ (blocks of AVERAGE_BLOCK) equals the sum, the halving
    and the copy as three passes, at every size about the block's, into x itself, another
    tensor, or a strided one (the passes then)."""
    g = torch.Generator().manual_seed(numel)
    x = (torch.randn(numel, generator=g) * torch.logspace(-20, 20, numel)).to(dtype)
    received = torch.randn(numel, generator=g).to(dtype)
    expected = pairwise_average_(received.clone(), x.clone())
    into = {"x": x, "other": torch.empty_like(x),
            "strided": torch.empty(2 * numel, dtype=dtype)[::2]}[target]
    out = pairwise_average_and_copy_(received, x, into)
    assert out is received
    assert torch.equal(received, expected) and torch.equal(into, expected)


def _job_worker(rank, n):
    """Each time-varying topology's mix_, mix_into and exchange_into with its finish in a
    gloo job, three exchanges each."""
    out = {}
    for name, topology in (("shift_one", ShiftOneTopology(n)), ("exp", topologies.OnePeerExponentialTopology(n))):
        gossip = Gossip(topology, [rank], list(range(n)), None)
        x = (torch.randn(33, generator=torch.Generator().manual_seed(rank)) * torch.logspace(-6, 6, 33))
        start, into, inplace, split = x.clone(), [], x.clone(), x.clone()
        for step in range(3):
            y = torch.full_like(x, float("nan"))
            gossip.mix_into(x, y, step)
            gossip.mix_(inplace, step)
            gossip.exchange_into(split, torch.full_like(x, float("nan")), step)(split)
            into.append(y)
            x = y
        out[name] = (start, into, inplace, split)
    return out


def test_a_job_s_time_varying_exchange_in_place_and_into_gives_the_formula():
    """In a job, mix_ and mix_into of a time-varying topology give, bit for bit,
    (x_i + x_peer) / 2 at every exchange."""
    from bagua_algos.experiments.gloo_workers import run_workers

    n = 4
    results = run_workers(_job_worker, n, timeout=120)
    for name, topology in (("shift_one", ShiftOneTopology(n)), ("exp", topologies.OnePeerExponentialTopology(n))):
        x = torch.stack([results[r][name][0] for r in range(n)])
        for step in range(3):
            x = torch.stack([(x[i] + x[topology.in_peer(i, step)]) * 0.5 for i in range(n)])
            assert torch.equal(torch.stack([results[r][name][1][step] for r in range(n)]), x)
        assert torch.equal(torch.stack([results[r][name][2] for r in range(n)]), x)
        assert torch.equal(torch.stack([results[r][name][3] for r in range(n)]), x)


def test_one_member_and_bad_shapes():
    world = StackedGroup(3)
    with comm.using_transport(world):
        alone = Gossip(get_topology("ring", 1), [0], [0], world)
        x = torch.ones(1, 4)
        alone.mix_(x)
        assert torch.equal(x, torch.ones(1, 4))
        _, gossip = _gossip(get_topology("ring", 3), 3)
        with pytest.raises(ValueError, match=r"x must be \[W, L\] with W = 3 .* got shape \(2, 4\)"):
            gossip.mix_(torch.ones(2, 4))
    with pytest.raises(ValueError, match="member_ranks must name a rank for each of the topology's 3 members, got 2"):
        Gossip(get_topology("ring", 3), [0], [0, 1], world)
    with pytest.raises(ValueError, match="rows must name at least one member"):
        Gossip(get_topology("ring", 3), [], [0, 1, 2], world)
    with pytest.raises(ValueError, match=r"table must hold every row of the stacked world in order"):
        StackedMix(NeighbourTable(get_topology("ring", 3), [1, 2]))
    with pytest.raises(ValueError, match=r"neighbours must be an \[n, D\] long tensor or a NeighbourTable"):
        StackedMix(torch.zeros(3, dtype=torch.long))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_pairwise_average_and_copy_is_three_kernels_and_the_same_bits():
    """Off the CPU the sweep takes the three passes (blocks would be 3 launches each)."""
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator().manual_seed(7)
    x, received = torch.randn(300_000, generator=g), torch.randn(300_000, generator=g)
    expected = pairwise_average_(received.clone(), x.clone())
    xc, rc = x.cuda(), received.cuda()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        pairwise_average_and_copy_(rc, xc, xc)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) <= 3
    assert torch.equal(rc.cpu(), expected) and torch.equal(xc.cpu(), expected)
