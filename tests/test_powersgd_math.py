"""PowerSGD math in one process (bagua_algos.compression.powersgd): the allreduce is the
identity, so these check the compression itself; tests/test_powersgd_algorithm.py
checks it across workers."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import given, settings, strategies as st

from bagua_algos.compression import powersgd as psgd
from bagua_algos.experiments.cifar_resnet import CifarResNet18


def identity(t):
    return None


def run(grads, rank=1, state=None, seed=0, rate=2.0, **options):
    """One step on copies of ``grads``; returns (updates, state, bytes)."""
    grads = [g.clone() for g in grads]
    plan = psgd.make_plan([g.shape for g in grads], rank, rate)
    if state is None:
        state = psgd.init_state(plan, seed, grads[0].dtype, grads[0].device, options.get("error_feedback", True))
    sent = psgd.compress_aggregate(plan, grads, state, psgd.PowerSGDOptions(**options), identity)
    return grads, state, sent


def low_rank_matrix(n, m, singular_values, generator):
    u, _ = torch.linalg.qr(torch.randn(n, len(singular_values), generator=generator, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(m, len(singular_values), generator=generator, dtype=torch.float64))
    return (u * torch.tensor(singular_values, dtype=torch.float64)) @ v.T


# --- Table 10 ---------------------------------------------------------------------------------
from bagua_algos.experiments.reproduce import TABLE_10  # noqa: E402  parameter → (matrix shape, compression × r), seed 001 Table 10


def test_resnet18_ratios_match_table_10():
    summary = psgd.compression_summary(CifarResNet18(), rank=1)
    layers = {layer["name"]: layer for layer in summary["layers"]}
    for name, (shape, ratio) in TABLE_10.items():
        layer = layers[name + ".weight"]
        assert layer["matrix_shape"] == shape and layer["compressed"], name
        assert round(layer["ratio"]) == ratio, (name, layer["ratio"])
    vectors = [layer for layer in summary["layers"] if not layer["compressed"]]
    assert all(len(layer["shape"]) == 1 for layer in vectors)
    assert round(sum(layer["uncompressed_bytes"] for layer in vectors) / 1000) == 38  # "38 KB"
    assert round(summary["total_ratio"]) == 243  # "Total 43 MB, 243/r"
    assert summary["total_uncompressed_bytes"] / 2**20 == pytest.approx(42.6, abs=0.1)
    # At rank r every matrix's ratio is the table's divided by r (min rate 1: all compressed).
    two = {layer["name"]: layer for layer in psgd.compression_summary(CifarResNet18(), 2, 1.0)["layers"]}
    for name, (_, ratio) in TABLE_10.items():
        assert two[name + ".weight"]["ratio"] * 2 == pytest.approx(layers[name + ".weight"]["ratio"])
    # The head (10 × 512, 9.8/r) stops being compressed once 9.8/r < min_compression_rate.
    eight = {layer["name"]: layer for layer in psgd.compression_summary(CifarResNet18(), 8)["layers"]}
    assert not eight["linear.weight"]["compressed"] and eight["layer4.1.conv2.weight"]["compressed"]


def test_summary_counts_match_the_live_bytes():
    model = torch.nn.Sequential(torch.nn.Linear(30, 20), torch.nn.Linear(20, 3))
    summary = psgd.compression_summary(model, rank=2)
    grads = [torch.randn_like(p) for p in model.parameters()]
    _, _, sent = run(grads, rank=2)
    assert sent.total == summary["total_compressed_bytes"]
    assert sent.p == 4 * 2 * 20 and sent.q == 4 * 2 * 30 and sent.uncompressed == 4 * (20 + 3 + 20 * 3)


def test_summary_refuses_bad_arguments():
    with pytest.raises(ValueError, match="rank must be"):
        psgd.compression_summary(torch.nn.Linear(2, 2), rank=0)
    with pytest.raises(ValueError, match="min_compression_rate must be"):
        psgd.compression_summary(torch.nn.Linear(2, 2), rank=1, min_compression_rate=0.5)


# --- exactness, warm start, error feedback --------------------------------------------------------
@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 12), m=st.integers(1, 12), extra=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_rank_at_least_min_dimension_is_exact(n, m, extra, seed):
    g = torch.Generator().manual_seed(seed)
    grad = torch.randn(n, m, generator=g, dtype=torch.float64)
    rank = min(n, m) + extra
    (update,), state, _ = run([grad], rank=rank, rate=0.0, error_feedback=True, orthogonalization="gram_schmidt")
    torch.testing.assert_close(update, grad, rtol=1e-9, atol=1e-9)
    assert float(state["error"].abs().max()) < 1e-9


@pytest.mark.parametrize("method", ["gram_schmidt", "cholesky_qr2", "torch_qr"])
def test_warm_start_converges_to_the_best_rank_r_approximation(method):
    g = torch.Generator().manual_seed(1)
    m = low_rank_matrix(40, 60, [8.0, 4.0, 2.0, 1.0, 0.5, 0.25], g).float()
    rank = 2
    u, s, vh = torch.linalg.svd(m.double())
    best = (u[:, :rank] * s[:rank]) @ vh[:rank]
    state = None
    for _ in range(40):  # subspace iteration: error ∝ (σ3/σ2)^k = 2^-k
        (update,), state, _ = run([m], rank=rank, state=state, error_feedback=False, orthogonalization=method)
    assert float(torch.linalg.norm(update.double() - best) / torch.linalg.norm(best)) < 1e-4
    # Without the warm start one step from a random Q is far from it.
    (cold,), _, _ = run([m], rank=rank, error_feedback=False, warm_start=False)
    assert float(torch.linalg.norm(cold.double() - best) / torch.linalg.norm(best)) > 1e-3


@settings(max_examples=15, deadline=None)
@given(steps=st.integers(1, 6), seed=st.integers(0, 2**16), rank=st.integers(1, 3))
def test_error_feedback_makes_updates_track_gradients(steps, seed, rank):
    """λ = 1: Σ_t update_t + e_T = Σ_t G_t (every bit of gradient is applied or kept)."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(7, 3, 2), (5,), (7, 6), (9, 4)]
    state = None
    applied = [torch.zeros(s, dtype=torch.float64) for s in shapes]
    given_ = [torch.zeros(s, dtype=torch.float64) for s in shapes]
    for _ in range(steps):
        grads = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
        updates, state, _ = run(grads, rank=rank, state=state, rate=1.0)
        for a, u in zip(applied, updates):
            a += u
        for t, gr in zip(given_, grads):
            t += gr
    plan = psgd.make_plan(shapes, rank, 1.0)
    for i, (a, t) in enumerate(zip(applied, given_)):
        if i in plan.error_offsets:
            off = plan.error_offsets[i]
            a = a + state["error"][off : off + a.numel()].view(a.shape)
        torch.testing.assert_close(a, t, rtol=1e-9, atol=1e-9)


