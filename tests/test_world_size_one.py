"""World size 1: the runtime skips what is an exact identity.

With one worker a reduction, a gossip average or an asynchronous round leaves the
tensors as they are; such ops say ``local_only`` and run on the marking thread with no
copy, no collective and no CUDA event. Each algorithm must still train exactly as the
algorithm defines it: here against the same model trained without Bagua (and, for the
low-precision ring, against its step written out: it still quantizes)."""

from __future__ import annotations

import pytest
import torch

from bagua_algos.algorithms.table import ALGORITHM_TABLE
from bagua_algos.engine import Engine
from bagua_algos.engine.runtime import EngineRefusal
from bagua_algos.experiments.gloo_workers import run_workers

STEPS = 5


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))


def _batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(STEPS)]


def _train(model, optimizer):
    for x, y in _batches():
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def _table_rows(sgd) -> dict:
    """Every row of the algorithm table that says it is an exact identity alone, against
    plain SGD; a row that says it needs more workers must be refused. (The others are
    checked below: QAdam, the low-precision ring.)"""
    from bagua_algos.algorithms.table import ALGORITHM_TABLE

    out = {}
    for config in ALGORITHM_TABLE:
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        if not config.runs_with(1):
            try:
                model.with_bagua([optimizer], config.build(optimizer))
            except ValueError as error:
                out[config.label] = {"refused": str(error)}
            else:
                out[config.label] = {"refused": None}
            continue
        if not config.exact_alone:
            continue
        model = model.with_bagua([optimizer], config.build(optimizer))
        ops = [op for bucket in model.bagua_buckets for op in bucket.ops]
        params = _train(model, optimizer)
        if config.background_rounds:
            model.bagua_algorithm.abort(model)
            params = [p.detach().clone() for p in model.parameters()]
        out[config.label] = {"equal": all(torch.equal(a, b) for a, b in zip(params, sgd)),
                             "local_only": all(op.local_only for op in ops),
                             "state": {b.name: dict(b.state) for b in model.bagua_buckets}}
    return out


def _qadam() -> dict:
    """QAdam in its warm-up, and after it (then the momentum is compressed, not local)."""
    import warnings

    from bagua_algos import algorithms as A

    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for warmup in (100, 3):
            reference = _model()
            qref = _train(reference, A.QAdamOptimizer(reference.parameters(), lr=0.01, warmup_steps=100))
            model = _model()
            optimizer = A.QAdamOptimizer(model.parameters(), lr=0.01, warmup_steps=warmup)
            model = model.with_bagua([optimizer], A.QAdamAlgorithm(optimizer))
            params = _train(model, optimizer)
            out[f"qadam_{warmup}"] = {"equal": all(torch.equal(a, b) for a, b in zip(params, qref)),
                                      "local_only": all(op.local_only for b in model.bagua_buckets
                                                        for op in b.ops if hasattr(op, "local_only"))}
    return out


def _low_precision(sgd) -> dict:
    """The low-precision ring, one worker: x ← w + D(Q(x − w)) after each local step."""
    from bagua_algos import algorithms as A
    from bagua_algos.compression import minmax

    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model = model.with_bagua([optimizer], A.LowPrecisionDecentralizedAlgorithm())
    params = _train(model, optimizer)
    reference = _model()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    flat = lambda: torch.cat([p.detach().reshape(-1) for p in reversed(list(reference.parameters()))])  # noqa: E731
    w = flat()
    for x, y in _batches():
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(reference(x), y).backward()
        optimizer.step()
        z = flat() - w
        w = w + minmax.decode(minmax.encode(z, 8), 8, z.numel())
        offset = 0
        with torch.no_grad():
            for p in reversed(list(reference.parameters())):
                p.copy_(w[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
    return {"equal": all(torch.equal(a, b.detach()) for a, b in zip(params, reference.parameters())),
            "moved": not all(torch.equal(a, b) for a, b in zip(params, sgd))}


def _one_worker(rank, world):
    reference = _model()
    sgd = _train(reference, torch.optim.SGD(reference.parameters(), lr=0.1))
    return {**_table_rows(sgd), **_qadam(), "low_precision": _low_precision(sgd)}


def test_every_algorithm_at_world_size_one_trains_as_it_defines():
    from bagua_algos.algorithms.table import ALGORITHM_TABLE

    out = run_workers(_one_worker, 1)[0]
    exact = [c for c in ALGORITHM_TABLE if c.runs_with(1) and c.exact_alone]
    assert {"gradient_allreduce", "bytegrad", "decentralized", "decentralized_all", "async"} <= {c.label for c in exact}
    for config in exact:
        assert out[config.label]["equal"], config.label
        assert out[config.label]["local_only"], config.label
        if config.name == "decentralized":
            assert out[config.label]["state"]["0"]["decentralized_exchanges"] == STEPS, config.label
    for config in ALGORITHM_TABLE:
        if not config.runs_with(1):  # what the table says needs more workers is refused
            assert out[config.label]["refused"] and "got 1" in out[config.label]["refused"], config.label
    assert out["qadam_100"]["equal"] and out["qadam_100"]["local_only"]
    assert not out["qadam_3"]["equal"]  # compressed momentum after 3 steps: not local, not Adam
    assert out["low_precision"]["equal"] and out["low_precision"]["moved"]


# --- the one-process engine with one worker: every row of the table runs (a single row
# is a layout too, whatever stride torch gives its size-1 dimension), trains as a job at
# world size 1 does where that is exact, and what needs more workers is refused with the
# job's own error.


def _sgd_momentum(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)  # (quasi-global momentum needs momentum)


def _one_worker_engine(config):
    """The engine of one worker for ``config`` (a row built on its own optimizer, QAdam,
    takes it built on the module's parameters, and the engine none: it stacks its settings)."""
    module = _model()
    if config.own_optimizer is not None:
        return Engine(module, 1, config.build(config.optimizer_for(module.parameters(), None)), None)
    return Engine(module, 1, config.build(), _sgd_momentum)


@pytest.mark.parametrize("config", ALGORITHM_TABLE, ids=lambda c: c.label)
def test_one_worker_engine(config):
    if not config.runs_with(1):
        with pytest.raises(ValueError, match="got 1"):
            _one_worker_engine(config)
        return
    if config.background_rounds:  # async averages on a thread of its own: the engine refuses it by name
        with pytest.raises(EngineRefusal, match="does not run"):
            _one_worker_engine(config)
        return
    engine = _one_worker_engine(config)
    losses = [engine.step(x[None], y[None], torch.nn.functional.cross_entropy) for x, y in _batches()]
    assert all(bool(torch.isfinite(loss).all()) for loss in losses), config.label
    if config.exact_alone:
        reference = _model()
        want = _train(reference, _sgd_momentum(reference.parameters()))
        state = engine.model.worker_state(0)
        for (name, _), expected in zip(_model().named_parameters(), want):
            torch.testing.assert_close(state[name], expected, rtol=1e-6, atol=1e-7)
