"""Bagua 0.9's own API on the runtime: algorithm files written for Bagua, the bucket
pipeline on the communication thread, errors from ops, asynchronous model averaging."""

from __future__ import annotations

import sys

import pytest
import torch

from bagua_algos.compat import compat_path
from bagua_algos.experiments.gloo_workers import run_workers


def small_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 3))


def batch(step: int, rank: int, per_rank: int = 8):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(per_rank, 7, generator=g), torch.randint(0, 3, (per_rank,), generator=g)


def train(model, opt, steps, rank, start=0):
    for step in range(start, start + steps):
        x, y = batch(step, rank)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _wrapped(algorithm, rank, lr=0.1, **kwargs):
    model = small_model(seed=rank)  # with_bagua broadcasts rank 0's
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    return model.with_bagua([opt], algorithm, **kwargs), opt


# ------------------------------------------ algorithms written against Bagua's API


def _bagua_idiom(rank, n):
    sys.path.insert(0, compat_path())
    import bagua_idiom
    from bagua_algos.algorithms import DecentralizedAlgorithm, GradientAllReduceAlgorithm
    from bagua_algos.runtime.backend import CommOpError

    out = {}
    for key, algorithm, kwargs in [
        ("idiom_sum_scale", bagua_idiom.SumThenScaleAlgorithm(), {"bucket_size": 10}),
        ("own_allreduce", GradientAllReduceAlgorithm(), {"bucket_size": 10}),
        ("idiom_scatter_gather", bagua_idiom.ScatterGatherAlgorithm(), {"bucket_size": 10}),
        ("idiom_gossip", bagua_idiom.GossipAllAlgorithm(), {}),
        ("own_gossip", DecentralizedAlgorithm(hierarchical=False, peer_selection_mode="all"), {}),
    ]:
        model, opt = _wrapped(algorithm, rank, **kwargs)
        train(model, opt, 4, rank)
        out[key] = flat(model)
        if key == "idiom_sum_scale":
            buckets = model.bagua_buckets
            out["buckets"] = len(buckets)
            out["aligned"] = all(b.numel % n == 0 for b in buckets)
            out["padded"] = any(b.padding_tensor is not None for b in buckets)
            out["flat"] = all(b.check_flatten() for b in buckets)
            out["bytes"] = sum(b.bytes() for b in buckets)
        if key == "own_gossip":  # Bagua's tests read the mixed weights under Bagua's name
            out["peer_weight"] = model.bagua_buckets[0]._peer_weight.detach().clone()
    model, opt = _wrapped(bagua_idiom.FailingAlgorithm(), rank)
    x, y = batch(0, rank)
    try:
        torch.nn.functional.cross_entropy(model(x), y).backward()
    except CommOpError as exc:
        out["error"] = str(exc)
    return out


@pytest.fixture(scope="module")
def idiom_results():
    return run_workers(_bagua_idiom, 2)


def test_bagua_style_allreduce_trains_exactly_like_gradient_allreduce(idiom_results):
    for out in idiom_results:
        assert out["buckets"] > 1 and out["aligned"] and out["padded"] and out["flat"]
        assert out["bytes"] == sum(p.numel() * 4 for p in small_model().parameters())
        assert torch.equal(out["idiom_sum_scale"], out["own_allreduce"])
        assert torch.equal(out["idiom_scatter_gather"], out["own_allreduce"])
    assert torch.equal(idiom_results[0]["own_allreduce"], idiom_results[1]["own_allreduce"])


def test_bagua_style_gossip_trains_exactly_like_decentralized(idiom_results):
    for out in idiom_results:
        assert torch.equal(out["idiom_gossip"], out["own_gossip"])
    # "all": every worker's last mixed weights are the same average
    assert torch.equal(idiom_results[0]["peer_weight"], idiom_results[1]["peer_weight"])


def test_an_error_in_an_op_reaches_the_training_thread_with_its_traceback(idiom_results):
    for out in idiom_results:
        assert "boom in bucket" in out["error"]
        assert "explode" in out["error"] and "Traceback" in out["error"]


