"""cuda_ext's compiled gossip mix for the one-process engine (csrc/engine_cpu.cpp).

The decentralized op takes it on the engine's stacked rows wherever cuda_ext's CPU module
is loaded, in place of its torch passes (bagua_algos/runtime/gossip.py). It promises the same
terms in the same order, rounded alike: on a CPU with AVX2 + FMA (where torch's
``addcmul_`` is one fused multiply-add) the parameters after training equal the torch
passes' bit for bit; elsewhere they agree to float rounding. The formula itself is
checked against W @ X in float64.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import cuda_ext
from bagua_algos.algorithms import DecentralizedAlgorithm
from bagua_algos.engine import Engine
from bagua_algos.engine.gossip import StackedMix
from bagua_algos.engine.rows import engine_cpu_passes, torch_passes_only
from bagua_algos.runtime.topology import NeighbourTable
from topologies import available_topologies, get_topology


def _fma_on_both_sides() -> bool:
    """Whether this CPU has AVX2 + FMA (the compiled mix then fuses its multiply-adds) and
    torch's ``addcmul_`` fuses its own (checked: one rounding, as computed in float64,
    where two roundings differ on a good share of random values)."""
    try:
        flags = open("/proc/cpuinfo").read().split()
    except OSError:
        return False
    if "avx2" not in flags or "fma" not in flags:
        return False
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(4096, 1, generator=g) for _ in range(3))
    one_rounding = (a.double() + b.double() * c.double()).float()  # b·c is exact in float64
    return torch.equal(a.clone().addcmul_(b, c), one_rounding)


BIT_FOR_BIT = _fma_on_both_sides()


@pytest.fixture(scope="module")
def module():
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler: cuda_ext's CPU module cannot be built")
    try:
        return cuda_ext.load_cpu_passes()
    except cuda_ext.ExtensionUnavailable as error:
        pytest.fail(f"a compiler is here but the CPU module did not build: {error}")


def _gossip_topologies():
    return [name for name in available_topologies() if name not in available_topologies(trees_only=True)]


def _dense_w(topology) -> torch.Tensor:
    n = topology.world_size
    w = torch.zeros(n, n, dtype=torch.float64)
    for i in range(n):
        for j, value in topology.gossip_weights(i).items():
            w[i, j] = value
    return w


@pytest.mark.parametrize("name", _gossip_topologies())
@pytest.mark.parametrize("n, d", [(1, 37), (4, 70000), (6, 5), (13, 1029), (64, 5000)])
def test_mix_is_w_times_x(module, name, n, d):
    """In place, x ← W x, against the dense product in float64: every row (each worker
    with all its neighbours, however many), blocks of columns and partial vectors."""
    topology = get_topology(name, n)
    mix = StackedMix(NeighbourTable(topology, range(topology.world_size)))
    x = torch.randn(n, d, dtype=torch.float64, generator=torch.Generator().manual_seed(n * 1000 + d))
    expected = _dense_w(topology) @ x
    got = x.clone()
    assert mix.mix_compiled_(got)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("threads", [1, 2])
def test_mix_equals_the_torch_passes_on_strided_rows(module, dtype, threads):
    """Rows any distance apart (a column slice of a wider tensor), both dtypes, one and
    two threads: the compiled mix writes what the torch passes write, and nothing else."""
    topology = get_topology("exponential", 16)
    mix = StackedMix(NeighbourTable(topology, range(topology.world_size)))
    wide = torch.randn(16, 3000, generator=torch.Generator().manual_seed(7)).to(dtype)
    x = wide[:, 100:2900]
    expected = mix.mix(x, torch.empty_like(x))
    before = wide.clone()
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert mix.mix_compiled_(x)
    finally:
        torch.set_num_threads(old_threads)
    if BIT_FOR_BIT:
        assert torch.equal(x, expected)
    else:
        torch.testing.assert_close(x, expected)
    assert torch.equal(wide[:, :100], before[:, :100]) and torch.equal(wide[:, 2900:], before[:, 2900:])


def _train(n, topology, dtype, steps=12):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 10)).to(dtype)
    engine = Engine(model, n, DecentralizedAlgorithm(topology=topology), lambda p: torch.optim.SGD(
        p, lr=0.1, momentum=0.9), device="cpu")
    data = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(n, 8, 1, 8, 8, generator=data, dtype=dtype)
        y = torch.randint(0, 10, (n, 8), generator=data)
        engine.step(x, y, torch.nn.functional.cross_entropy)
    return engine.model.params.detach().clone()


@pytest.mark.parametrize("topology", ["ring", "exponential"])
@pytest.mark.parametrize("n", [6, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_training_equals_the_torch_passes(module, topology, n, dtype):
    """12 steps of D-PSGD on the engine with the compiled mix and with the torch passes."""
    compiled = _train(n, topology, dtype)
    with torch_passes_only():
        reference = _train(n, topology, dtype)
    if BIT_FOR_BIT:
        assert torch.equal(compiled, reference)
    else:
        torch.testing.assert_close(compiled, reference, rtol=1e-5, atol=1e-6)


def test_only_cpu_floats_take_it(module):
    assert engine_cpu_passes(torch.zeros(2, 3)) is module
    assert engine_cpu_passes(torch.zeros(2, 3, dtype=torch.float64)) is module
    assert engine_cpu_passes(torch.zeros(2, 3, dtype=torch.float16)) is None
    with torch_passes_only():
        assert engine_cpu_passes(torch.zeros(2, 3)) is None
    assert engine_cpu_passes(torch.zeros(2, 3)) is module


@pytest.mark.parametrize("call, message", [
    (lambda m, x, s, j, w: m.engine_gossip_mix_(x.t(), s, j, w), "x's columns must be contiguous"),
    (lambda m, x, s, j, w: m.engine_gossip_mix_(x.half(), s, j, w), "x must be float32 or float64, got torch.float16"),
    (lambda m, x, s, j, w: m.engine_gossip_mix_(x[0], s, j, w), "x must be a 2-D tensor (n x d), got 1-D"),
    (lambda m, x, s, j, w: m.engine_gossip_mix_(x, s.double(), j, w), "self_weight must be torch.float32"),
    (lambda m, x, s, j, w: m.engine_gossip_mix_(x, s[:3], j, w), "self_weight must be a contiguous 1-D CPU tensor of 4"),
    (lambda m, x, s, j, w: m.engine_gossip_mix_(x, s, j.int(), w), "neighbour must be a contiguous n x slots"),
    (lambda m, x, s, j, w: m.engine_gossip_mix_(x, s, j + 2, w), "neighbour[0][0] is 5; valid: -1 (no term) to 3"),
    (lambda m, x, s, j, w: m.engine_gossip_mix_(x, s, j, w[:, :1]), "weight must be a contiguous CPU tensor"),
    (lambda m, x, s, j, w: m.engine_gossip_mix_(x, x[:, 0].contiguous(), j, w), None),
    (lambda m, x, s, j, w: m.engine_gossip_mix_(x, x[0, :4], j, w), "x and self_weight share memory"),
])
def test_bad_operands_are_named(module, call, message):
    x = torch.randn(4, 16)
    s = torch.full((4,), 1 / 3)
    j = torch.tensor([[3, 1], [0, 2], [1, 3], [2, 0]])
    w = torch.full((4, 2), 1 / 3)
    before = x.clone()
    if message is None:  # a copy of x's values as weights is fine
        call(module, x, s, j, w)
        return
    with pytest.raises(ValueError) as raised:
        call(module, x, s, j, w)
    assert message in str(raised.value)
    assert torch.equal(x, before)  # refused before anything was written
