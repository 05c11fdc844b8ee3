"""cuda_ext: the compiled batched Householder orthogonalization (C++ CPU path here,
the CUDA path where a GPU is present), its compile-only CUDA check, and the fallback
of ``orthogonalization="householder"`` when the extension cannot be built.

The CPU extension is built once per session into the usual cache directory (15–30 s
the first time, then reused); tests that need it skip, with the reason, when there is
no C++ compiler."""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import warnings

import pytest
import torch

import cuda_ext
from cuda_ext import _loader
from subprocesses import child_env, run_python

HAS_CXX = shutil.which(os.environ.get("CXX", "c++")) is not None
HAS_CUDA = torch.cuda.is_available()


def _nvcc():
    from torch.utils.cpp_extension import CUDA_HOME

    candidates = [os.path.join(CUDA_HOME, "bin", "nvcc")] if CUDA_HOME else []
    candidates.append(shutil.which("nvcc"))
    return next((c for c in candidates if c and os.path.isfile(c) and os.access(c, os.X_OK)), None)


@pytest.fixture(scope="module")
def cpu_ext():
    if not HAS_CXX:
        pytest.skip(f"no C++ compiler ({os.environ.get('CXX', 'c++')} not found): the CPU extension cannot be built")
    return cuda_ext.load_orthogonalize("cpu")


@pytest.fixture(scope="module")
def cuda_ext_fn():
    if not HAS_CUDA:
        pytest.skip("needs a CUDA device")
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None:
        pytest.skip("a CUDA device but no CUDA toolkit (set CUDA_HOME): the CUDA extension cannot be built")
    return cuda_ext.load_orthogonalize("cuda")


def _orthonormality_error(q: torch.Tensor) -> float:
    q = q.double()
    return (q.T @ q - torch.eye(q.shape[1], dtype=torch.float64, device=q.device)).abs().max().item()


def _span_residual(a: torch.Tensor, q: torch.Tensor) -> float:
    """|A − Q QᵀA| / |A|: how much of A lies outside span(Q)."""
    a, q = a.double(), q.double()
    return ((a - q @ (q.T @ a)).norm() / a.norm().clamp_min(1e-300)).item()


