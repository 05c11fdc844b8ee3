"""What careful users of with_bagua hit in round one, each a check that failed before
its fix: gradient sync in eval mode, refused optimizer-less model averaging, DDP's
broadcast_buffers, a dtype change after wrapping, ranks with different models, loading a
checkpoint before wrapping, exact resume. All on one spawn of 4 gloo workers."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from bagua_algos.algorithms import (
    AllreduceAverageAlgorithm,
    AsyncModelAverageAlgorithm,
    DecentralizedAlgorithm,
    GradientAllReduceAlgorithm,
    RelayAlgorithm,
)
from bagua_algos.experiments.gloo_workers import run_workers


def bn_model(seed: int = 0, hidden: int = 12) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(5, hidden), torch.nn.BatchNorm1d(hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 2)
    )


def data(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 5, generator=g), torch.randint(0, 2, (8,), generator=g)


def train(model, opt, steps, rank, start=0):
    for step in range(start, start + steps):
        x, y = data(step, rank)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _capture(out, key, fn):
    try:
        fn()
    except (ValueError, TypeError, RuntimeError) as exc:
        out[key] = f"{type(exc).__name__}: {exc}"


def _repairs(rank, n):
    out = {}
    # Eval mode (e.g. frozen batch-norm statistics): gradients are still synchronised.
    model = bn_model(seed=rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.with_bagua([opt], GradientAllReduceAlgorithm())
    model.eval()
    train(model, opt, 4, rank)
    out["eval_params"] = flat(model)
    out["eval_counter"] = model.bagua_train_step_counter

    # Model averaging without an optimizer would never average: refused.
    for key, algorithm in (("relay", RelayAlgorithm(topology="chain")), ("async", AsyncModelAverageAlgorithm()),
                           ("allreduce_average", AllreduceAverageAlgorithm())):
        _capture(out, f"no_optimizer_{key}", lambda: bn_model().with_bagua([], algorithm))

    # broadcast_buffers: rank 0's buffers before every training forward (torch DDP's default).
    for setting in (False, True):
        model = bn_model(seed=0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model.with_bagua([opt], GradientAllReduceAlgorithm(), broadcast_buffers=setting)
        train(model, opt, 3, rank)
        model(torch.ones(4, 5))  # the same input everywhere
        out[f"running_mean_{setting}"] = model[1].running_mean.clone()

    # A dtype change after wrapping is named, not a failure deep inside autograd.
    model = bn_model(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.with_bagua([opt], GradientAllReduceAlgorithm())
    model.double()
    _capture(out, "dtype", lambda: model(torch.ones(4, 5, dtype=torch.float64)))

    # Different models on different ranks: named before any broadcast.
    model = bn_model(seed=0, hidden=12 + rank)
    before = flat(model)
    _capture(out, "shapes", lambda: model.with_bagua([torch.optim.SGD(model.parameters(), lr=0.1)], GradientAllReduceAlgorithm()))
    out["shapes_untouched"] = torch.equal(before, flat(model)) and "bagua_ddp" not in model.__dict__

    # Loading a checkpoint before with_bagua is replaced by rank 0's broadcast: warned.
    model = bn_model(seed=0)
    model.load_state_dict(bn_model(seed=rank + 7).state_dict())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.with_bagua([torch.optim.SGD(model.parameters(), lr=0.1)], GradientAllReduceAlgorithm())
    out["load_warning"] = [str(w.message) for w in caught]

    # Exact resume for each model-averaging algorithm of this file's scope.
    resumed = {}
    for key, make in {
        "allreduce_average": lambda: AllreduceAverageAlgorithm(communication_interval=2),
        "ring": lambda: DecentralizedAlgorithm(topology="ring", communication_interval=2),
        "shift_one": lambda: DecentralizedAlgorithm(peer_selection_mode="shift_one", hierarchical=False),
    }.items():
        model = bn_model(seed=0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model.with_bagua([opt], make())
        train(model, opt, 3, rank)
        checkpoint = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "bagua": model.bagua_state_dict()})
        train(model, opt, 3, rank, start=3)
        again = bn_model(seed=5)
        again_opt = torch.optim.SGD(again.parameters(), lr=0.1, momentum=0.9)
        again.with_bagua([again_opt], make())
        again.load_state_dict(checkpoint["model"])
        again_opt.load_state_dict(checkpoint["opt"])
        again.load_bagua_state_dict(checkpoint["bagua"])
        train(again, again_opt, 3, rank, start=3)
        resumed[key] = torch.equal(flat(model), flat(again))
    out["resumed"] = resumed
    return out


@pytest.fixture(scope="module")
def repairs():
    return run_workers(_repairs, 4)


def test_gradients_are_synchronised_in_eval_mode(repairs):
    for out in repairs:
        torch.testing.assert_close(out["eval_params"], repairs[0]["eval_params"], atol=0, rtol=0)
        assert out["eval_counter"] == 0  # the step counter counts training forwards only, as in Bagua


def test_model_averaging_without_an_optimizer_is_refused(repairs):
    for out in repairs:
        for key in ("relay", "async", "allreduce_average"):
            assert "pass the module's optimizers" in out[f"no_optimizer_{key}"], key


def test_broadcast_buffers_follows_torch_ddp_when_asked(repairs):
    assert all(torch.equal(out["running_mean_True"], repairs[0]["running_mean_True"]) for out in repairs)
    assert not all(torch.equal(out["running_mean_False"], repairs[0]["running_mean_False"]) for out in repairs)


def test_a_dtype_change_after_wrapping_is_named(repairs):
    for out in repairs:
        assert "before with_bagua()" in out["dtype"] and "torch.float64" in out["dtype"]


def test_different_models_on_different_ranks_are_named(repairs):
    for out in repairs:
        assert "differs across ranks" in out["shapes"] and "0.weight" in out["shapes"]
        assert out["shapes_untouched"]


def test_loading_before_wrapping_warns(repairs):
    for out in repairs:
        assert any("load checkpoints after with_bagua()" in m for m in out["load_warning"])


def test_resume_is_exact_for_each_algorithm(repairs):
    for out in repairs:
        assert all(out["resumed"].values()), out["resumed"]