def test_decay_scales_the_error_that_is_added_back():
    g = torch.Generator().manual_seed(3)
    first = [torch.randn(12, 10, generator=g)]
    second = [torch.randn(12, 10, generator=g)]
    _, state, _ = run(first, rank=1, error_decay=0.5)
    e1 = state["error"].clone()
    q = {k: v.clone() for k, v in state["q"].items()}
    (update,), state2, _ = run(second, rank=1, state=state, error_decay=0.5)
    # Same as no decay on G + 0.5·e with the same Q and no error.
    ref_state = {"q": q, "rng_state": state["rng_state"], "compressed_steps": 1}
    (ref,), _, _ = run([second[0] + 0.5 * e1.view(12, 10)], rank=1, state=ref_state, error_feedback=False)
    torch.testing.assert_close(update, ref)


# --- degenerate inputs ---------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["auto", "gram_schmidt", "cholesky_qr2", "torch_qr", "householder"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_zero_and_rank_deficient_gradients_give_no_nan(method, dtype):
    g = torch.Generator().manual_seed(0)
    zero = torch.zeros(16, 8, dtype=dtype)
    deficient = (torch.randn(16, 1, generator=g) @ torch.randn(1, 8, generator=g)).to(dtype)
    scalar = torch.tensor(2.5, dtype=dtype)
    single = torch.tensor([[-1.0]], dtype=dtype)
    state = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # householder without cuda_ext warns once
        for _ in range(3):
            updates, state, _ = run([zero, deficient, scalar, single], rank=4, state=state, rate=1.0,
                                    orthogonalization=method)
            assert all(u.dtype == dtype and torch.isfinite(u.float()).all() for u in updates)
            assert not updates[0].any()
            torch.testing.assert_close(updates[1].float(), deficient.float(), rtol=2e-2, atol=2e-2)
            assert updates[2] == scalar and updates[3] == single  # uncompressed, mean of one worker
            assert torch.isfinite(state["error"].float()).all()