def _random(m, r, seed, dtype=torch.float32, scale=1.0):
    return (torch.randn(m, r, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale).to(dtype)


SHAPES = [(1, 1), (2, 1), (5, 5), (16, 2), (64, 4), (256, 8), (300, 7), (512, 1), (33, 32), (128, 64), (1000, 3)]


# --- CPU path ------------------------------------------------------------------------
def test_matches_torch_qr_on_full_rank_matrices(cpu_ext):
    inputs = [_random(m, r, seed) for seed, (m, r) in enumerate(SHAPES)]
    outputs = cpu_ext(inputs, epsilon=1e-8)
    for a, q in zip(inputs, outputs):
        assert q.shape == a.shape and q.dtype == a.dtype and q.is_contiguous()
        assert _orthonormality_error(q) <= 1e-5, a.shape
        assert _span_residual(a, q) <= 1e-5, a.shape
        # LAPACK's sign convention: the same Q as torch.linalg.qr, not just the same span.
        reference = torch.linalg.qr(a.double()).Q
        assert (q.double() - reference).abs().max().item() <= 1e-4, a.shape


def test_float64_is_accurate_to_double_rounding(cpu_ext):
    a = _random(200, 6, 1, torch.float64)
    (q,) = cpu_ext([a], epsilon=1e-12)
    assert q.dtype == torch.float64
    assert _orthonormality_error(q) <= 1e-13
    assert (q - torch.linalg.qr(a).Q).abs().max().item() <= 1e-12


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_accumulates_in_float32(cpu_ext, dtype):
    a = _random(256, 8, 2, dtype)
    (q,) = cpu_ext([a])
    assert q.dtype == dtype
    # The result is exact to fp32 rounding, then rounded once to the output dtype.
    reference = torch.linalg.qr(a.double()).Q
    assert (q.double() - reference).abs().max().item() <= torch.finfo(dtype).eps
    assert _orthonormality_error(q) <= {torch.float16: 2e-2, torch.bfloat16: 5e-2}[dtype]


def test_zero_matrix_gives_the_first_unit_columns(cpu_ext):
    for m, r in [(7, 3), (4, 4), (1, 1)]:
        (q,) = cpu_ext([torch.zeros(m, r)])
        assert torch.equal(q, torch.eye(m, r))


def test_zero_and_dependent_columns_give_unit_columns_orthogonal_to_the_rest(cpu_ext):
    zero_column = _random(40, 4, 3)
    zero_column[:, 1] = 0
    dependent = _random(40, 4, 4)
    dependent[:, 2] = 2 * dependent[:, 0] - dependent[:, 1]  # rank 3
    rank_one = _random(40, 1, 5).repeat(1, 5)
    first_zero = _random(40, 3, 6)
    first_zero[:, 0] = 0
    for a in (zero_column, dependent, rank_one, first_zero):
        (q,) = cpu_ext([a])
        assert torch.isfinite(q).all()
        assert _orthonormality_error(q) <= 1e-5
        assert _span_residual(a, q) <= 1e-5


def test_epsilon_is_relative_to_the_largest_entry(cpu_ext):
    a = _random(30, 2, 7)
    a[:, 1] = a[:, 0] + 1e-6 * _random(30, 1, 8)[:, 0]  # second column nearly dependent
    (kept,) = cpu_ext([a], epsilon=1e-9)
    (skipped,) = cpu_ext([a], epsilon=1e-3)
    # Kept: the second column of Q follows the tiny difference; skipped: H_1 = I, so
    # Q's second column is H_0 e_1, still a unit vector orthogonal to the first.
    assert _span_residual(a, kept) <= 1e-4
    assert _orthonormality_error(skipped) <= 1e-6
    assert torch.allclose(kept[:, 0], skipped[:, 0])
    # q_0 = H_0 e_0 = e_0 − 2 v v_0 gives v = (e_0 − q_0)/|e_0 − q_0|, and H_0 e_1 = e_1 − 2 v v_1.
    eye = torch.eye(30, 2, dtype=torch.float64)
    v = eye[:, 0] - skipped[:, 0].double()
    v = v / v.norm()
    assert (skipped[:, 1].double() - (eye[:, 1] - 2 * v * v[1])).abs().max() <= 1e-5


@pytest.mark.parametrize("scale", [1e-30, 1e-12, 1e12, 1e30])
def test_tiny_and_huge_scales(cpu_ext, scale):
    base = _random(100, 4, 9, torch.float64)
    (q_base,) = cpu_ext([base.float()])
    (q,) = cpu_ext([(base * scale).float()])
    assert torch.isfinite(q).all()
    assert _orthonormality_error(q) <= 1e-5
    assert (q - q_base).abs().max().item() <= 1e-5


def test_power_of_two_scaling_gives_the_same_bits(cpu_ext):
    a = _random(64, 5, 10)
    (q,) = cpu_ext([a])
    (q_scaled,) = cpu_ext([a * 2.0**-100])
    assert torch.equal(q, q_scaled)


def test_non_contiguous_and_mixed_shapes_in_one_call(cpu_ext):
    wide = _random(60, 24, 11)
    inputs = [
        wide[:, ::3],  # strided columns
        _random(8, 30, 12).T,  # transposed (column-major)
        wide[5:45, 2:6],  # a window with a storage offset
        _random(50, 1, 13).expand(50, 1),
        _random(9, 9, 14, torch.float64),
        torch.zeros(6, 0),
        torch.zeros(0, 0),
        _random(20, 2, 15, torch.float16),
    ]
    assert not inputs[0].is_contiguous() and not inputs[1].is_contiguous()
    outputs = cpu_ext(inputs)
    assert len(outputs) == len(inputs)
    for a, q in zip(inputs, outputs):
        assert q.shape == a.shape and q.dtype == a.dtype
        if a.numel():
            (alone,) = cpu_ext([a.contiguous()])
            assert torch.equal(q, alone)  # strides change nothing
            tolerance = 2e-2 if a.dtype == torch.float16 else 1e-5
            assert _orthonormality_error(q) <= tolerance
            assert _span_residual(a, q) <= tolerance


def test_inputs_are_not_modified(cpu_ext):
    a = _random(20, 3, 16)
    before = a.clone()
    cpu_ext([a])
    assert torch.equal(a, before)


def test_repeated_calls_are_bitwise_equal(cpu_ext):
    inputs = [_random(m, r, seed) for seed, (m, r) in enumerate(SHAPES)]
    first = cpu_ext(inputs)
    second = cpu_ext(list(reversed(inputs)))[::-1]
    assert all(torch.equal(x, y) for x, y in zip(first, second))


def test_empty_list(cpu_ext):
    assert cpu_ext([]) == []


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: cuda_ext.orthogonalize([torch.randn(2, 3)]), r"matrices\[0\] must have no more columns than rows"),
        (lambda: cuda_ext.orthogonalize([torch.randn(3, 2), torch.randn(3)]), r"matrices\[1\] must be a 2-D tensor"),
        (lambda: cuda_ext.orthogonalize([torch.ones(3, 2, dtype=torch.int64)]), r"matrices\[0\] must be float32"),
        (lambda: cuda_ext.orthogonalize(torch.randn(3, 2)), "matrices must be a list of 2-D tensors"),
        (lambda: cuda_ext.orthogonalize([torch.randn(3, 2)], epsilon=float("nan")), "epsilon must be a finite number"),
        (lambda: cuda_ext.orthogonalize([torch.randn(3, 2)], epsilon=-1), "epsilon must be a finite number"),
        (lambda: cuda_ext.load_orthogonalize("meta"), "no path for device type 'meta'"),
    ],
)
def test_bad_input_is_named(call, match):
    with pytest.raises((ValueError, cuda_ext.ExtensionUnavailable), match=match):
        call()


