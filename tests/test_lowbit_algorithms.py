"""Low-bit compressed algorithms on gloo workers: ``terngrad``, ``bytegrad``,
``low_precision_decentralized``, ``qadam``, the MinMaxUInt8 bucket ops, and the byte
counter of ``comm``.

Two spawns run every check (a spawn costs seconds):

- 4 workers on two "nodes" (LOCAL_WORLD_SIZE=2): the compressed scatter-gather against
  an oracle computed here from the same deterministic inputs (exact with nearest
  rounding) and against the true mean within the quantization bound, at every bit
  width and lengths with tails; its stochastic form (bound, and unbiased over many
  draws); the centralized MinMaxUInt8 op, flat and hierarchical; the low-precision
  decentralized op (each replica equals its owner's copy); the bytes counted for each
  collective kind.
- 2 workers: each algorithm trains scikit-learn's embedded digits; resuming from a
  checkpoint continues bit for bit; Bagua's own algorithm structure (tests/
  bagua_idiom_lowbit.py) trains exactly like the project's classes.
"""

from __future__ import annotations

import contextlib
import copy
import math
import sys
import zlib

import pytest
import torch

from bagua_algos.compression import minmax
from bagua_algos.experiments.gloo_workers import run_workers

N = 4
TWO_NODES = {"LOCAL_WORLD_SIZE": "2"}
LENGTHS = (1, 5, 37, 64, 103)


def inp(name: str, rank: int, size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}/{rank}".encode()))
    return torch.randn(size, generator=g) * (1 + rank) + 0.5 * rank


