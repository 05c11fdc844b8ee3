"""Seed 001's linear compressors against oracles written here from the seed's definitions:
best-approximation PowerSGD (Table 2, Appendix G.7), the unbiased rank-r compressor
(§4.1, Table 1), Random Block and Random K (Table 4, Appendix G.1–G.2), each as a Bagua
algorithm and as a DDP comm hook on 3 gloo workers (one spawn for every check).

The workers' parameters stay fixed (no optimizer step), so each step's gradients are
fresh ones of the same model; each worker returns its own raw gradients (from an unwrapped
twin), the aggregated gradients the algorithm or hook left, and what each bucket held
before the step (its tensors' names in order and its generator's state). The oracles take
the draws from that state (a bucket the DDP hook starts afresh: a generator seeded
``stable_seed(seed, "ddp-bucket-<index>")``, errors zero) through ``random_sketch.draw`` (the one rule for what is drawn;
its statistics are tested below), and do the rest, sizes included, from the seed:

- unbiased low rank: M → M U, U ∈ R^{m×r}, E[U Uᵀ] = I; update mean_w(M_w U) Uᵀ; matrices
  PowerSGD compresses (n·m ≥ 2(n + m)r), the rest averaged whole;
- Random Block / Random K, error feedback as Algorithm 2: A_w = G_w + e_w, S_w = A_w(I),
  e_w ← A_w with I zeroed, update zero but mean_w S_w on I; I is b = (n + m)·r consecutive
  entries from the drawn start (wrapping) or the drawn b indices;
- best approximation: many subspace iterations converge to the truncated SVD of the mean
  gradient (Theorem I), the bytes growing k-fold.
"""

from __future__ import annotations

import math

import pytest
import torch

from bagua_algos.compression import random_sketch

from bagua_algos.experiments.gloo_workers import run_workers

WORKERS = 3
BATCH = 4
STEPS = 3
SKETCHES = {
    "unbiased_rank2": ("unbiased_low_rank", {"rank": 2, "seed": 4}),
    "unbiased_rank1_rate1": ("unbiased_low_rank", {"rank": 1, "min_compression_rate": 1.0}),
    "block_rank1": ("random_block", {"powersgd_rank": 1, "seed": 2}),
    "block_ratio5_no_ef": ("random_block", {"compression_ratio": 5.0, "error_feedback": False}),
    "k_rank2": ("random_k", {"powersgd_rank": 2, "seed": 1}),
    "k_ratio3": ("random_k", {"compression_ratio": 3}),
}
BEST_ITERATIONS = 100  # (σ3/σ2)^(2k) ≤ 0.88^200: converged to float32 rounding on these gradients


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Tanh(), torch.nn.Linear(24, 8))


def batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(BATCH, 16, generator=g), torch.randn(BATCH, 8, generator=g) + rank


def loss(model, data):
    x, y = data
    return ((model(x) - y) ** 2).mean()


def _grads(model):
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def _run_bagua(rank, algorithm):
    """Steps of ``algorithm`` with fixed parameters: per step the raw and aggregated
    gradients, each bucket's (names, generator state) before it, and the byte counters."""
    model, twin = make_model(), make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.with_bagua([opt], algorithm)
    impl = model.bagua_algorithm
    steps = []
    for step in range(1, STEPS + 1):
        buckets = [([t.bagua_tensor_name for t in b.tensors], b.state.get("rng_state", torch.empty(0)).clone())
                   for b in model.bagua_buckets]
        for m in (model, twin):
            m.zero_grad()
            loss(m, batch(step, rank)).backward()
        steps.append({"raw": _grads(twin), "out": _grads(model), "buckets": buckets,
                      "bytes": (impl.bytes_last_step, impl.uncompressed_bytes_last_step)})
    model.bagua_ddp.detach()
    return steps