def test_compiled_module_checks_its_inputs_too(cpu_ext):
    module = _loader.load("cpu")
    with pytest.raises(ValueError, match=r"matrices\[1\] must have no more columns than rows"):
        module.orthogonalize([torch.randn(3, 2), torch.randn(2, 3)], 1e-8)
    with pytest.raises(ValueError, match="epsilon must be a finite number"):
        module.orthogonalize([torch.randn(3, 2)], -1.0)


BAD_MATRICES = [
    ([torch.randn(2, 3)], r"matrices\[0\] must have no more columns than rows"),
    ([torch.randn(3, 2), torch.randn(3)], r"matrices\[1\] must be a 2-D tensor"),
    ([torch.randn(3, 2), torch.randn(4, 3, 2)], r"matrices\[1\] must be a 2-D tensor"),
    ([torch.ones(3, 2, dtype=torch.int64)], r"matrices\[0\] must be float32"),
    ([torch.randn(3, 2), torch.randn(3, 2, dtype=torch.complex64)], r"matrices\[1\] must be float32"),
]
BAD_BATCHES = [
    ([torch.randn(2, 2, 3)], r"batches\[0\] must have no more columns than rows"),
    ([torch.randn(1, 3, 2), torch.randn(3, 2)], r"batches\[1\] must be a 3-D tensor"),
    ([torch.ones(1, 3, 2, dtype=torch.int32)], r"batches\[0\] must be float32"),
]


def _message(call) -> str:
    with pytest.raises(ValueError) as info:
        call()
    return str(info.value)


@pytest.mark.parametrize("bad, match", BAD_MATRICES + BAD_BATCHES)
def test_python_and_compiled_checks_say_the_same(cpu_ext, bad, match):
    """Bad operands: one check in C++ (bindings.cpp, before dispatch, for every device) and
    the same words in Python (run first for GPU tensors): the same ValueError."""
    module = _loader.load("cpu")
    if "batches" in match:
        compiled = _message(lambda: module.orthogonalize_batches_(bad, 1e-8))
        python = _message(lambda: cuda_ext._check_tensors(bad, "batches", 3))
        public = _message(lambda: cuda_ext.orthogonalize_batches_(bad))
    else:
        compiled = _message(lambda: module.orthogonalize(bad, 1e-8))
        python = _message(lambda: cuda_ext._check_matrices(bad))
        public = _message(lambda: cuda_ext.orthogonalize(bad))
    assert compiled == python == public
    assert re.match(match, compiled), compiled


def test_batches_in_place_match_the_list_call_bitwise(cpu_ext):
    g = torch.Generator().manual_seed(40)
    batches = [torch.randn(3, 64, 4, generator=g), torch.randn(2, 9, 9, generator=g, dtype=torch.float64),
               torch.randn(1, 33, 1, generator=g), torch.zeros(0, 5, 2), torch.randn(2, 20, 3, generator=g).half()]
    expected = [torch.stack(cpu_ext(list(b.unbind(0)))) if b.shape[0] else b.clone() for b in batches]
    flat = torch.randn(200, 8, generator=g)
    before = flat.clone()
    strided = flat[:96].view(3, 32, 8)[:, :, ::2]  # non-contiguous columns, written through
    expected.append(torch.stack(cpu_ext(list(strided.unbind(0)))))
    batches.append(strided)
    assert cuda_ext.orthogonalize_batches_(batches) is not None
    for got, want in zip(batches, expected):
        assert torch.equal(got, want)
    untouched = before[:96].view(3, 32, 8)[:, :, 1::2]
    assert torch.equal(flat[:96].view(3, 32, 8)[:, :, 1::2], untouched) and torch.equal(flat[96:], before[96:])