# --------------------------------------------------------- tensors and buckets alone


def test_an_unflattened_bucket_has_the_same_two_shapes_and_write_flat_takes_both():
    from bagua_algos.runtime.bucket import BaguaBucket

    params = [torch.nn.Parameter(torch.arange(6.0).view(3, 2)), torch.nn.Parameter(torch.arange(6.0, 11.0))]
    tensors = [p.ensure_bagua_tensor(f"q{i}", "m") for i, p in enumerate(params)]
    bucket = BaguaBucket(tensors, name="u", flatten=False, alignment=4)  # 11 values + 1 padding
    assert bucket.flat_view().shape == (1, 12) and bucket.flattened_tensor().shape == (12,)
    assert torch.equal(bucket.flat_view()[0, :11], torch.arange(11.0))
    bucket.write_flat(torch.arange(12.0).view(1, 12) + 100)  # the plugin's [W, L]
    assert torch.equal(params[1].detach(), torch.arange(106.0, 111.0))
    bucket.write_flat(torch.arange(12.0) + 200)  # Bagua's 1-D form
    assert torch.equal(params[0].detach(), torch.arange(200.0, 206.0).view(3, 2))
    assert [tuple(v.shape) for _, v in bucket.tensor_views(bucket.flat_zeros())] == [(1, 3, 2), (1, 5)]


def test_bagua_tensor_closures_and_bucket_flattening_in_one_process():
    params = [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(5))]
    for p in params:
        p.grad = torch.randn_like(p)
    grads = [p.grad.clone() for p in params]
    tensors = [
        p.ensure_bagua_tensor(f"p{i}", "m", getter_closure=lambda q: q.grad, setter_closure=lambda q, t: setattr(q, "grad", t))
        for i, p in enumerate(params)
    ]
    assert all(t.is_bagua_tensor() for t in tensors)
    from bagua_algos.runtime.bucket import BaguaBucket

    bucket = BaguaBucket(tensors, name="b", flatten=True, alignment=4)
    assert bucket.numel == 12 and bucket.padding_tensor.numel() == 1
    assert bucket.check_flatten()
    for p, g in zip(params, grads):
        assert torch.equal(p.grad, g)
    bucket.backend_tensor.mul_(2)  # the buffer *is* the gradients
    assert torch.equal(params[1].grad, 2 * grads[1])
    copy = bucket.flattened_tensor()
    # Bagua's flattened_tensor() is 1-D in a job; the plugin's flat tensor is [W, L], W = 1
    assert copy.shape == (12,) and bucket.backend_tensor.shape == bucket.flat_view().shape == (1, 12)
    assert bucket.flat_zeros().shape == (1, 12) and bucket.workers == 1
    assert copy.data_ptr() != bucket.backend_tensor.data_ptr() and torch.equal(copy, bucket.backend_tensor[0])
    params[0].grad = None  # zero_grad(set_to_none=True): the next ops see zeros, in place
    bucket.before_ops()
    assert bucket.check_flatten() and float(params[0].grad.abs().sum()) == 0.0
    with pytest.raises(ValueError, match="cannot be renamed"):
        params[0].ensure_bagua_tensor("other", "m")
    with pytest.raises(TypeError, match="not a Bagua tensor"):
        BaguaBucket([torch.zeros(2)], name="x", flatten=True)
    with pytest.raises(ValueError, match="alignment"):
        BaguaBucket(tensors, name="y", flatten=False, alignment=0)


# ------------------------------------------------------- asynchronous model averaging