def _run_ddp(rank, state, hook):
    """The same through torch DDP with ``hook``; buckets as seen by the hook."""
    from torch.nn.parallel import DistributedDataParallel

    model, twin = DistributedDataParallel(make_model()), make_model()
    names = {id(p): n for n, p in model.module.named_parameters()}
    seen = []

    def recording(state_, bucket):
        index = bucket.index()
        held = state_.buckets.get(index, {})
        # None: the hook starts this bucket afresh (new, or DDP rebuilt it with another layout)
        fresh = held.get("plan_shapes") != [list(p.shape) for p in bucket.parameters()]
        seen.append(([names[id(p)] for p in bucket.parameters()], None if fresh else held["rng_state"].clone()))
        return hook(state_, bucket)

    model.register_comm_hook(state, recording)
    steps = []
    for step in range(1, STEPS + 1):
        seen.clear()
        for m in (model, twin):
            m.zero_grad()
            loss(m, batch(step, rank)).backward()
        raw = _grads(twin)
        out = {n.removeprefix("module."): g for n, g in _grads(model).items()}
        steps.append({"raw": raw, "out": out, "buckets": list(seen), "bytes": (state.bytes_last_step, None)})
    return steps


def _train(model, opt, rank, steps):
    for step in steps:
        opt.zero_grad()
        loss(model, batch(step, rank)).backward()
        opt.step()


def _resume_and_unflattened(rank, make_algorithm):
    """(resumed from a checkpoint after step 2 equals the run, unflattened buckets train
    as flattened ones): bit for bit, the generator and the errors being in bucket.state."""
    import copy

    def wrapped(a, **kwargs):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        return model.with_bagua([opt], a, **kwargs), opt

    model, opt = wrapped(make_algorithm())
    _train(model, opt, rank, (1, 2))
    checkpoint = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "bagua": model.bagua_state_dict()})
    _train(model, opt, rank, (3, 4))
    resumed, resumed_opt = wrapped(make_algorithm())
    resumed.load_state_dict(checkpoint["model"])
    resumed_opt.load_state_dict(checkpoint["opt"])
    resumed.load_bagua_state_dict(checkpoint["bagua"])
    _train(resumed, resumed_opt, rank, (3, 4))
    unflat, unflat_opt = wrapped(make_algorithm(), do_flatten=False)
    _train(unflat, unflat_opt, rank, (1, 2, 3, 4))
    return (all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed.parameters())),
            all(torch.equal(a, b) for a, b in zip(model.parameters(), unflat.parameters())),
            not torch.equal(model[0].weight, make_model()[0].weight))


def _checks(rank, n):
    from bagua_algos import Algorithm
    from bagua_algos.algorithms import PowerSGDAlgorithm
    from bagua_algos.ddp_hooks import PowerSGDHookState, RandomSketchHookState, powersgd_hook, random_sketch_hook

    out = {}
    for label, (name, kwargs) in SKETCHES.items():
        out[label] = _run_bagua(rank, Algorithm.init(name, **kwargs))
        out[label + "_ddp"] = _run_ddp(rank, RandomSketchHookState(Algorithm.init(name, **kwargs)), random_sketch_hook)
    out["resume"] = {name: _resume_and_unflattened(rank, lambda: Algorithm.init(name, **kwargs))
                     for name, kwargs in (("random_block", {"compression_ratio": 3}), ("random_k", {}),
                                          ("unbiased_low_rank", {"rank": 2}))}
    best = dict(rank=2, warm_start=False, error_feedback=False, min_compression_rate=1.0)
    out["best"] = _run_bagua(rank, PowerSGDAlgorithm(power_iterations=BEST_ITERATIONS, **best))
    out["one_iteration"] = _run_bagua(rank, PowerSGDAlgorithm(**best))
    out["best_ddp"] = _run_ddp(rank, PowerSGDHookState(power_iterations=BEST_ITERATIONS, **best), powersgd_hook)
    return out


@pytest.fixture(scope="module")
def results():
    return run_workers(_checks, WORKERS, timeout=150)


# --- the oracles ------------------------------------------------------------------------------
def _matrix(shape):
    return (shape[0], math.prod(shape[1:])) if len(shape) >= 2 else None


def _powersgd_compresses(shape, r, rate=2.0):
    nm = _matrix(shape)
    return nm is not None and nm[0] * nm[1] >= rate * (nm[0] + nm[1]) * min(r, *nm)


def _seed_sizes(name, kwargs, shapes):
    """Values each tensor sends, from the seed (and the ratio's ceil(numel / c))."""
    sizes, rate = [], kwargs.get("min_compression_rate", 2.0)
    for shape in shapes:
        numel = math.prod(shape)
        if name == "unbiased_low_rank":
            r = kwargs.get("rank", 1)
            sizes.append(shape[0] * min(r, *_matrix(shape)) if _powersgd_compresses(shape, r, rate) else numel)
        elif "compression_ratio" in kwargs:
            sizes.append(min(numel, math.ceil(numel / kwargs["compression_ratio"])))
        else:
            r = kwargs.get("powersgd_rank", 1)
            sizes.append(min(numel, sum(_matrix(shape)) * min(r, *_matrix(shape)))
                         if _powersgd_compresses(shape, r, rate) else numel)
    return sizes