def test_batches_that_share_memory_are_refused(cpu_ext):
    base = torch.randn(4, 5, 2)
    with pytest.raises(ValueError, match=r"batches\[0\] has elements that share memory"):
        cuda_ext.orthogonalize_batches_([torch.randn(5, 2).expand(3, 5, 2)])
    with pytest.raises(ValueError, match=r"batches\[1\] and batches\[0\] share memory"):
        cuda_ext.orthogonalize_batches_([base[:2], base[1:]])


def test_householder_torch_matches_the_extension(cpu_ext):
    """The batched torch twin (the GPU fallback) runs the extension's math step for
    step: the same Q to rounding, zero columns included, padded or not. (A column that
    is dependent only up to rounding leaves a remainder of rounding noise, which both
    turn into some unit column: there only orthonormality and the span can agree.)"""
    from bagua_algos.compression import orthogonalization

    g = torch.Generator().manual_seed(41)
    zero_columns = torch.randn(2, 40, 4, generator=g)
    zero_columns[0, :, 0] = 0
    zero_columns[1, :, 1] = 0
    cases = [torch.randn(3, 64, 4, generator=g), torch.randn(2, 128, 2, generator=g) * 1e-20, zero_columns,
             torch.zeros(2, 7, 3), torch.randn(4, 5, 5, generator=g),
             torch.randn(2, 200, 6, generator=g).double()]
    for batch in cases:
        want = torch.stack(cpu_ext(list(batch.unbind(0))))
        got = orthogonalization.householder_torch(batch)
        assert got.dtype == batch.dtype and got.shape == batch.shape
        tolerance = 1e-12 if batch.dtype == torch.float64 else 2e-6
        assert (got - want).abs().max().item() <= tolerance, batch.shape
    noisy = torch.randn(2, 40, 3, generator=g)
    noisy[0, :, 2] = 2 * noisy[0, :, 0] - noisy[0, :, 1]  # dependent up to rounding
    noisy[1] = noisy[1, :, :1].repeat(1, 3)  # rank one
    for a, q in zip(noisy, orthogonalization.householder_torch(noisy)):
        assert _orthonormality_error(q) <= 1e-5 and _span_residual(a, q) <= 1e-5
    # Several shapes at once: rows padded to a power of two, one batch per class.
    batches = [torch.randn(3, 50, 2, generator=g), torch.randn(2, 64, 2, generator=g), torch.randn(1, 33, 2, generator=g),
               torch.randn(2, 7, 3, generator=g)]
    want = [torch.stack(cpu_ext(list(b.unbind(0)))) for b in batches]
    got = [b.clone() for b in batches]
    orthogonalization._householder_torch_batches_(got, 1e-8)
    for x, y in zip(got, want):
        assert (x - y).abs().max().item() <= 2e-6


def test_cuda_module_refuses_bad_input_with_the_cpu_words(cuda_ext_fn, cpu_ext, tmp_path):
    """On a GPU the CUDA module once refused nothing (the process crashed on r > m
    or a 1-D tensor): it must raise the same ValueErrors.
    In a child process, so a crash fails this test, not the session."""
    script = (
        "import torch, cuda_ext\n"
        "from cuda_ext import _loader\n"
        "cuda = _loader.load('cuda')\n"
        "cpu = _loader.load('cpu')\n"
        "cases = [[torch.randn(2, 3)], [torch.randn(3, 2), torch.randn(3)], [torch.ones(3, 2, dtype=torch.int64)]]\n"
        "for case in cases:\n"
        "    words = []\n"
        "    for module, device in ((cpu, 'cpu'), (cuda, 'cuda')):\n"
        "        for call in (lambda: module.orthogonalize([a.to(device) for a in case], 1e-8),\n"
        "                     lambda: cuda_ext.orthogonalize([a.to(device) for a in case])):\n"
        "            try:\n"
        "                call()\n"
        "                words.append('accepted')\n"
        "            except ValueError as error:\n"
        "                words.append(str(error))\n"
        "    assert len(set(words)) == 1 and words[0] != 'accepted', words\n"
        "batch = torch.randn(2, 3, 4, device='cuda')\n"
        "try:\n"
        "    cuda.orthogonalize_batches_([batch], 1e-8)\n"
        "    raise SystemExit('accepted r > m')\n"
        "except ValueError as error:\n"
        "    assert 'batches[0] must have no more columns than rows' in str(error)\n"
        "print('checked')\n"
    )
    code, out, err = run_python(["-c", script], env=child_env(), timeout=600)
    assert code == 0 and "checked" in out, (code, err[-3000:])