def test_zero_gradient_does_not_freeze_the_warm_start():
    """A zero gradient makes Q zero; the zero columns are redrawn, so a later nonzero
    gradient is still approximated."""
    state = None
    _, state, _ = run([torch.zeros(6, 5)], rank=1, state=state, error_feedback=False)
    assert all(torch.linalg.vector_norm(q) > 0 for q in state["q"].values())
    grad = torch.outer(torch.arange(1.0, 7.0), torch.arange(1.0, 6.0))
    (update,), _, _ = run([grad], rank=1, state=state, error_feedback=False)
    torch.testing.assert_close(update, grad, rtol=1e-5, atol=1e-4)


def test_fp16_is_computed_in_fp32():
    g = torch.Generator().manual_seed(5)
    grad = torch.randn(32, 16, generator=g)
    (half,), _, sent = run([grad.half()], rank=2, error_feedback=False)
    (full,), _, _ = run([grad.half().float()], rank=2, error_feedback=False)
    assert half.dtype == torch.float16
    torch.testing.assert_close(half, full.half())
    assert sent.p == 4 * 32 * 2  # the factors travel in float32


# --- state -----------------------------------------------------------------------------------------
def test_initial_q_depends_only_on_the_seed():
    plan = psgd.make_plan([(8, 4), (8, 4), (3, 9)], 2, 1.0)
    a = psgd.init_state(plan, 7, torch.float32, "cpu", True)
    b = psgd.init_state(plan, 7, torch.float32, "cpu", True)
    c = psgd.init_state(plan, 8, torch.float32, "cpu", True)
    assert a["q"].keys() == {"8x4", "3x9"} and a["q"]["8x4"].shape == (2, 4, 2)
    assert all(torch.equal(a["q"][k], b["q"][k]) for k in a["q"])
    assert not torch.equal(a["q"]["8x4"], c["q"]["8x4"])
    assert psgd.stable_seed(1, "x") == psgd.stable_seed(1, "x") != psgd.stable_seed(1, "y")


def test_cold_start_draws_from_the_saved_generator():
    grads = [torch.randn(10, 6)]
    _, state, _ = run(grads, rank=1, warm_start=False, error_feedback=False)
    saved = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in state.items()}
    saved["q"] = {k: v.clone() for k, v in state["q"].items()}
    (a,), _, _ = run(grads, rank=1, state=state, warm_start=False, error_feedback=False)
    (b,), _, _ = run(grads, rank=1, state=saved, warm_start=False, error_feedback=False)
    assert torch.equal(a, b)


def test_error_in_grad_mode_matches_the_separate_buffer():
    g = torch.Generator().manual_seed(9)
    shapes = [(10, 8), (4,), (10, 8)]
    plan = psgd.make_plan(shapes, 2, 1.0)
    sep = psgd.init_state(plan, 0, torch.float32, "cpu", True)
    inside = psgd.init_state(plan, 0, torch.float32, "cpu", False)
    held = [torch.zeros(s) for s in shapes]  # error_in_grad: the gradient buffers
    for _ in range(3):
        grads = [torch.randn(s, generator=g) for s in shapes]
        a = [x.clone() for x in grads]
        psgd.compress_aggregate(plan, a, sep, psgd.PowerSGDOptions(), identity)
        for i in plan.uncompressed:
            held[i].zero_()
        for h, x in zip(held, grads):
            h += x
        out = {i: torch.empty(shapes[i]) for i in plan.compressed}
        psgd.compress_aggregate(plan, held, inside, psgd.PowerSGDOptions(error_in_grad=True), identity, out=out)
        for i in plan.compressed:
            torch.testing.assert_close(out[i], a[i])
            off = plan.error_offsets[i]
            torch.testing.assert_close(held[i], sep["error"][off : off + 80].view(10, 8))
        torch.testing.assert_close(held[1], a[1])