def _rows(x: torch.Tensor, n: int) -> torch.Tensor:
    chunk = -(-x.numel() // n)
    return torch.cat([x, x.new_zeros(chunk * n - x.numel())]).view(n, chunk)


def oracle(xs, bits):
    """(result, bound): the nearest-rounding scatter-gather computed in one process,
    and the per-value bound mean_i(gap_i)/2 + gap_r/2 of its distance to the mean."""
    n, numel = len(xs), xs[0].numel()
    levels = 2 ** bits - 1
    rows = [_rows(x, n) for x in xs]
    decoded = [minmax.decode_chunks(minmax.encode_chunks(r, bits), n) for r in rows]
    reduced = torch.stack([torch.stack([decoded[i][k] for i in range(n)]).sum(dim=0) for k in range(n)]).div_(n)
    out = minmax.decode_chunks(minmax.encode_chunks(reduced, bits), n)
    gap_in = torch.stack([(r.amax(1) - r.amin(1)) / levels for r in rows]).mean(0)  # per chunk
    gap_red = (reduced.amax(1) - reduced.amin(1)) / levels
    bound = (gap_in / 2 + gap_red / 2)[:, None].expand_as(out).reshape(-1)[:numel]
    return out.reshape(-1)[:numel], bound


# ------------------------------------------------------------------ 4 workers, ops


def _ops_worker(rank, n):
    from bagua_algos.compression import minmax
    from bagua_algos.runtime import comm, ops
    from bagua_algos.runtime.bucket import BaguaBucket

    out = {}
    # compressed scatter-gather: nearest at every width and length, and stochastic
    for bits in minmax.VALID_BITS:
        for length in LENGTHS:
            y = inp(f"sg{bits}/{length}", rank, length)
            ops.compressed_scatter_gather(y, bits, True, None)
            out[("nearest", bits, length)] = y
            z = inp(f"sg{bits}/{length}", rank, length)
            g = torch.Generator().manual_seed(7 + rank)
            ops.compressed_scatter_gather(z, bits, True, None, stochastic=True, generator=g)
            out[("stochastic", bits, length)] = z
    g = torch.Generator().manual_seed(100 + rank)
    draws = []
    for _ in range(200):
        z = inp("unbiased", rank, 37)
        ops.compressed_scatter_gather(z, 2, True, None, stochastic=True, generator=g)
        draws.append(z)
    out["unbiased_mean"] = torch.stack(draws).mean(0)
    s = inp("sum", rank, 37)
    ops.compressed_scatter_gather(s, 8, False, None)
    out["sum"] = s

    # the centralized MinMaxUInt8 op on a bucket, flat and hierarchical
    for hierarchical in (False, True):
        parts = [inp(f"bucket{hierarchical}/{i}", rank, m) for i, m in enumerate((6, 9, 11))]
        tensors = [p.clone().ensure_bagua_tensor(f"t{i}", "m") for i, p in enumerate(parts)]
        bucket = BaguaBucket(tensors, name="b", flatten=True, alignment=n)
        bucket.append_centralized_synchronous_op(hierarchical=hierarchical, average=True, scattergather=True,
                                                 compression="MinMaxUInt8")
        bucket.run_ops()
        out[("bucket", hierarchical)] = torch.cat([t.reshape(-1) for t in tensors])

    # the low-precision decentralized op: three rounds, states before and after
    numel = 23
    w0 = inp("lpd-init", 0, numel)  # the common initial model
    param = w0.clone().ensure_bagua_tensor("p", "m")
    bucket = BaguaBucket([param], name="lpd", flatten=True)
    weight = bucket.flattened_tensor().ensure_bagua_tensor("weight")
    left = bucket.flattened_tensor().ensure_bagua_tensor("left_peer_weight")
    right = bucket.flattened_tensor().ensure_bagua_tensor("right_peer_weight")
    op = bucket.append_low_precision_decentralized_synchronous_op(weight, left, right, hierarchical=False)
    rounds = []
    for t in range(3):
        with torch.no_grad():
            param.add_(inp(f"lpd-step{t}", rank, numel), alpha=0.1)  # a local step
        before = (param.clone(), weight.clone(), left.clone(), right.clone())
        bucket.run_ops()
        rounds.append(before + (param.clone(), weight.clone(), left.clone(), right.clone()))
    out["lpd"] = rounds
    out["lpd_peers"] = (op.left_rank, op.right_rank)
    out["lpd_state_keys"] = sorted(bucket.state)

    # bytes handed to the network, per collective kind
    def counted(fn):
        comm.barrier()
        before = comm.bytes_sent()
        fn()
        return comm.bytes_sent() - before

    f = torch.zeros(12)  # 48 bytes
    u8 = torch.zeros(40, dtype=torch.uint8)
    counts = {
        "allreduce": counted(lambda: comm.allreduce_inplace(f)),
        "allreduce_copy": counted(lambda: comm.allreduce(f, torch.zeros(12))),
        "hierarchical": counted(lambda: comm.hierarchical_allreduce_inplace(f)),
        "broadcast": counted(lambda: comm.broadcast(f, src=1)),
        "reduce": counted(lambda: comm.reduce_inplace(f, dst=2)),
        "allgather": counted(lambda: comm.allgather(f[:3], torch.zeros(12))),
        "allgather_inplace": counted(lambda: comm.allgather_inplace(f)),
        "gather": counted(lambda: comm.gather(f[:3], torch.zeros(12), dst=0)),
        "scatter": counted(lambda: comm.scatter(f, torch.zeros(3), src=3)),
        "reduce_scatter": counted(lambda: comm.reduce_scatter(f, torch.zeros(3))),
        "alltoall": counted(lambda: comm.alltoall(u8, torch.zeros(40, dtype=torch.uint8))),
        "alltoall_v": counted(lambda: comm.alltoall_v(f, [1, 2, 1, 2], [0, 1, 3, 4], torch.zeros(12),
                                                      [1 + (rank % 2)] * 4, [0, 3, 6, 9])),
        "neighbor": counted(lambda: comm.neighbor_exchange(
            [((rank + 1) % n, f), (rank, f)], [((rank - 1) % n, torch.zeros(12)), (rank, torch.zeros(12))])),
        "send_recv": counted(lambda: comm.send(f, 1) if rank == 0 else (comm.recv(torch.zeros(12), 0) if rank == 1 else None)),
        "barrier": counted(lambda: comm.barrier()),
    }
    out["counts"] = counts
    before = comm.reset_bytes_sent()
    out["reset"] = (before > 0, comm.bytes_sent())
    return out


@pytest.fixture(scope="module")
def ops_results():
    return run_workers(_ops_worker, N, env=TWO_NODES, timeout=150)


def _all_inputs(name, length):
    return [inp(name, r, length) for r in range(N)]


@pytest.mark.parametrize("bits", minmax.VALID_BITS)
def test_scatter_gather_nearest_equals_the_oracle_and_the_mean_within_half_gaps(ops_results, bits):
    for length in LENGTHS:
        xs = _all_inputs(f"sg{bits}/{length}", length)
        expected, bound = oracle(xs, bits)
        mean = torch.stack(xs).mean(0)
        for r in range(N):
            got = ops_results[r][("nearest", bits, length)]
            assert torch.equal(got, expected), (bits, length, r)
            assert bool(((got - mean).abs() <= bound + 1e-5).all()), (bits, length, (got - mean).abs().max(), bound.min())


@pytest.mark.parametrize("bits", minmax.VALID_BITS)
def test_scatter_gather_stochastic_is_within_one_gap_per_quantization(ops_results, bits):
    for length in LENGTHS:
        xs = _all_inputs(f"sg{bits}/{length}", length)
        _, half_gaps = oracle(xs, bits)
        mean = torch.stack(xs).mean(0)
        results = [ops_results[r][("stochastic", bits, length)] for r in range(N)]
        assert all(torch.equal(results[0], y) for y in results[1:])  # everyone decodes the same
        # one gap for each of the two quantizations (the reduced chunk's range may grow
        # by the first stage's error, hence the extra first-stage gap)
        assert bool(((results[0] - mean).abs() <= 3 * half_gaps + 1e-4).all()), (bits, length)


def test_scatter_gather_stochastic_is_unbiased(ops_results):
    xs = _all_inputs("unbiased", 37)
    mean = torch.stack(xs).mean(0)
    _, half_gaps = oracle(xs, 2)
    # 200 draws; each result's error is within ±(2 gaps) and has mean 0, so the
    # average's error has standard deviation below 2·gap/sqrt(200); allow 4 of them.
    tolerance = 4 * (4 * half_gaps) / 200 ** 0.5
    err = (ops_results[0]["unbiased_mean"] - mean).abs()
    assert bool((err <= tolerance).all()), (err.max(), tolerance.min())
    # and nearest rounding of the same data is biased well beyond that
    nearest, _ = oracle(xs, 2)
    assert (nearest - mean).abs().max() > err.max()


def test_scatter_gather_sum(ops_results):
    xs = _all_inputs("sum", 37)
    total = torch.stack(xs).sum(0)
    rng = float(torch.stack(xs).max() - torch.stack(xs).min())
    got = ops_results[0]["sum"]
    assert float((got - total).abs().max()) <= N * rng / 255 + 1e-4


def test_centralized_minmax_op_flat_and_hierarchical(ops_results):
    for hierarchical in (False, True):
        parts = [[inp(f"bucket{hierarchical}/{i}", r, m) for i, m in enumerate((6, 9, 11))] for r in range(N)]
        xs = [torch.cat(p) for p in parts]
        mean = torch.stack(xs).mean(0)
        got = [ops_results[r][("bucket", hierarchical)] for r in range(N)]
        assert all(torch.equal(got[0], g) for g in got[1:])
        if not hierarchical:
            padded = [torch.cat([x, x.new_zeros(2)]) for x in xs]  # 26 values, alignment 4 → 28
            expected, _ = oracle(padded, 8)
            assert torch.equal(got[0], expected[:26])
        rng = float(torch.stack(xs).max() - torch.stack(xs).min())
        assert float((got[0] - mean).abs().max()) <= rng / 255 + 1e-5, hierarchical


def test_low_precision_decentralized_op_keeps_replicas_equal_to_their_owners(ops_results):
    from bagua_algos.compression import minmax as mm

    assert [ops_results[r]["lpd_peers"] for r in range(N)] == [((r - 1) % N, (r + 1) % N) for r in range(N)]
    assert ops_results[0]["lpd_state_keys"] == [
        "low_precision_left_peer_weight", "low_precision_right_peer_weight", "low_precision_weight"]
    for t in range(3):
        for r in range(N):
            x, w, left, right, x_after, w_after, left_after, right_after = ops_results[r]["lpd"][t]
            # Bagua's kernel: x + left/3 + right/3 − 5w/3, summed in that order
            z = x.clone().add_(left, alpha=1 / 3).add_(right, alpha=1 / 3).add_(w, alpha=-5 / 3)
            assert torch.equal(w_after, w + mm.decode(mm.encode(z, 8)))
            assert torch.equal(x_after, w_after)
            assert torch.equal(left_after, ops_results[(r - 1) % N]["lpd"][t][5])
            assert torch.equal(right_after, ops_results[(r + 1) % N]["lpd"][t][5])
    # the gossip mixes: after three rounds the workers are closer than their local steps
    spread_local = torch.stack([ops_results[r]["lpd"][2][0] for r in range(N)]).std(0).mean()
    spread_mixed = torch.stack([ops_results[r]["lpd"][2][4] for r in range(N)]).std(0).mean()
    assert spread_mixed < spread_local


def test_low_precision_difference_is_the_local_step_plus_the_rings_mixing():
    """Without quantization a worker's new copy x̂ + z is DCD-PSGD's step, W x̂ + (x − x̂):
    the ring's mixing of the copies (weights 1/3) plus the local steps taken since x̂."""
    from bagua_algos.runtime.ops import low_precision_difference

    g = torch.Generator().manual_seed(3)
    w, left, right, x = (torch.randn(50, dtype=torch.float64, generator=g) for _ in range(4))
    z = low_precision_difference(x, w, left, right)
    torch.testing.assert_close(w + z, (left + w + right) / 3 + (x - w))
    torch.testing.assert_close(low_precision_difference(x, w), x - w)  # no ring neighbours
    with pytest.raises(ValueError, match="left and right go together"):
        low_precision_difference(x, w, left)


def test_bytes_sent_per_collective(ops_results):
    f = 48
    for r in range(N):
        c = ops_results[r]["counts"]
        assert c["allreduce"] == f and c["allreduce_copy"] == f
        assert c["hierarchical"] == 2 * f  # within the node, then across nodes
        assert c["broadcast"] == (f if r == 1 else 0)
        assert c["reduce"] == (0 if r == 2 else f)
        assert c["allgather"] == 12 and c["allgather_inplace"] == 12
        assert c["gather"] == (0 if r == 0 else 12)
        assert c["scatter"] == (36 if r == 3 else 0)
        assert c["reduce_scatter"] == 36
        assert c["alltoall"] == 30
        assert c["alltoall_v"] == 4 * (6 - (1 if r % 2 == 0 else 2))  # all but the own count
        assert c["neighbor"] == f  # the pair with itself is a local copy
        assert c["send_recv"] == (f if r == 0 else 0)
        assert c["barrier"] == 0
        assert ops_results[r]["reset"] == (True, 0)


# ------------------------------------------------------------- 2 workers, training

TRAIN_N = 2
EPOCHS = 3
BATCH = 32


def _digits():
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data / 16.0, dtype=torch.float32)
    y = torch.tensor(d.target, dtype=torch.int64)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    test, train = perm[:360], perm[360:]
    return x[train], y[train], x[test], y[test]