def test_cuda_batches_in_place_match_the_cpu_module(cuda_ext_fn, cpu_ext):
    g = torch.Generator().manual_seed(42)
    batches = [torch.randn(5, 512, 4, generator=g), torch.randn(3, 64, 4, generator=g), torch.randn(2, 2048, 8, generator=g)]
    on_gpu = [b.cuda() for b in batches]
    cuda_ext.orthogonalize_batches_(on_gpu)
    for b, q in zip(batches, on_gpu):
        want = torch.stack(cpu_ext(list(b.unbind(0))))
        assert (q.cpu() - want).abs().max().item() <= 1e-4


def test_orthogonalization_householder_uses_the_extension(cpu_ext):
    from bagua_algos.compression.orthogonalization import orthogonalize

    inputs = [_random(64, 4, 17), _random(128, 2, 18), _random(64, 4, 19)]
    via_module = orthogonalize(inputs, "householder")
    direct = cpu_ext(inputs)
    assert all(torch.equal(x, y) for x, y in zip(via_module, direct))
    assert cuda_ext.is_loaded("cpu") and cuda_ext.is_available("cpu")
    # Once loaded (prepare loads it), CPU's "auto" is the extension below WIDE_RANK.
    from bagua_algos.compression import orthogonalization

    assert orthogonalization.prepare("auto", "cpu") == "householder"
    assert all(torch.equal(x, y) for x, y in zip(orthogonalize(inputs, "auto"), direct))
    batches = [torch.stack([inputs[0], inputs[2]]), inputs[1].unsqueeze(0).clone()]
    orthogonalization.orthogonalize_batches_(batches, "auto")
    assert torch.equal(batches[0][1], direct[2]) and torch.equal(batches[1][0], direct[1])


# --- PowerSGD's fused CPU passes (csrc/powersgd_cpu.cpp) --------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_powersgd_fused_passes_match_the_formulas(cpu_ext, dtype):
    """A = G + λE into E with P = A·Q, Qᵀ = Pᵀ·A, then G ← P·Qᵀ and E ← A − P·Qᵀ, against
    torch's formulas: ranks of one sweep (1, 3), of exactly 8 columns, and of two sweeps
    (11); rows with a vector tail (m = 37, 50) and row counts that leave partial tiles
    (5, 7, 9, 16 rows against tiles of 3, 4 and 8; 2500 columns: two blocks of Qᵀ at
    r = 3); a strided P (a transposed view)."""
    module = _loader.loaded_module("cpu")
    generator = torch.Generator().manual_seed(5)
    for n, m, r, decay in [(5, 37, 1, 1.0), (16, 64, 3, 0.7), (9, 40, 8, 0.0), (7, 50, 11, 0.5), (13, 2500, 3, 1.0)]:
        # Sums of m products, rounded in another order than torch's: the absolute error
        # grows with m (|P| is about √m here), so atol does too past 64 columns.
        atol = (1e-5 if dtype == torch.float32 else 1e-12) * max(1.0, m / 64)
        tolerance = dict(rtol=1e-5 if dtype == torch.float32 else 1e-12, atol=atol)
        e, g = (torch.randn(n, m, generator=generator, dtype=dtype) for _ in range(2))
        q = torch.randn(m, r, generator=generator, dtype=dtype)
        p = torch.empty(r, n, dtype=dtype).t() if r == 3 else torch.empty(n, r, dtype=dtype)
        a = g + decay * e
        module.powersgd_form_a_and_p_(e, g, q.t().contiguous(), p, decay)
        torch.testing.assert_close(e, a, **tolerance)
        torch.testing.assert_close(p, a @ q, **tolerance)
        qt = torch.full((r, m), float("nan"), dtype=dtype)
        module.powersgd_transposed_product_(e, p, qt)  # Qᵀ = Pᵀ·A, blocks of columns
        torch.testing.assert_close(qt, (a.t() @ p).t(), **tolerance)
        update = p @ q.t()
        module.powersgd_apply_update_(e, g, p, q.t().contiguous())
        torch.testing.assert_close(g, update, **tolerance)
        torch.testing.assert_close(e, a - update, **tolerance)


