"""The one-process engine with one worker: every algorithm of the table runs (a single
row is a layout too, whatever stride torch gives its size-1 dimension), trains as its
job at world size 1 does where that is exact (plain SGD), and what needs more workers
is refused with the job's own error."""

from __future__ import annotations

import pytest
import torch

from bagua_algos.algorithms.table import ALGORITHM_TABLE
from bagua_algos.engine import Engine
from bagua_algos.engine.runtime import EngineRefusal

STEPS = 4


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))


def _batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(STEPS)]


def _plain_sgd():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in _batches():
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return [p.detach() for p in model.parameters()]


def _engine(config):
    """The engine of one worker for ``config`` (a row built on its own optimizer, QAdam,
    takes it built on the module's parameters, and the engine none: it stacks its settings)."""
    module = _model()
    if config.own_optimizer is not None:
        return Engine(module, 1, config.build(config.optimizer_for(module.parameters(), None)), None)
    return Engine(module, 1, config.build(), lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))


@pytest.mark.parametrize("config", ALGORITHM_TABLE, ids=lambda c: c.label)
def test_one_worker_engine(config):
    if not config.runs_with(1):
        with pytest.raises(ValueError, match="got 1"):
            _engine(config)
        return
    if config.background_rounds:  # async averages on a thread of its own: the engine refuses it by name
        with pytest.raises(EngineRefusal, match="does not run"):
            _engine(config)
        return
    engine = _engine(config)
    losses = [engine.step(x[None], y[None], torch.nn.functional.cross_entropy) for x, y in _batches()]
    assert all(bool(torch.isfinite(loss).all()) for loss in losses), config.label
    if config.exact_alone and not config.background_rounds:
        state = engine.model.worker_state(0)
        got = [state[name] for name, _ in _model().named_parameters()]
        for got, want in zip(got, _plain_sgd()):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