def _mlp():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))


def _setup(kind, model):
    from bagua_algos import algorithms as A

    sys.path.insert(0, __import__("bagua_algos.compat", fromlist=["compat_path"]).compat_path())
    import bagua_idiom_lowbit as idiom

    sgd = lambda: torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # noqa: E731
    if kind in ("qadam", "idiom_qadam"):
        # The frozen variant: Bagua's own update diverges on this run after a warm-up of
        # 8 steps (its step size keeps growing: test_qadam_optimizer_is_baguas_update).
        opt = A.QAdamOptimizer(model.parameters(), lr=0.01, warmup_steps=8, variant="frozen")
        algo = A.QAdamAlgorithm(opt, hierarchical=False) if kind == "qadam" else idiom.IdiomQAdam(opt, hierarchical=False)
        return algo, opt
    algorithms = {
        "gradient_allreduce": lambda: A.GradientAllReduceAlgorithm(),
        "terngrad2": lambda: A.TernGradAlgorithm(bits=2),
        "terngrad2_ef_clip": lambda: A.TernGradAlgorithm(bits=2, error_feedback=True, clip=2.5, seed=3),
        "terngrad4_nearest": lambda: A.TernGradAlgorithm(bits=4, stochastic=False),
        "bytegrad": lambda: A.ByteGradAlgorithm(hierarchical=False),
        "idiom_bytegrad": lambda: idiom.IdiomByteGrad(hierarchical=False),
        "lpd": lambda: A.LowPrecisionDecentralizedAlgorithm(hierarchical=False),
        "idiom_lpd": lambda: idiom.IdiomLowPrecisionDecentralized(hierarchical=False),
    }
    return algorithms[kind](), sgd()


