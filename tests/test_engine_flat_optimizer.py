"""``Engine(..., flat_optimizer=True)``: the optimizer steps the one ``[n, d]`` parameter
matrix instead of the parameters' views. For an elementwise optimizer with one param
group every number sees the same arithmetic, so the workers' models must match the
views' run; algorithms that look their parameters up in the optimizer are refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from bagua_algos.algorithms import (DecentralizedAlgorithm, GradientAllReduceAlgorithm,
                                    LowPrecisionDecentralizedAlgorithm, QAdamAlgorithm)
from bagua_algos.algorithms.q_adam import QAdamOptimizer
from bagua_algos.engine import Engine
from bagua_algos.engine.runtime import EngineRefusal
from bagua_algos.runtime.algorithm import Algorithm

N, B = 4, 8


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 3))


def _conv_model():  # runs under vmap, not the direct path
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8, 3))


OPTIMIZERS = {  # name -> (the flat run's, the views' reference: not fused, which the views refuse)
    "adamw_fused": (lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, fused=True),
                    lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, foreach=False)),
    "adamw_foreach": (lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, foreach=True),) * 2,
    "sgd_momentum": (lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-3),) * 2,
}


def _run(make_model, shape, algorithm, optimizer, flat: bool, steps: int = 12):
    engine = Engine(make_model(), N, algorithm(), optimizer, flat_optimizer=flat)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(N, B, *shape, generator=g)
        y = torch.randint(0, 3, (N, B), generator=g)
        engine.step(x, y, nn.functional.cross_entropy)
    return engine


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("algorithm, workers_differ", [
    (lambda: Algorithm.init("diloco", sync_every=5), True),  # 14 steps: 4 local ones since the last sync
    (lambda: DecentralizedAlgorithm(hierarchical=False), True),
    (GradientAllReduceAlgorithm, False),
], ids=["diloco", "decentralized", "allreduce"])
def test_the_flat_optimizer_trains_every_worker_as_the_views_do(algorithm, workers_differ, optimizer):
    flat_optimizer, reference = OPTIMIZERS[optimizer]
    views = _run(_model, (3, 4), algorithm, reference, flat=False, steps=14)
    flat = _run(_model, (3, 4), algorithm, flat_optimizer, flat=True, steps=14)
    assert len(flat.optimizer.param_groups[0]["params"]) == 1
    assert flat.optimizer.param_groups[0]["params"][0] is flat.model.params
    torch.testing.assert_close(flat.model.params.detach(), views.model.params.detach(), rtol=1e-6, atol=1e-7)
    # with local steps the workers differ, so the match is each worker's, not one model's
    assert torch.equal(views.model.params[0], views.model.params[1]) is not workers_differ


def test_the_flat_optimizer_under_vmap_and_its_padding_stays_zero():
    flat_optimizer, reference = OPTIMIZERS["adamw_fused"]
    views = _run(_conv_model, (1, 4, 4), GradientAllReduceAlgorithm, reference, flat=False)
    flat = _run(_conv_model, (1, 4, 4), GradientAllReduceAlgorithm, flat_optimizer, flat=True)
    torch.testing.assert_close(flat.model.params.detach(), views.model.params.detach(), rtol=1e-6, atol=1e-7)
    used = torch.zeros(flat.model.params.shape[1], dtype=torch.bool)
    for slot in flat.model.layout.slots:
        used[slot.start:slot.start + slot.numel] = True
    assert torch.all(flat.model.params.detach()[:, ~used] == 0)


def test_the_flat_optimizers_state_is_one_stacked_tensor_and_round_trips():
    engine = _run(_model, (3, 4), GradientAllReduceAlgorithm, OPTIMIZERS["adamw_fused"][0], flat=True, steps=3)
    state = engine.optimizer.state_dict()
    assert list(state["state"]) == [0]
    assert state["state"][0]["exp_avg"].shape == engine.model.params.shape
    again = _run(_model, (3, 4), GradientAllReduceAlgorithm, OPTIMIZERS["adamw_fused"][0], flat=True, steps=0)
    again.optimizer.load_state_dict(state)
    torch.testing.assert_close(again.optimizer.state_dict()["state"][0]["exp_avg_sq"], state["state"][0]["exp_avg_sq"])


@pytest.mark.parametrize("algorithm, optimizer", [
    (lambda: QAdamAlgorithm(QAdamOptimizer(_model().parameters(), lr=1e-3, warmup_steps=2)), None),
    (lambda: LowPrecisionDecentralizedAlgorithm(hierarchical=False), OPTIMIZERS["sgd_momentum"][0]),
    (lambda: DecentralizedAlgorithm(hierarchical=False, topology="ring", quasi_global_momentum=True), OPTIMIZERS["sgd_momentum"][0]),
], ids=["qadam", "low_precision_decentralized", "quasi_global_momentum"])
def test_algorithms_that_find_their_parameters_in_the_optimizer_refuse_it(algorithm, optimizer):
    with pytest.raises(EngineRefusal, match="flat_optimizer"):
        Engine(_model(), N, algorithm(), optimizer, flat_optimizer=True)


def test_flat_optimizer_must_be_a_bool():
    with pytest.raises(TypeError, match="flat_optimizer must be True or False, got 'yes'"):
        Engine(_model(), N, GradientAllReduceAlgorithm(), OPTIMIZERS["sgd_momentum"][0], flat_optimizer="yes")


@pytest.mark.parametrize("make", [
    lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True),
], ids=["adamw", "sgd"])
def test_a_fused_optimizer_on_the_strided_views_is_refused(make):
    # torch's fused kernels write a strided parameter as if it were contiguous: shown on
    # one view, then the engine refusing it on its views and running it on the matrix
    matrix = torch.zeros(2, 6)
    view = matrix[:, 1:3]
    view.grad = torch.ones(2, 2)
    make([view]).step()
    assert torch.all(matrix[1] == 0), "torch's fused step now writes strided tensors right: the refusal can go"
    with pytest.raises(EngineRefusal, match=r"fused=True.*flat_optimizer=True"):
        Engine(_model(), N, GradientAllReduceAlgorithm(), make)
    Engine(_model(), N, GradientAllReduceAlgorithm(), make, flat_optimizer=True)
    Engine(_model(), 1, GradientAllReduceAlgorithm(), make)  # one worker: every view is contiguous


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_the_flat_fused_optimizer_trains_as_the_views_do():
    def run(flat, optimizer):
        engine = Engine(_model(), N, Algorithm.init("diloco", sync_every=5), optimizer, device="cuda",
                        flat_optimizer=flat)
        g = torch.Generator().manual_seed(1)
        for _ in range(14):
            x, y = torch.randn(N, B, 3, 4, generator=g), torch.randint(0, 3, (N, B), generator=g)
            engine.step(x.cuda(), y.cuda(), nn.functional.cross_entropy)
        return engine.model.params.detach().cpu()

    flat_optimizer, reference = OPTIMIZERS["adamw_fused"]
    torch.testing.assert_close(run(True, flat_optimizer), run(False, reference), rtol=1e-5, atol=1e-6)