def _oracle(name, kwargs, runs, dtype_size=4):
    """Per step: {parameter: the update every worker must hold} and the bytes sent."""
    from bagua_algos import Algorithm

    algorithm = Algorithm.init(name, **kwargs)
    error_feedback = algorithm.error_feedback
    shapes_of = {n: tuple(g.shape) for n, g in runs[0][0]["raw"].items()}
    errors = [{n: torch.zeros(math.prod(s)) for n, s in shapes_of.items()} for _ in runs]
    expected = []
    for t in range(STEPS):
        update, sent = {}, 0
        for index, (names, rng_state) in enumerate(runs[0][t]["buckets"]):
            shapes = [shapes_of[n] for n in names]
            plan = algorithm.plan(shapes)
            assert list(plan.sizes) == _seed_sizes(name, kwargs, shapes)
            if rng_state is None:  # the hook started the bucket afresh: errors too
                for w in range(len(runs)):
                    for tensor in names:
                        errors[w][tensor].zero_()
            state = {"rng_state": rng_state} if rng_state is not None else \
                random_sketch.init_state(_ddp_seed(kwargs, index))
            draws = random_sketch.draw(plan, state, "cpu", torch.float32)
            for tensor, shape, size, chosen in zip(names, shapes, plan.sizes, draws):
                sent += size * dtype_size
                a = []
                for w, run in enumerate(runs):
                    g = run[t]["raw"][tensor].reshape(-1)
                    a.append(g + errors[w][tensor] if error_feedback else g.clone())
                if chosen is None:  # sent whole: the mean
                    update[tensor] = torch.stack(a).mean(0).view(shape)
                    for w in range(len(runs)):
                        errors[w][tensor].zero_()
                    continue
                numel = math.prod(shape)
                if name == "unbiased_low_rank":
                    n, m = _matrix(shape)
                    u = chosen
                    sketches = [a_w.view(n, m) @ u for a_w in a]
                    update[tensor] = (torch.stack(sketches).mean(0) @ u.t()).view(shape)
                    for w in range(len(runs)):
                        errors[w][tensor] = a[w] - (sketches[w] @ u.t()).reshape(-1)
                    continue
                if name == "random_block":
                    index = (chosen + torch.arange(size)) % numel
                else:
                    index = chosen
                    assert index.numel() == size and index.unique().numel() == size
                values = torch.stack([a_w[index] for a_w in a]).mean(0)
                full = torch.zeros(numel)
                full[index] = values
                update[tensor] = full.view(shape)
                for w in range(len(runs)):
                    e = a[w].clone()
                    e[index] = 0
                    errors[w][tensor] = e
        expected.append((update, sent))
    return expected