def test_powersgd_fused_passes_refuse_bad_operands(cpu_ext):
    module = _loader.loaded_module("cpu")
    e, g, qt, p = torch.zeros(4, 6), torch.zeros(4, 6), torch.zeros(2, 6), torch.zeros(4, 2)
    with pytest.raises(ValueError, match="qt must be r x m with r >= 1 and m = 6"):
        module.powersgd_form_a_and_p_(e, g, torch.zeros(2, 5), p, 1.0)
    with pytest.raises(ValueError, match="g must have e's dtype torch.float32, got torch.float64"):
        module.powersgd_apply_update_(e, g.double(), p, qt)
    with pytest.raises(ValueError, match="e and g share memory; e is written"):
        module.powersgd_apply_update_(e, e, p, qt)
    with pytest.raises(ValueError, match="g and qt share memory; g is written"):
        module.powersgd_apply_update_(e, g, p, g[:2])
    with pytest.raises(ValueError, match="p and g share memory; p is written"):
        module.powersgd_form_a_and_p_(e, g, qt, g[:, :2], 1.0)
    with pytest.raises(ValueError, match="e, g and qt must be contiguous"):
        module.powersgd_form_a_and_p_(torch.zeros(6, 4).t(), g, qt, p, 1.0)
    with pytest.raises(ValueError, match=r"p must be n x r = \(4, 2\)"):
        module.powersgd_form_a_and_p_(e, g, qt, torch.zeros(4, 3), 1.0)
    with pytest.raises(ValueError, match="a and qt must be contiguous"):
        module.powersgd_transposed_product_(torch.zeros(6, 4).t(), p, qt)
    with pytest.raises(ValueError, match="qt and a share memory; qt is written"):
        module.powersgd_transposed_product_(e, p, e[:2])
    with pytest.raises(ValueError, match="p must have a's dtype torch.float32, got torch.float64"):
        module.powersgd_transposed_product_(e, p.double(), qt)