def test_plan_groups_matrices_by_shape():
    plan = psgd.make_plan([(4, 3, 3), (7,), (4, 9), (2, 2), (), (5, 9)], 1, 2.0)
    assert [(g.key, g.members) for g in plan.groups] == [("4x9", (0, 2)), ("5x9", (5,))]
    assert plan.uncompressed == (1, 3, 4)
    assert plan.p_numel == 2 * 4 + 5 and plan.q_numel == 3 * 9
    assert plan.error_offsets == {0: 0, 2: 36, 5: 72} and plan.error_numel == 117
    assert psgd.should_compress((512, 512, 3, 3), 4, 2.0) and not psgd.should_compress((10, 512), 8, 2.0)
    assert math.isclose(512 * 4608 / (5120 * 1), 460.8)


# --- constructor checks beyond the probes (tests/bad_input_cases.py has the main ones) ------
@pytest.mark.parametrize("kwargs,error,match", [
    ({"rank": -2}, ValueError, "rank must be an int >= 1, got -2"),
    ({"error_decay": -0.1}, ValueError, "error_decay must be a finite number in [0.0, 1.0], got -0.1"),
    ({"start_iter": 1.5}, ValueError, "start_iter must be an int >= 0, got 1.5"),
    ({"warm_start": "false"}, TypeError, "warm_start must be True or False"),
    ({"async_error": "half"}, ValueError, "async_error must be one of [None, 'full', 'adaptive']"),
    ({"nesterov": -1.0}, ValueError, "nesterov must be a finite number >= 0.0"),
    ({"nesterov": 0.1, "error_feedback": False}, ValueError, "nesterov works on the error-feedback buffer"),
    ({"error_in_grad": True, "error_feedback": False}, ValueError, "error_in_grad works on the error-feedback buffer"),
    ({"error_in_grad": True, "async_error": "full"}, ValueError, "cannot be combined"),
    ({"seed": 1.0}, ValueError, "seed must be an int"),
])
def test_constructor_refuses_bad_arguments(kwargs, error, match):
    from bagua_algos.algorithms import PowerSGDAlgorithm

    with pytest.raises(error) as info:
        PowerSGDAlgorithm(**kwargs)
    assert match in str(info.value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_state_and_step_stay_on_the_gradient_device():
    grads = [torch.randn(64, 32, device="cuda", dtype=torch.float16), torch.randn(32, device="cuda")]
    plan = psgd.make_plan([g.shape for g in grads], 2, 2.0)
    state = psgd.init_state(plan, 0, torch.float16, "cuda", True)
    assert state["q"]["64x32"].device.type == "cuda" and state["error"].device.type == "cuda"
    cpu_state = psgd.init_state(plan, 0, torch.float16, "cpu", True)
    assert state["q"]["64x32"].shape == cpu_state["q"]["64x32"].shape
    psgd.compress_aggregate(plan, grads, state, psgd.PowerSGDOptions(), identity)
    assert grads[0].dtype == torch.float16 and torch.isfinite(grads[0].float()).all()


def test_benchmark_script_runs_tiny():
    """benchmarks/powersgd_benchmark.py end to end, tiny: its table, not its timings."""
    from bagua_algos.compression import orthogonalization
    from subprocesses import REPO, run_python

    orthogonalization.prepare("auto", "cpu")  # a first build of cuda_ext (~70 s) happens here, not under the timeout
    # On CPU also where a GPU is visible (torch's hook runs there under the benchmark's guard).
    code, out, err = run_python([REPO / "benchmarks" / "powersgd_benchmark.py", "compress", "--device", "cpu",
                                 "--ranks", "1", "--steps", "1", "--warmup", "0"], timeout=120)
    assert code == 0, err[-2000:]
    (row,) = [line.split() for line in out.splitlines() if line.strip().startswith("1 ")]
    assert float(row[1]) > 0 and float(row[2]) > 0 and float(row[3]) == pytest.approx(float(row[1]) / float(row[2]), rel=0.01)


# --- at the GPU's pace: batched products, CPU generator, no host waits ----------------
def _bucket_views(shapes, seed, dtype=torch.float32, gap=0):
    """Gradients as views into one flat buffer (a flattened bucket), ``gap`` unused
    elements after each tensor (gap > 0 and varying sizes make same-shape members
    unequally spaced, so the _foreach path runs instead of the strided view)."""
    g = torch.Generator().manual_seed(seed)
    sizes = [math.prod(s) for s in shapes]
    flat = torch.zeros(sum(sizes) + gap * len(shapes) * (len(shapes) + 1), dtype=dtype)
    views, offset = [], 0
    for k, (shape, size) in enumerate(zip(shapes, sizes)):
        views.append(flat[offset : offset + size].view(shape))
        views[-1].copy_(torch.randn(shape, generator=g, dtype=torch.float64).to(dtype))
        offset += size + gap * k
    return flat, views


MODES = {
    "default": {},
    "no_error_feedback": dict(error_feedback=False),
    "decay": dict(error_decay=0.5),
    "cold": dict(warm_start=False),
    "error_in_grad": dict(error_in_grad=True),
}
SHAPES = [(12, 3, 2, 2), (7,), (12, 12), (12, 3, 2, 2), (5, 9), (12, 3, 2, 2), (3,), (12, 12)]


def _steps(layout, mode, dtype, steps=3, rank=2):
    options = psgd.PowerSGDOptions(**MODES[mode])
    plan = psgd.make_plan(SHAPES, rank, 1.0)
    state = psgd.init_state(plan, 5, dtype, "cpu", options.error_feedback and not options.error_in_grad)
    held = None
    outputs = []
    for step in range(steps):
        if layout == "independent":
            g = torch.Generator().manual_seed(100 + step)
            grads = [torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for s in SHAPES]
        else:
            _, grads = _bucket_views(SHAPES, 100 + step, dtype, gap=0 if layout == "equally_spaced" else 1)
        out = None
        if options.error_in_grad:
            if held is None:
                held = [torch.zeros(s, dtype=dtype) for s in SHAPES]
            for i in plan.uncompressed:
                held[i].zero_()
            for h, x in zip(held, grads):
                h += x
            approx = torch.empty(plan.error_numel, dtype=dtype)
            out = {i: approx[plan.error_offsets[i] : plan.error_offsets[i] + math.prod(SHAPES[i])].view(SHAPES[i])
                   for i in plan.compressed}
            grads = held
        psgd.compress_aggregate(plan, grads, state, options, identity, out=out)
        outputs.append([(out[i] if out is not None and i in out else grads[i]).clone() for i in range(len(SHAPES))])
    return outputs, state


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_batched_products_and_layouts_give_the_same_steps(monkeypatch, mode, dtype):
    """Per-matrix products (CPU) and one bmm per shape group (the GPU's path, forced
    here on CPU), gradients read through one strided view, through _foreach ops, or as
    separate tensors: the same updates, Q's and errors to rounding."""
    reference, ref_state = _steps("independent", mode, dtype)
    tolerance = {torch.float16: 2e-3, torch.float32: 1e-5, torch.float64: 1e-12}[dtype]
    for batched in (False, True):
        monkeypatch.setattr(psgd, "BATCHED_ON_CPU", batched)
        for layout in ("equally_spaced", "unequally_spaced", "independent"):
            got, state = _steps(layout, mode, dtype)
            for step_got, step_ref in zip(got, reference):
                for a, b in zip(step_got, step_ref):
                    torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance)
            for key in ref_state["q"]:
                torch.testing.assert_close(state["q"][key], ref_state["q"][key], rtol=tolerance, atol=tolerance)
            if "error" in ref_state:
                torch.testing.assert_close(state["error"], ref_state["error"], rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("batched", [False, True])
def test_step_math_on_a_stacked_worker_dimension(monkeypatch, batched):
    """The math of one step on plain tensors, workers stacked along a leading dimension
    and the allreduce a mean over it (what a vectorised form of the algorithm does):
    every worker ends with the factors of one step on mean_w(A) (Lemma 3), and the
    update and error functions agree with compress_aggregate's."""
    monkeypatch.setattr(psgd, "BATCHED_ON_CPU", batched)
    g = torch.Generator().manual_seed(11)
    workers, shapes = 3, [(2, 9, 7), (1, 5, 12)]  # (b, n, m) per shape group
    a = [torch.randn(workers, *shape, generator=g, dtype=torch.float64) for shape in shapes]
    q = [torch.randn(b, m, 2, generator=g, dtype=torch.float64) for b, _, m in shapes]
    stacked_q = [q_k.expand(workers, *q_k.shape).clone() for q_k in q]
    extra = torch.arange(workers, dtype=torch.float64).view(workers, 1)

    def mean_over_workers(t):
        t.copy_(t.mean(0, keepdim=True).expand_as(t))

    stacked = psgd.power_iteration(a, stacked_q, mean_over_workers, "gram_schmidt", p_extra=extra)
    single = psgd.power_iteration([a_k.mean(0) for a_k in a], q, lambda t: None, "gram_schmidt")
    assert torch.equal(extra, torch.full((workers, 1), 1.0, dtype=torch.float64))
    assert stacked.p_bytes == workers * 8 * (2 * 9 * 2 + 5 * 2 + 1) and stacked.q_bytes == workers * 8 * (2 * 7 * 2 + 12 * 2)
    for w in range(workers):
        for ps, p1, qs, q1 in zip(stacked.p, single.p, stacked.q, single.q):
            torch.testing.assert_close(ps[w], p1, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(qs[w], q1, rtol=1e-12, atol=1e-12)
    for a_k, p_k, q_k in zip(a, stacked.p, stacked.q):
        update = psgd.reconstruct(p_k, q_k)
        torch.testing.assert_close(update, p_k @ q_k.transpose(-2, -1), rtol=1e-12, atol=1e-12)
        error = psgd.subtract_reconstruction_(a_k.clone(), p_k, q_k)
        torch.testing.assert_close(error, a_k - update, rtol=1e-12, atol=1e-12)
    zero_column = stacked.q[0].clone()
    zero_column[..., 1] = 0
    kept = psgd.keep_nonzero_columns(zero_column, stacked_q[0])
    assert torch.equal(kept[..., 1], stacked_q[0][..., 1]) and torch.equal(kept[..., 0], stacked.q[0][..., 0])


def test_same_shape_gradients_of_a_bucket_are_read_through_one_view():
    equal = [(6, 4), (3,), (6, 2, 2), (3,), (6, 4)]  # (6, 2, 2) is a 6 × 4 matrix too
    plan = psgd.make_plan(equal, 2, 1.0)
    (group,) = plan.groups
    assert group.members == (0, 2, 4)
    _, views = _bucket_views(equal, 0)
    batch = psgd._batch_view([views[i].view(6, 4) for i in group.members], 6, 4)
    assert batch is not None and batch.shape == (3, 6, 4) and batch.stride() == (27, 4, 1)
    assert torch.equal(batch[1], views[2].view(6, 4)) and batch.data_ptr() == views[0].data_ptr()
    _, unequal = _bucket_views([(6, 4), (3,), (6, 4), (5,), (6, 4)], 0)
    assert psgd._batch_view([unequal[i] for i in (0, 2, 4)], 6, 4) is None  # spacings 27 and 29
    assert psgd._batch_view([torch.zeros(6, 4), torch.zeros(6, 4)], 6, 4) is None  # two allocations
    assert psgd._batch_view([views[0].view(6, 4)], 6, 4).shape == (1, 6, 4)


def test_error_buffer_is_laid_out_by_shape_group():
    plan = psgd.make_plan([(4, 9), (5, 9), (4, 9), (3,)], 1, 1.0)
    assert [(g.key, g.members, g.e_offset) for g in plan.groups] == [("4x9", (0, 2), 0), ("5x9", (1,), 72)]
    assert plan.error_offsets == {0: 0, 2: 36, 1: 72} and plan.error_numel == 117


def test_initial_q_comes_from_a_cpu_generator():
    """The initial Q's are drawn on the CPU, group after group, whatever the device, so
    CPU and CUDA runs start from the same Q's; the generator state is a CPU one."""
    plan = psgd.make_plan([(8, 4), (8, 4), (3, 9)], 2, 1.0)
    state = psgd.init_state(plan, 7, torch.float32, "cpu", True)
    g = torch.Generator().manual_seed(7)
    for group in plan.groups:
        assert torch.equal(state["q"][group.key], torch.randn(len(group.members), group.m, group.r, generator=g))
    assert torch.equal(state["rng_state"], g.get_state())
    wrong = dict(state, rng_state=torch.zeros(16, dtype=torch.uint8))  # a CUDA generator's state
    with pytest.raises(ValueError, match="not a CPU generator state"):
        run([torch.randn(8, 4)], rank=2, rate=1.0, state=dict(wrong, q={"8x4": torch.randn(1, 4, 2)}), warm_start=False)


def test_warm_start_keeps_the_previous_value_of_a_zero_column():
    """A Q column that comes out exactly zero keeps its previous value (no redraw: no
    host round trip, the same on every worker and device)."""
    grad = torch.zeros(6, 5)
    grad[:, 0] = torch.arange(1.0, 7.0)  # rank one: with r = 2 the second P column is dependent
    plan = psgd.make_plan([grad.shape], 2, 1.0)
    initial = psgd.init_state(plan, 0, torch.float32, "cpu", False)["q"]["6x5"].clone()
    _, state, _ = run([grad], rank=2, rate=1.0, error_feedback=False, orthogonalization="gram_schmidt")
    q = state["q"]["6x5"]
    assert torch.equal(q[..., 1], initial[..., 1]) and not torch.equal(q[..., 0], initial[..., 0])
    _, state, _ = run([torch.zeros(6, 5)], rank=2, rate=1.0, state=state, error_feedback=False)
    assert torch.equal(state["q"]["6x5"], q)  # every column zero: all kept
    assert all(torch.linalg.vector_norm(q, dim=-2).flatten() > 0)


def test_torch_hook_anchor_runs_on_cpu_when_cuda_is_visible(monkeypatch):
    """torch's powerSGD_hook calls torch.cuda.synchronize(device) when
    CUDA is available, which torch refuses for a CPU device. The benchmark's guard (also
    used by tests/test_powersgd_algorithm.py) lets it run; simulated here."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd

    from bagua_algos.experiments.powersgd_benchmark import HookBucket, guard_cuda_synchronize_for_cpu

    def strict_synchronize(device=None):  # what torch does on a machine with a GPU
        if device is not None and torch.device(device).type != "cuda":
            raise ValueError(f"Expected a cuda device, but got: {device}")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", strict_synchronize)
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, group=None, async_op=False: _Done(tensor))
    params = [torch.nn.Parameter(torch.randn(16, 8)), torch.nn.Parameter(torch.randn(8))]
    buffer = torch.randn(16 * 8 + 8)

    def hook():
        state = torch_psgd.PowerSGDState(process_group=_Group(), matrix_approximation_rank=1, start_powerSGD_iter=2,
                                         min_compression_rate=1.0, use_error_feedback=True, warm_start=True)
        state.iter = 2
        return torch_psgd.powerSGD_hook(state, HookBucket(buffer.clone(), params)).wait()

    with pytest.raises((RuntimeError, ValueError), match="Expected a cuda device"):
        hook()
    with guard_cuda_synchronize_for_cpu():
        result = hook()
    assert torch.isfinite(result).all()
    assert torch.cuda.synchronize is strict_synchronize  # restored


class _Group:
    def size(self):
        return 1


class _Done:
    def __init__(self, tensor):
        self.tensor = tensor

    def get_future(self):
        future = torch.futures.Future()
        future.set_result([self.tensor])
        return future


# --- CUDA (GPU machines only) --------------------------------------------------------------------
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
@pytest.mark.parametrize("mode", list(MODES))
def test_cuda_and_cpu_give_the_same_steps_from_one_seed(mode):
    """The Q's are drawn on the CPU, so one seed gives the same steps
    on CPU and CUDA up to rounding (CPU's "auto" is torch_qr / Gram–Schmidt and CUDA's
    the compiled Householder QR; the update P Qᵀ does not depend on the Q's signs)."""
    options = psgd.PowerSGDOptions(**MODES[mode])
    plan = psgd.make_plan(SHAPES, 2, 1.0)
    error_buffer = options.error_feedback and not options.error_in_grad
    states = {d: psgd.init_state(plan, 3, torch.float32, d, error_buffer) for d in ("cpu", "cuda")}
    for key in states["cpu"]["q"]:
        assert torch.equal(states["cpu"]["q"][key], states["cuda"]["q"][key].cpu())
    held = {d: [torch.zeros(s, device=d) for s in SHAPES] for d in ("cpu", "cuda")}
    for step in range(4):
        results = {}
        for device in ("cpu", "cuda"):
            flat = _bucket_views(SHAPES, 200 + step)[0].to(device)
            grads, offset = [], 0
            for s in SHAPES:
                grads.append(flat[offset : offset + math.prod(s)].view(s))
                offset += math.prod(s)
            out = None
            if options.error_in_grad:
                for i in plan.uncompressed:
                    held[device][i].zero_()
                for h, x in zip(held[device], grads):
                    h += x
                grads = held[device]
                out = {i: torch.empty(SHAPES[i], device=device) for i in plan.compressed}
            psgd.compress_aggregate(plan, grads, states[device], options, identity, out=out)
            results[device] = [(out[i] if out is not None and i in out else grads[i]).cpu() for i in range(len(SHAPES))]
        for a, b in zip(results["cpu"], results["cuda"]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@needs_cuda
@pytest.mark.parametrize("mode", list(MODES))
def test_cuda_step_never_waits_for_the_gpu(mode):
    """With torch's sync debug mode set to "error", any host
    synchronization inside a step (.item(), a blocking copy, nonzero, ...) raises."""
    options = psgd.PowerSGDOptions(**MODES[mode])
    plan = psgd.make_plan(SHAPES, 4, 1.0)
    state = psgd.init_state(plan, 0, torch.float32, "cuda", options.error_feedback and not options.error_in_grad)
    flat, _ = _bucket_views(SHAPES, 0)
    flat = flat.cuda()
    grads, offset = [], 0
    for s in SHAPES:
        grads.append(flat[offset : offset + math.prod(s)].view(s))
        offset += math.prod(s)
    out = {i: torch.empty(SHAPES[i], device="cuda") for i in plan.compressed} if options.error_in_grad else None
    extra = torch.zeros(1, device="cuda")
    psgd.compress_aggregate(plan, grads, state, options, identity, out=out, p_extra=extra)  # warm-up: ext loaded
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            psgd.compress_aggregate(plan, grads, state, options, identity, out=out, p_extra=extra)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.isfinite(flat).all()


@needs_cuda
def test_cuda_kernels_per_bucket_grow_with_shape_groups_not_matrices():
    """One product per shape group (not per matrix) and one
    orthogonalization launch per bucket (cuda_ext): a bucket of 4 shape groups launches
    as many kernels with 8 matrices as with 24."""
    import cuda_ext
    from torch.profiler import ProfilerActivity, profile

    if not cuda_ext.is_available("cuda"):
        pytest.skip("cuda_ext cannot be built here (the torch fallback launches more kernels)")

    def kernels(repeats):
        shapes = [(64, 32, 3, 3), (64,), (128, 64, 3, 3), (128,), (256, 128), (512, 256)] * repeats
        plan = psgd.make_plan(shapes, 4, 2.0)
        assert len(plan.groups) == 4 and len(plan.compressed) == 4 * repeats
        state = psgd.init_state(plan, 0, torch.float32, "cuda", True)
        flat = torch.randn(sum(math.prod(s) for s in shapes), device="cuda")
        grads, offset = [], 0
        for s in shapes:
            grads.append(flat[offset : offset + math.prod(s)].view(s))
            offset += math.prod(s)
        options = psgd.PowerSGDOptions()
        psgd.compress_aggregate(plan, grads, state, options, identity)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            psgd.compress_aggregate(plan, grads, state, options, identity)
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        assert sum("orthogonalize_kernel" in name for name in names) == 1, names
        return names

    few, many = kernels(2), kernels(6)
    assert len(many) <= len(few) + 2, (few, many)
    assert len(few) <= 12 * 4 + 12, few


@needs_cuda
def test_benchmark_script_runs_tiny_on_cuda():
    """The benchmark on the GPU (the first run may build cuda_ext: a long timeout)."""
    from subprocesses import REPO, run_python

    code, out, err = run_python([REPO / "benchmarks" / "powersgd_benchmark.py", "compress", "--device", "cuda",
                                 "--ranks", "1,8", "--steps", "1", "--warmup", "1"], timeout=900)
    assert code == 0, err[-2000:]
    assert "device: " in out and "CUDA" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:2] in ("1 ", "8 ")]
    assert len(rows) == 2 and all(float(row[3]) > 0 for row in rows)