def _steps(rank, n, epochs):
    x, y, _, _ = _digits()
    mine = torch.arange(rank, len(x), n)
    for epoch in range(epochs):
        order = mine[torch.randperm(len(mine), generator=torch.Generator().manual_seed(epoch))]
        for i in range(0, len(order) - BATCH + 1, BATCH):
            idx = order[i:i + BATCH]
            yield x[idx], y[idx]


def _run(model, opt, batches):
    losses = []
    for bx, by in batches:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(bx), by)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _train_worker(rank, n):
    out = {}
    _, _, tx, ty = _digits()
    for kind in ("gradient_allreduce", "terngrad2", "terngrad2_ef_clip", "terngrad4_nearest", "bytegrad",
                 "idiom_bytegrad", "lpd", "idiom_lpd", "qadam", "idiom_qadam"):
        model = _mlp()
        algo, opt = _setup(kind, model)
        model = model.with_bagua([opt], algo)
        losses = _run(model, opt, _steps(rank, n, EPOCHS))
        with torch.no_grad():
            accuracy = float((model(tx).argmax(1) == ty).float().mean())
        out[kind] = {"losses": losses, "accuracy": accuracy, "params": _flat(model)}

    # resume: 10 steps, checkpoint, 10 more; then a fresh wrap loads it and runs the 10 again
    for kind in ("terngrad2", "terngrad2_ef_clip", "bytegrad", "lpd", "qadam"):
        batches = list(_steps(rank, n, 1))[:20]
        model = _mlp()
        algo, opt = _setup(kind, model)
        model = model.with_bagua([opt], algo)
        _run(model, opt, batches[:10])
        saved = copy.deepcopy((model.state_dict(), opt.state_dict(), model.bagua_state_dict()))
        untouched = copy.deepcopy(saved)  # (a loaded optimizer state shares the checkpoint's tensors)
        if kind.startswith("terngrad"):
            # The rank's stream is a CPU generator seeded rank_seed(seed, rank) that gave
            # one key (an int64 below 2**63 - 1) per bucket and step.
            from bagua_algos.arguments import SEED_LIMIT, rank_seed

            stream = torch.Generator().manual_seed(rank_seed(algo.seed, rank))
            for _ in range(10 * len(model.bagua_buckets)):
                torch.randint(0, SEED_LIMIT - 1, (), generator=stream)
            out[("stream", kind)] = torch.equal(saved[2]["algorithm_state"]["generator_state"][0], stream.get_state())
        _run(model, opt, batches[10:])
        straight = _flat(model)
        model2 = _mlp()
        algo2, opt2 = _setup(kind, model2)
        model2 = model2.with_bagua([opt2], algo2)
        model2.load_state_dict(saved[0])
        opt2.load_state_dict(saved[1])
        model2.load_bagua_state_dict(saved[2])
        _run(model2, opt2, batches[10:])
        out[("resume", kind)] = (straight, _flat(model2), sorted(saved[2]["algorithm_state"]),
                                 sorted(k for b in saved[2]["bucket_state"].values() for k in b))
        if kind in ("terngrad2_ef_clip", "lpd"):
            # a job's checkpoint in the form before the one [W, ...] shape loads to the same run
            model3 = _mlp()
            algo3, opt3 = _setup(kind, model3)
            model3 = model3.with_bagua([opt3], algo3)
            model3.load_state_dict(untouched[0])
            opt3.load_state_dict(untouched[1])
            model3.load_bagua_state_dict(_old_job_form(untouched[2]))
            _run(model3, opt3, batches[10:])
            out[("resume_old_form", kind)] = torch.equal(straight, _flat(model3))
    return out