@pytest.mark.parametrize("label", list(SKETCHES))
@pytest.mark.parametrize("through", ["bagua", "ddp"])
def test_sketch_equals_its_oracle_on_every_worker(results, label, through):
    name, kwargs = SKETCHES[label]
    runs = [r[label if through == "bagua" else label + "_ddp"] for r in results]
    expected = _oracle(name, kwargs, runs)
    for t, (update, sent) in enumerate(expected):
        for w, run in enumerate(runs):
            for tensor, value in update.items():
                torch.testing.assert_close(run[t]["out"][tensor], value, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{label} {through} step {t + 1} worker {w} {tensor}: {m}")
            assert run[t]["bytes"][0] == sent
            if through == "bagua":
                numel = sum(v.numel() for v in update.values())
                assert run[t]["bytes"][1] == 4 * numel
    # the compression is real: some update differs from the plain mean
    raw_mean = {k: torch.stack([run[0]["raw"][k] for run in runs]).mean(0) for k in expected[0][0]}
    assert any(not torch.allclose(expected[0][0][k], raw_mean[k]) for k in raw_mean)


def _ddp_seed(kwargs, index):
    from bagua_algos.compression.powersgd import stable_seed

    return stable_seed(kwargs.get("seed", 0), f"ddp-bucket-{index}")


@pytest.mark.parametrize("run", ["best", "best_ddp"])
def test_many_power_iterations_give_the_best_rank_r_approximation_of_the_mean(results, run):
    """Seed 001 Table 2's "best approximation": subspace iterations without warm start
    converge to the rank-2 truncated SVD of the mean gradient (Theorem I)."""
    runs = [r[run] for r in results]
    for t in range(STEPS):
        for tensor, g in runs[0][t]["raw"].items():
            mean = torch.stack([r[t]["raw"][tensor] for r in runs]).double().mean(0)
            if mean.dim() == 2:
                u, s, vh = torch.linalg.svd(mean, full_matrices=False)
                mean = (u[:, :2] * s[:2]) @ vh[:2]
            for r in runs:
                torch.testing.assert_close(r[t]["out"][tensor].double(), mean, rtol=1e-4, atol=1e-5)


def test_bytes_grow_with_the_power_iterations(results):
    for r in results:
        for best, one in zip(r["best"], r["one_iteration"]):
            (best_sent, plain), (one_sent, plain_again) = best["bytes"], one["bytes"]
            assert plain == plain_again
            vectors = 4 * (24 + 8)  # the biases, sent whole once
            assert best_sent - vectors == BEST_ITERATIONS * (one_sent - vectors) > 0


def test_one_iteration_is_not_yet_the_best_approximation(results):
    """The check above is not empty: one iteration from a random Q is off the SVD."""
    runs = [r["one_iteration"] for r in results]
    mean = torch.stack([r[0]["raw"]["0.weight"] for r in runs]).double().mean(0)
    u, s, vh = torch.linalg.svd(mean, full_matrices=False)
    best = (u[:, :2] * s[:2]) @ vh[:2]
    assert (runs[0][0]["out"]["0.weight"].double() - best).abs().max() > 1e-3


# --- the draws' statistics (single process) ----------------------------------------------------
def _many_draws(method, shape, count, **kwargs):
    plan = random_sketch.make_plan(method, [shape], **kwargs)
    state = random_sketch.init_state(7)
    return plan, [random_sketch.draw(plan, state, "cpu", torch.float32)[0] for _ in range(count)]


def test_unbiased_u_has_identity_second_moment():
    _, us = _many_draws("unbiased_low_rank", (40, 6), 4000, rank=2)
    second = torch.stack([u @ u.t() for u in us]).mean(0)
    assert us[0].shape == (6, 2)
    torch.testing.assert_close(second, torch.eye(6), atol=0.08, rtol=0)


@pytest.mark.parametrize("method", ["random_block", "random_k"])
def test_every_entry_is_sent_equally_often(method):
    plan, draws = _many_draws(method, (12, 10), 3000, compression_ratio=8)
    size, numel = plan.sizes[0], 120
    counts = torch.zeros(numel)
    for chosen in draws:
        index = (chosen + torch.arange(size)) % numel if method == "random_block" else chosen
        assert index.unique().numel() == size
        counts[index] += 1
    assert size == 15
    torch.testing.assert_close(counts / len(draws), torch.full((numel,), size / numel), atol=0.03, rtol=0)
    if method == "random_block":
        assert any(chosen + size > numel for chosen in draws)  # wrapping blocks occur


def test_bytes_matching_powersgd_counts_what_powersgd_sends():
    from bagua_algos.compression.powersgd import compression_summary

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3), torch.nn.Flatten(), torch.nn.Linear(16, 10))
    for rank in (1, 2, 7):
        counts = random_sketch.bytes_matching_powersgd(model, rank)
        summary = compression_summary(model, rank)
        assert [4 * counts[layer["name"]] for layer in summary["layers"]] == \
            [layer["compressed_bytes"] for layer in summary["layers"]]
        plan = random_sketch.make_plan("random_block", [tuple(p.shape) for p in model.parameters()],
                                       powersgd_rank=rank)
        assert list(plan.sizes) == list(counts.values())
        if rank == 2:
            assert counts["0.weight"] == (16 + 27) * 2 and counts["2.bias"] == 10
    assert counts["0.weight"] == 16 * 27  # rank 7: PowerSGD would send it whole


def test_a_resumed_run_and_unflattened_buckets_train_bit_for_bit_as_the_run(results):
    for r in results:
        for name, (resumed, unflattened, trained) in r["resume"].items():
            assert trained, name
            assert resumed, f"{name}: the resumed run differs"
            assert unflattened, f"{name}: do_flatten=False trains otherwise"
