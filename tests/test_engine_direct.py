"""The engine's direct path (engine/direct.py): a plain stack of linear layers and
activations runs without vmap and must give every worker the loss and gradient that
the vmapped functional_call gives; anything else must fall back to vmap."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from bagua_algos.algorithms import GradientAllReduceAlgorithm
from bagua_algos.engine import Engine
from bagua_algos.engine.direct import direct_plan, stacked_loss

N, B = 5, 6


def _mlp_flatten():
    return nn.Sequential(nn.Flatten(), nn.Linear(12, 9), nn.GELU(), nn.Linear(9, 7, bias=False), nn.Tanh(),
                         nn.Linear(7, 3))


def _nested_with_frozen():
    net = nn.Sequential(nn.Sequential(nn.Linear(12, 8), nn.LeakyReLU(0.1)), nn.Linear(8, 3))
    net[0][0].weight.requires_grad_(False)
    return net


def _sequence_input():  # a linear layer on [b, s, features]: the rows of every position
    return nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Flatten(), nn.Linear(15, 3))


MODELS = {"mlp_flatten": (_mlp_flatten, (3, 4)), "nested_frozen": (_nested_with_frozen, (12,)),
          "sequence": (_sequence_input, (3, 4))}


def _engine(make, direct: bool):
    torch.manual_seed(0)
    engine = Engine(make(), N, GradientAllReduceAlgorithm(), lambda p: torch.optim.SGD(p, lr=0.1))
    assert (engine.model._direct is not None) is True
    if not direct:
        engine.model._direct = None  # the vmapped functional_call of every other model
    return engine


def _mean_squared_error(out, y):
    return ((out - nn.functional.one_hot(y, out.shape[-1]).float()) ** 2).mean()


@pytest.mark.parametrize("loss_fn", [nn.functional.cross_entropy, _mean_squared_error], ids=["cross_entropy", "mse"])
@pytest.mark.parametrize("model", MODELS)
def test_direct_path_gives_every_worker_the_vmapped_loss_and_gradient(model, loss_fn):
    make, shape = MODELS[model]
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(N, B, *shape, generator=g), torch.randint(0, 3, (N, B), generator=g)
    direct, vmapped = _engine(make, True), _engine(make, False)
    for _ in range(3):  # SGD steps apart: the rows must stay equal
        torch.testing.assert_close(direct.step(x, y, loss_fn), vmapped.step(x, y, loss_fn), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(direct.model.grads, vmapped.model.grads, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(direct.model.params, vmapped.model.params, rtol=1e-6, atol=1e-7)
    assert direct.model.grads.abs().sum() > 0


def test_direct_cross_entropy_is_each_workers_mean():
    g = torch.Generator().manual_seed(2)
    out, y = torch.randn(N, B, 4, generator=g), torch.randint(0, 4, (N, B), generator=g)
    per_worker = torch.stack([nn.functional.cross_entropy(out[i], y[i]) for i in range(N)])
    torch.testing.assert_close(stacked_loss(nn.functional.cross_entropy)(out, y), per_worker)


class _Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        return x + self.linear(x)


@pytest.mark.parametrize("module", [
    nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)),          # randomness per worker: vmap's
    nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)),        # buffers
    nn.Sequential(_Residual()),                               # its own forward
    nn.Sequential(),                                          # nothing to run
], ids=["dropout", "batchnorm", "custom_forward", "empty"])
def test_other_models_run_under_vmap(module):
    assert direct_plan(module) is None


def test_a_bare_linear_layer_runs_direct():
    assert direct_plan(nn.Linear(4, 4)) is not None


def test_a_hook_sends_the_model_to_vmap():
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    assert direct_plan(net) is not None
    net[1].register_forward_hook(lambda *args: None)
    assert direct_plan(net) is None


def _conv_batchnorm():  # no direct plan: vmap, with stacked buffers
    return nn.Sequential(nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 2 * 2, 3))


@pytest.mark.parametrize("make,shape", [(_mlp_flatten, (3, 4)), (_nested_with_frozen, (12,)),
                                        (_conv_batchnorm, (1, 4, 4))])
def test_predict_with_average_is_every_worker_then_the_averaged_model(make, shape):
    """predict(with_average=True), one batched call (direct or vmapped): rows 0..n-1 are
    predict's, row n is predict_averaged's, for workers whose models (and BatchNorm
    statistics) differ."""
    torch.manual_seed(0)
    engine = Engine(make(), N, GradientAllReduceAlgorithm(), lambda p: torch.optim.SGD(p, lr=0.1))
    with torch.no_grad():
        engine.model.params.add_(torch.randn_like(engine.model.params))
        for buffer in engine.model.buffers.values():
            if buffer.is_floating_point():
                buffer.add_(torch.rand_like(buffer))
    x = torch.randn(40, *shape)
    both = engine.model.predict(x, chunk=16, with_average=True)
    workers = engine.model.predict(x, chunk=16)
    assert both.shape == (N + 1, 40)
    assert torch.equal(both[:N], workers) and torch.equal(both[N], engine.model.predict_averaged(x))
    assert len({tuple(row.tolist()) for row in workers}) > 1  # the workers do differ


def test_a_layer_used_twice_runs_under_vmap():
    linear = nn.Linear(4, 4)
    assert direct_plan(nn.Sequential(linear, nn.ReLU(), linear)) is None


@pytest.mark.parametrize("accumulate", [False, True], ids=["overwrite", "accumulate"])
def test_the_backward_writes_the_gradients_into_the_engines_matrix(accumulate):
    """The direct path's gradients go straight into X.grad (direct.GradSink): the same
    values, bit for bit, as autograd's gradients copied (or added) there."""
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(N, B, 3, 4, generator=g), torch.randint(0, 3, (N, B), generator=g)
    engine = _engine(_mlp_flatten, True)
    model = engine.model
    model.grads.copy_(torch.randn(model.grads.shape, generator=g))
    before = model.grads.clone()
    leaves = list(model._leaves.values())
    out = model._direct(x, {**model._leaves, **model.frozen})  # no sink: autograd returns the gradients
    expected = torch.autograd.grad(stacked_loss(nn.functional.cross_entropy)(out, y).sum(), leaves)
    model.forward_backward(x, y, nn.functional.cross_entropy, accumulate=accumulate)
    starts = {s.name: s.start for s in model.layout.slots}
    for (name, view), grad in zip(model._grad_targets.items(), expected):
        base = before[:, starts[name]:starts[name] + grad[0].numel()].view_as(grad)
        want = base + grad if accumulate else grad
        assert torch.equal(view, want), name


def test_a_step_trains_in_training_mode_whatever_a_submodule_was_set_to():
    """forward_backward skips module.train() when every submodule is training already:
    one left in eval mode (here BatchNorm, by the user) is put back, and its running
    statistics move with the step."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    engine = Engine(net, N, GradientAllReduceAlgorithm(), lambda p: torch.optim.SGD(p, lr=0.1))
    x, y = torch.randn(N, B, 4), torch.randint(0, 2, (N, B))
    engine.step(x, y, torch.nn.functional.cross_entropy)
    engine.model.module[1].eval()
    before = engine.model.buffers["1.running_mean"].clone()
    engine.step(x, y, torch.nn.functional.cross_entropy)
    assert all(m.training for m in engine.model.module.modules())
    assert not torch.equal(engine.model.buffers["1.running_mean"], before)