def _old_job_form(bagua: dict) -> dict:
    """A job's Bagua state as written before every per-worker state had a row
    dimension: 1-D bucket buffers, one generator state."""
    old = copy.deepcopy(bagua)
    if isinstance(old["algorithm_state"].get("generator_state"), list):
        old["algorithm_state"]["generator_state"] = old["algorithm_state"]["generator_state"][0]
    for state in old["bucket_state"].values():
        for key, value in state.items():
            if torch.is_tensor(value) and value.dim() == 2 and value.shape[0] == 1:
                state[key] = value[0].clone()
    return old


@pytest.fixture(scope="module")
def train_results():
    return run_workers(_train_worker, TRAIN_N, timeout=300)


TRAINED = ("gradient_allreduce", "terngrad2", "terngrad2_ef_clip", "terngrad4_nearest", "bytegrad", "lpd", "qadam")


@pytest.mark.parametrize("kind", TRAINED)
def test_each_algorithm_trains_the_digits(train_results, kind):
    for r in range(TRAIN_N):
        res = train_results[r][kind]
        first, last = sum(res["losses"][:5]) / 5, sum(res["losses"][-5:]) / 5
        assert last < 0.5 * first, (kind, first, last)
        assert res["accuracy"] >= 0.85, (kind, res["accuracy"])
    if kind != "lpd":  # centralized algorithms keep one model
        assert torch.equal(train_results[0][kind]["params"], train_results[1][kind]["params"]), kind