def _async_checks(rank, n):
    import time

    from bagua_algos.algorithms import AsyncModelAverageAlgorithm

    out = {}
    target = torch.full((6,), float(rank))  # each worker pulls towards its own target
    model = torch.nn.Linear(6, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(10.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    algorithm = AsyncModelAverageAlgorithm(sync_interval_ms=5, warmup_steps=2)
    model.with_bagua([opt], algorithm)

    def steps(k):
        for _ in range(k):
            opt.zero_grad()
            model(torch.ones(1, 6))  # a training forward: counts the step, locks the weights
            ((model.weight[0] - target) ** 2).sum().backward()
            opt.step()
            time.sleep(0.002 * (rank + 1))  # workers run at different speeds

    steps(2)
    out["after_warmup_equal"] = model.weight.detach().clone()
    steps(60)
    out["before_abort"] = model.weight.detach().clone()  # each worker's own model
    impl = model.bagua_algorithm
    impl.abort(model)
    out["rounds"] = impl.rounds
    out["after_abort"] = model.weight.detach().clone()
    impl.resume(model)
    steps(30)
    impl.abort(model)
    out["after_resume"] = model.weight.detach().clone()
    # detach() stops the rounds (no final average): nothing moves the model afterwards
    impl.resume(model)
    steps(20)
    model.bagua_ddp.detach()
    rounds, weight = impl.rounds, model.weight.detach().clone()
    time.sleep(0.1)  # 20 intervals of 5 ms
    out["detached_still"] = (impl.rounds == rounds and torch.equal(model.weight, weight)
                             and impl._future is None)
    return out


def test_async_model_average_converges_and_abort_resume_leave_equal_models():
    results = run_workers(_async_checks, 2, timeout=90)
    torch.testing.assert_close(results[0]["after_warmup_equal"], results[1]["after_warmup_equal"])
    # Alone, worker r would reach its target r (from 10: 10 * 0.9**60 < 0.02 away). The
    # background rounds pull the two models towards each other while they train.
    assert float(results[0]["before_abort"].min()) > 0.1
    assert float(results[1]["before_abort"].max()) < 0.9
    for key in ("after_abort", "after_resume"):
        torch.testing.assert_close(results[0][key], results[1][key])  # the final synchronous average
        assert 0.05 < float(results[0][key].min()) and float(results[0][key].max()) < 0.95, key
    assert all(out["rounds"] > 0 for out in results)
    assert all(out["detached_still"] for out in results)


# ------------------------------------------------- a Bagua script under the launchers

LAUNCHERS = {
    # how the job is started, and the algorithm it runs
    "bagua_algos.launch": (["-m", "bagua_algos.launch"], "gradient_allreduce", False),
    "torchrun": (["-m", "torch.distributed.run", "--nproc-per-node", "2"], "decentralized", True),
    "bagua.distributed.launch": (["-m", "bagua.distributed.launch"], "async", True),
}


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_a_script_written_for_bagua_runs_unchanged(launcher, tmp_path):
    import os

    from subprocesses import REPO, child_env, free_port, run_python

    prefix, algorithm, needs_path = LAUNCHERS[launcher]
    env = child_env([compat_path()] if needs_path else ())
    port = str(free_port())
    if launcher == "torchrun":
        args = [*prefix, "--master-port", port]
    else:
        args = [*prefix, "--nproc_per_node", "2", "--master_port", port]
    script = REPO / "tests" / "launch_workers" / "bagua_script.py"
    code, out, err = run_python([*args, script, tmp_path, algorithm], env=env, timeout=120)
    assert code == 0, f"stdout:\n{out}\nstderr:\n{err}"
    results = [torch.load(tmp_path / f"rank_{r}.pt") for r in range(2)]
    for rank, res in enumerate(results):
        assert res["total"] == 3.0 and res["gathered"] == [1.0, 2.0]
        assert res["env"] == (rank, 2, rank, 2) and res["comm"] == (rank, 2)
        assert res["bagua_file"].startswith(os.path.join(compat_path(), "bagua"))
    if algorithm == "decentralized":
        # D-PSGD: equal weights mixed, then each worker's own gradient step.
        assert float((results[0]["params"] - results[1]["params"]).abs().max()) < 0.05
    else:
        assert torch.equal(results[0]["params"], results[1]["params"])