def test_powersgd_step_with_fused_passes_matches_the_torch_step(cpu_ext, monkeypatch):
    """compress_aggregate with the fused passes (the module is loaded here) against the same
    steps in torch ops, ranks 1 and 4, three steps: the updates and errors agree to rounding."""
    from bagua_algos.compression import powersgd as psgd

    assert psgd._fused_cpu_passes() is not None
    shapes = [(8, 3, 3, 3), (8,), (16, 8), (16, 8), (12, 40)]
    for rank in (1, 4):
        plan = psgd.make_plan(shapes, rank, 1.0)
        states, flats = [psgd.init_state(plan, 3, torch.float32, "cpu", True) for _ in range(2)], []
        generator = torch.Generator().manual_seed(rank)
        for step in range(3):
            flat = torch.randn(sum(math.prod(s) for s in shapes), generator=generator)
            results = []
            for fused, state in zip((True, False), states):
                if not fused:
                    monkeypatch.setattr(psgd, "_fused_cpu_passes", lambda: None)
                grads, offset, buffer = [], 0, flat.clone()
                for shape in shapes:
                    grads.append(buffer[offset:offset + math.prod(shape)].view(shape))
                    offset += math.prod(shape)
                psgd.compress_aggregate(plan, grads, state, psgd.PowerSGDOptions(), lambda t: None)
                results.append((buffer, state["error"].clone()))
                monkeypatch.undo()
            (fused_grads, fused_error), (torch_grads, torch_error) = results
            torch.testing.assert_close(fused_grads, torch_grads, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(fused_error, torch_error, rtol=1e-5, atol=1e-5)


# --- the fallback when the extension cannot be built -----------------------------------
def test_build_failure_falls_back_with_one_warning(monkeypatch):
    from bagua_algos.compression import orthogonalization

    def failing_build(kind):
        raise OSError("simulated: no compiler")

    monkeypatch.setattr(_loader, "_modules", {})
    monkeypatch.setattr(_loader, "_failures", {})
    monkeypatch.setattr(_loader, "_import_prebuilt", lambda kind: None)
    monkeypatch.setattr(_loader, "_build", failing_build)
    monkeypatch.setattr(orthogonalization, "_extension_failure_warned", False)
    assert not cuda_ext.is_loaded("cpu") and not cuda_ext.is_available("cpu")
    with pytest.raises(cuda_ext.ExtensionUnavailable, match="simulated: no compiler"):
        cuda_ext.load_orthogonalize("cpu")
    inputs = [_random(32, 3, 20), _random(16, 2, 21)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = orthogonalization.orthogonalize(inputs, "householder")
        second = orthogonalization.orthogonalize_batch(torch.stack([inputs[0]] * 2), "householder")
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "cuda_ext extension is not available" in messages[0]
    for a, q in zip(inputs, first):
        assert torch.allclose(q, torch.linalg.qr(a).Q)
    assert torch.allclose(second[1], torch.linalg.qr(inputs[0]).Q)
    # "auto" is the extension wherever it is loaded; prepare() builds it on GPUs only (on
    # CPU "auto" never compiles). Without it, on CPU: batched torch QR for r ≥ 2, Gram–Schmidt for r = 1.
    # On GPUs it is the compiled Householder QR (its batched torch twin when the build
    # fails), never a per-matrix loop.
    cpu = {torch.device("cpu")}
    assert orthogonalization.prepare("auto", "cpu") == "torch_qr"
    assert orthogonalization._resolve("auto", cpu, 1) == "gram_schmidt"
    assert orthogonalization._resolve("auto", cpu, 4) == "torch_qr"
    assert orthogonalization._resolve("auto", {torch.device("cuda", 0)}, 4) == "householder"
    assert not _loader._modules


def test_missing_compiler_in_a_fresh_process_warns_and_trains_on(tmp_path):
    """A real failed build: CXX points at nothing, the cache directory is empty."""
    env = child_env()
    env.update(CXX=str(tmp_path / "no-such-compiler"), BAGUA_CUDA_EXT_CACHE=str(tmp_path / "cache"))
    script = (
        "import warnings, torch, cuda_ext\n"
        "from bagua_algos.compression.orthogonalization import orthogonalize\n"
        "assert not cuda_ext.is_available('cpu')\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    for _ in range(3):\n"
        "        q, = orthogonalize([torch.randn(20, 3)], 'householder')\n"
        "n = sum('not available' in str(w.message) for w in caught)\n"
        "assert n == 1, n\n"
        "assert torch.allclose(q.T @ q, torch.eye(3), atol=1e-5)\n"
        "print('fallback ok')\n"
    )
    code, out, err = run_python(["-c", script], env=env, timeout=120)
    assert code == 0 and "fallback ok" in out, err[-3000:]


# --- CUDA sources compile (CI: a CUDA syntax error fails here) -------------------------
def test_cuda_kernel_compiles_with_nvcc(tmp_path, monkeypatch):
    """The kernel compiled by nvcc with the very flags torch's JIT build uses for it
    (read from the build file torch's cpp_extension writes: COMMON_NVCC_FLAGS such as
    --expt-relaxed-constexpr, which torch's BFloat16 header needs, the arch flags, the
    include paths), plus -Werror: this checks the real build, not a look-alike."""
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (set CUDA_HOME or put nvcc on PATH)")
    from torch.utils.cpp_extension import CUDA_HOME, COMMON_NVCC_FLAGS

    if CUDA_HOME is None:
        pytest.skip("nvcc found but torch sees no CUDA toolkit (set CUDA_HOME)")
    if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")  # no GPU to take the architecture from
    source = os.path.join(os.path.dirname(_loader.__file__), "csrc", "orthogonalize_kernel.cu")
    command = _loader.nvcc_command(source, tmp_path / "kernel.o", tmp_path) + ["-Werror", "all-warnings"]
    assert all(flag in command for flag in COMMON_NVCC_FLAGS), command
    assert any(flag.startswith("-gencode") for flag in command) and "-std=c++20" in command
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{' '.join(command)}\n{done.stdout}\n{done.stderr}"
    assert (tmp_path / "kernel.o").stat().st_size > 0


# --- CUDA path (GPU machines only) -------------------------------------------------------
def test_cuda_matches_cpu_and_torch_qr(cuda_ext_fn, cpu_ext):
    inputs = [_random(m, r, seed) for seed, (m, r) in enumerate(SHAPES)]
    inputs += [_random(4096, 128, 99), _random(2048, 64, 98)]  # global-memory work path
    gpu = cuda_ext_fn([a.cuda() for a in inputs])
    cpu = cpu_ext(inputs)
    for a, q, q_cpu in zip(inputs, gpu, cpu):
        assert q.device.type == "cuda" and q.shape == a.shape and q.dtype == a.dtype
        q = q.cpu()
        assert _orthonormality_error(q) <= 1e-5, a.shape
        assert _span_residual(a, q) <= 1e-5, a.shape
        assert (q - q_cpu).abs().max().item() <= 1e-4, a.shape


def test_cuda_edge_cases_dtypes_and_strides(cuda_ext_fn):
    wide = _random(60, 24, 11).cuda()
    zero_column = _random(40, 4, 3)
    zero_column[:, 1] = 0
    inputs = [
        torch.zeros(7, 3, device="cuda"),
        zero_column.cuda(),
        _random(40, 1, 5).repeat(1, 5).cuda(),
        wide[:, ::3],
        _random(8, 30, 12).cuda().T,
        (_random(100, 4, 9) * 1e-30).cuda(),
        _random(9, 9, 14, torch.float64).cuda(),
        _random(256, 8, 2, torch.float16).cuda(),
        _random(256, 8, 2, torch.bfloat16).cuda(),
        torch.zeros(6, 0, device="cuda"),
    ]
    outputs = cuda_ext_fn(inputs)
    assert torch.equal(outputs[0].cpu(), torch.eye(7, 3))
    for a, q in zip(inputs, outputs):
        assert q.shape == a.shape and q.dtype == a.dtype and q.device == a.device
        if a.numel():
            assert torch.isfinite(q).all()
            tolerance = 5e-2 if a.dtype in (torch.float16, torch.bfloat16) else 1e-5
            assert _orthonormality_error(q) <= tolerance
            assert _span_residual(a, q) <= tolerance


def test_cuda_one_launch_and_bitwise_repeatable(cuda_ext_fn):
    from torch.profiler import ProfilerActivity, profile

    inputs = [_random(m, r, seed).cuda() for seed, (m, r) in enumerate(SHAPES)]
    cuda_ext_fn(inputs)  # warm-up: workspace allocated
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        first = cuda_ext_fn(inputs)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if "orthogonalize_kernel" in e.name]
    assert len(kernels) == 1, [e.name for e in prof.events()]
    second = cuda_ext_fn(inputs)
    assert all(torch.equal(x, y) for x, y in zip(first, second))


def test_cuda_runs_on_the_current_stream(cuda_ext_fn):
    a = _random(512, 8, 30).cuda()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        (q,) = cuda_ext_fn([a])
    stream.synchronize()
    assert _orthonormality_error(q) <= 1e-5


def _train_powersgd(method: str, steps: int = 25) -> torch.Tensor:
    """A small model trained by SGD on PowerSGD-compressed gradients (rank 2, warm start,
    error feedback; one process, so the allreduce is the identity)."""
    from bagua_algos.compression import powersgd as psgd

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.Tanh(), torch.nn.Linear(48, 10))
    x, y = torch.randn(64, 24), torch.randint(0, 10, (64,))
    params = list(model.parameters())
    plan = psgd.make_plan([p.shape for p in params], 2, 1.0)
    state = psgd.init_state(plan, 0, torch.float32, torch.device("cpu"), True)
    options = psgd.PowerSGDOptions(orthogonalization=method)
    for _ in range(steps):
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        grads = [p.grad for p in params]
        psgd.compress_aggregate(plan, grads, state, options, lambda t: None)
        with torch.no_grad():
            for p in params:
                p.sub_(0.1 * p.grad)
    return torch.cat([p.detach().reshape(-1) for p in params])


def test_powersgd_householder_trains_like_torch_qr(cpu_ext):
    """PowerSGD with the compiled Householder QR trains as with torch.linalg.qr
    (both are Householder QR with LAPACK's sign convention, so Q agrees to rounding)."""
    householder = _train_powersgd("householder")
    reference = _train_powersgd("torch_qr")
    assert (householder - reference).abs().max().item() <= 1e-5