@pytest.mark.parametrize("kind", ["bytegrad", "lpd", "qadam"])
def test_baguas_own_algorithm_structure_trains_exactly_like_ours(train_results, kind):
    for r in range(TRAIN_N):
        assert torch.equal(train_results[r][kind]["params"], train_results[r]["idiom_" + kind]["params"]), (kind, r)


@pytest.mark.parametrize("kind", ["terngrad2", "terngrad2_ef_clip", "bytegrad", "lpd", "qadam"])
def test_resume_from_a_checkpoint_is_bit_for_bit(train_results, kind):
    for r in range(TRAIN_N):
        straight, resumed, algorithm_keys, bucket_keys = train_results[r][("resume", kind)]
        assert torch.equal(straight, resumed), (kind, r, (straight - resumed).abs().max())
    if kind.startswith("terngrad"):
        assert algorithm_keys == ["generator_state"]
        assert all(train_results[r][("stream", kind)] for r in range(TRAIN_N))
    if kind == "terngrad2_ef_clip":
        assert "terngrad_error" in bucket_keys
    if kind == "lpd":
        assert "low_precision_weight" in bucket_keys
    if kind in ("terngrad2_ef_clip", "lpd"):
        assert all(train_results[r][("resume_old_form", kind)] for r in range(TRAIN_N))


def test_the_quantized_algorithms_differ_from_exact_averaging(train_results):
    exact = train_results[0]["gradient_allreduce"]["params"]
    for kind in ("terngrad2", "terngrad2_ef_clip", "terngrad4_nearest", "bytegrad"):
        assert not torch.equal(train_results[0][kind]["params"], exact), kind


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_qadam_optimizer_is_baguas_update_by_default_and_frozen_on_request(weight_decay):
    """Bagua 0.9.2's QAdamOptimizer.step, written out: m and v follow the gradient while
    step < warmup_steps, from the gradient plus wd·x; every step x ← x − lr/(1−β1^s) ·
    m/(√v/√(1−β2^s) + eps), with s the step count throughout. The frozen variant keeps
    1−β2^s at the last warm-up step (the algorithm's compression phase applies wd to
    its momentum in that variant only)."""
    from bagua_algos.algorithms import QAdamOptimizer

    lr, (b1, b2), eps, warmup = 0.01, (0.9, 0.999), 1e-8, 4
    g = torch.Generator().manual_seed(3)
    x0 = torch.randn(7, generator=g)
    grads = [torch.randn(7, generator=g) for _ in range(10)]
    for variant in ("bagua", "frozen"):
        p = torch.nn.Parameter(x0.clone())
        with pytest.warns(UserWarning, match="applies the weight decay during the warm-up only") if (
                variant == "bagua" and weight_decay) else contextlib.nullcontext():
            kwargs = {} if variant == "bagua" else {"variant": "frozen"}
            opt = QAdamOptimizer([p], lr=lr, warmup_steps=warmup, weight_decay=weight_decay, **kwargs)
        x, m, v = x0.clone().double(), torch.zeros(7, dtype=torch.float64), torch.zeros(7, dtype=torch.float64)
        for s, grad in enumerate(grads, start=1):
            p.grad = grad.clone()
            opt.step()
            gd = grad.double() + weight_decay * x
            if s < warmup:
                m, v = b1 * m + (1 - b1) * gd, b2 * v + (1 - b2) * gd * gd
            v_step = s if variant == "bagua" else min(s, warmup - 1)
            x = x - lr / (1 - b1 ** s) * m / (v.sqrt() / math.sqrt(1 - b2 ** v_step) + eps)
            torch.testing.assert_close(p.detach().double(), x, rtol=1e-5, atol=1e-6,
                                       msg=lambda msg: f"{variant}, step {s}: {msg}")
    with pytest.raises(ValueError, match=r"variant must be one of \['bagua', 'frozen'\], got 'other'"):
        QAdamOptimizer([torch.nn.Parameter(torch.zeros(2))], variant="other")


def test_qadam_warmup_is_torch_adam_with_weight_decay():
    """Bagua's own tests/torch_api/test_qadam.py: during the warm-up QAdamOptimizer is
    torch.optim.Adam, weight decay included (1000 steps of a small net, same loss)."""
    import warnings

    from bagua_algos.algorithms import QAdamOptimizer

    def final_loss(make_optimizer):
        torch.manual_seed(13)
        net = torch.nn.Sequential(torch.nn.Linear(2, 10, bias=False), torch.nn.ReLU(), torch.nn.Linear(10, 4))
        opt = make_optimizer(net.parameters())
        for _ in range(300):
            x, y = torch.randn(4, 2), torch.randn(4, 4)
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(torch.softmax(net(x), dim=1), y)
            loss.backward()
            opt.step()
        return loss.item()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = final_loss(lambda p: QAdamOptimizer(p, lr=0.001, weight_decay=0.1, warmup_steps=2000))
    assert ours == final_loss(lambda p: torch.optim.Adam(p, lr=0.001, weight_decay=0.1, foreach=False))


@torch.no_grad()
def _adam_step_one_parameter_at_a_time(opt):
    """QAdamOptimizer's update written one parameter at a time (the oracle of its _foreach step)."""
    import math

    for group in opt.param_groups:
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        for param in group["params"]:
            if param.grad is None:
                continue
            state = opt.state[param]
            if len(state) == 0:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(param)
                state["exp_avg_sq"] = torch.zeros_like(param)
            state["step"] += 1
            step = state["step"]
            if step < opt.warmup_steps:
                grad = param.grad if wd == 0 else param.grad.add(param, alpha=wd)
                state["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            v_step = min(step, opt.warmup_steps - 1) if opt.variant == "frozen" else step
            denom = (state["exp_avg_sq"].sqrt() / math.sqrt(1 - beta2 ** v_step)).add_(eps)
            param.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - beta1 ** step))


@pytest.mark.parametrize("variant,weight_decay,warmup",
                         [("bagua", 0.0, 4), ("frozen", 0.01, 4), ("bagua", 0.01, 4), ("bagua", 0.0, 100)])
def test_qadam_foreach_step_equals_the_per_parameter_loop_bit_for_bit(variant, weight_decay, warmup):
    """QAdamOptimizer.step runs _foreach ops over runs of parameters; the oracle is the
    update one parameter at a time. Same numbers, with a parameter skipped (no gradient)
    once, so its step count lags the others', and exp_avg set from outside after the
    warm-up as the algorithm does."""
    import warnings

    from bagua_algos.algorithms import QAdamOptimizer

    g = torch.Generator().manual_seed(5)
    shapes = ((5, 3), (7,), (2, 2, 3), (1,))
    fast = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    loop = [torch.nn.Parameter(p.detach().clone()) for p in fast]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = QAdamOptimizer(fast, lr=0.01, warmup_steps=warmup, weight_decay=weight_decay, variant=variant)
        b = QAdamOptimizer(loop, lr=0.01, warmup_steps=warmup, weight_decay=weight_decay, variant=variant)
    for it in range(8):
        for i, (p, q) in enumerate(zip(fast, loop)):
            if it == 2 and i == 1:
                p.grad = q.grad = None
                continue
            grad = torch.randn(p.shape, generator=g)
            p.grad, q.grad = grad.clone(), grad.clone()
        a.step()
        _adam_step_one_parameter_at_a_time(b)
        for p, q in zip(fast, loop):
            assert torch.equal(p, q) and a.state[p]["step"] == b.state[q]["step"], (it, p.shape)
            assert torch.equal(a.state[p]["exp_avg_sq"], b.state[q]["exp_avg_sq"])
            if a.state[p]["step"] >= warmup:
                m = torch.randn(p.shape, generator=g)
                a.state[p]["exp_avg"].copy_(m)
                b.state[q]["exp_avg"].copy_(m)
