"""One small job, run two ways: as n gloo processes (the per-rank algorithms) and on the
one-process engine (their stacked forms). tests/test_engine_equality.py compares them.

Both forms start from the same model (seeded), read the same batches (rank i's
DistributedHeterogeneousSampler share, α = 0.1 unless a test passes its own) and take
STEPS steps of SGD with momentum and weight decay (a case's "optimizer" settings
override SGD's, e.g. {"nesterov": True}; qadam: of its QAdamOptimizer, QADAM_OPTIMIZER
and a case's "optimizer" settings, warm-up then compression within the STEPS); each
returns every worker's parameters as one vector in registration order."""

from __future__ import annotations

import torch

STEPS = 20
BATCH = 8
ALPHA = 0.1
SEED = 3
LR, MOMENTUM, WEIGHT_DECAY = 0.05, 0.9, 1e-4
# eps 1e-2, not Adam's 1e-8: this small ReLU model has coordinates whose gradient is zero
# through the 5 warm-up steps (dead units), so their v is frozen at 0; the first momentum
# they get afterwards (their own, or a nonzero 8-bit level of zero) moves them by about
# lr·m/eps, 10^3 and more per step with 1e-8 (in both forms alike: Bagua's update is so),
# and the run diverges into NaN.
QADAM_OPTIMIZER = {"lr": 0.01, "warmup_steps": 5, "eps": 1e-2}


def data():
    g = torch.Generator().manual_seed(11)
    centres = torch.randn(4, 12, generator=g) * 2
    y = torch.arange(256) % 4
    x = centres[y] + torch.randn(256, 12, generator=g)
    return x, y


def model():
    torch.manual_seed(SEED)
    return torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.ReLU(), torch.nn.Linear(24, 16),
                               torch.nn.ReLU(), torch.nn.Linear(16, 4))


def optimizer(params, **settings):
    """SGD with momentum and weight decay; ``settings`` override torch.optim.SGD's (e.g. nesterov=True)."""
    return torch.optim.SGD(params, **{"lr": LR, "momentum": MOMENTUM, "weight_decay": WEIGHT_DECAY, **settings})


def build_optimizer(name, kwargs, params):
    """The optimizer of a case: SGD (a case's "optimizer" settings override its own),
    or for qadam its QAdamOptimizer."""
    if name == "qadam":
        from bagua_algos.algorithms import QAdamOptimizer

        return QAdamOptimizer(params, **{**QADAM_OPTIMIZER, **kwargs.get("optimizer", {})})
    return optimizer(params, **kwargs.get("optimizer", {}))


def build_algorithm(name, kwargs, optimizer_=None):
    from bagua_algos import Algorithm

    kwargs = {k: v for k, v in kwargs.items() if k != "optimizer"}
    if ":" in name:  # an algorithm named by its code, FILE.py:ClassName (as the sweep's --configs)
        from bagua_algos.algorithm_source import load_algorithm_class

        return load_algorithm_class(name)(**kwargs)
    if name == "qadam":
        return Algorithm.init(name, q_adam_optimizer=optimizer_, **kwargs)
    return Algorithm.init(name, **kwargs)


def _epochs():
    for epoch in range(STEPS):
        yield epoch


def per_rank(rank, world, cases, alpha=ALPHA):
    """In a gloo worker: {label: this rank's parameters after STEPS steps} per case
    (``alpha``: the shares' Dirichlet concentration)."""
    from torch.utils.data import DataLoader, TensorDataset

    from samplers import DistributedHeterogeneousSampler

    x, y = data()
    out = {}
    for label, name, kwargs in cases:
        net = model()
        opt = build_optimizer(name, kwargs, net.parameters())
        net = net.with_bagua([opt], build_algorithm(name, kwargs, opt))
        sampler = DistributedHeterogeneousSampler(TensorDataset(x, y), num_replicas=world, rank=rank, alpha=alpha,
                                                  seed=SEED, labels=y)
        loader = DataLoader(TensorDataset(x, y), batch_size=BATCH, sampler=sampler)
        step = 0
        for epoch in _epochs():
            sampler.set_epoch(epoch)
            for xb, yb in loader:
                if step == STEPS:
                    break
                _before_step(name, kwargs, net, opt)
                torch.nn.functional.cross_entropy(net(xb), yb).backward()
                opt.step()
                step += 1
        net.bagua_ddp.detach()
        out[label] = torch.nn.utils.parameters_to_vector(net.parameters()).detach().clone()
    return out


def _before_step(name, kwargs, net, opt) -> None:
    """What the training loop of a gloo worker does before a step's forward."""
    if not (name == "powersgd" and kwargs.get("error_in_grad")):
        opt.zero_grad()  # (powersgd's error_in_grad keeps the error in p.grad and resets it itself)
    if name == "powersgd" and kwargs.get("async_error") == "adaptive":
        # The engine's transfers are never in flight at the next step, so its adaptive slice
        # stays the whole buffer; this run is held to that by waiting for them here (else
        # a transfer late on a loaded machine would halve the slice, at random).
        net.bagua_ddp.bagua_algorithm.wait_async_error()


def stacked(world, name, kwargs, alpha=ALPHA, dtype=torch.float32):
    """On the engine: [world, d] parameters (registration order) after STEPS steps
    (``dtype``: of the model and the inputs, float64 for a comparison with an oracle)."""
    from bagua_algos.engine import Engine
    from samplers import WorkerShares

    x, y = data()
    x, net = x.to(dtype), model().to(dtype)
    if name == "qadam":  # QAdam's optimizer is the algorithm's: the engine stacks its settings
        engine = Engine(net, world, build_algorithm(name, kwargs, build_optimizer(name, kwargs, net.parameters())), None)
    else:
        engine = Engine(net, world, build_algorithm(name, kwargs), lambda params: build_optimizer(name, kwargs, params))
    shares = WorkerShares(y, world, alpha, SEED)
    step = 0
    for epoch in _epochs():
        for index in shares.batches(epoch, BATCH):
            if step == STEPS:
                break
            engine.step(x[index], y[index], torch.nn.functional.cross_entropy)
            step += 1
    names = [name for name, _ in net.named_parameters()]
    rows = []
    for i in range(world):
        state = engine.model.worker_state(i)
        rows.append(torch.cat([state[n].reshape(-1) for n in names]))
    return torch.stack(rows)


class GradientProbe(torch.nn.Module):
    """Σ_p <p, g_p> over parameters of the given ``shapes`` (drawn from ``seed``): the
    gradient of each parameter is exactly its slice of the input ``g`` (a flat vector in
    registration order), so every form reduces the gradients a test chooses."""

    def __init__(self, shapes, seed: int):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.weights = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(s, generator=generator)) for s in shapes)

    def forward(self, g):
        out, offset = 0.0, 0
        for p in self.weights:
            out = out + (p * g[offset:offset + p.numel()].view(p.shape)).sum()
            offset += p.numel()
        return out


def checkpoint_resume(rank, world, name, kwargs, bucket):
    """In a gloo worker: train 4 steps of SGD with momentum under ``Algorithm.init(name,
    **kwargs)``, checkpoint (model, optimizer, ``bagua_state_dict``), train 4 more; a fresh
    model resumed from the checkpoint takes the same 4 more steps. Returns (equal bit for
    bit, bucket ``bucket``'s saved state)."""
    import copy

    from bagua_algos import Algorithm

    x, y = data()
    xs, ys = x[rank::world][:64].view(8, 8, 12), y[rank::world][:64].view(8, 8)

    def wrapped():
        net = model()
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        return net.with_bagua([opt], Algorithm.init(name, **kwargs)), opt

    def steps(net, opt, batches):
        for k in batches:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(xs[k]), ys[k]).backward()
            opt.step()

    net, opt = wrapped()
    steps(net, opt, range(4))
    checkpoint = copy.deepcopy({"model": net.state_dict(), "opt": opt.state_dict(), "bagua": net.bagua_state_dict()})
    steps(net, opt, range(4, 8))
    resumed, resumed_opt = wrapped()
    resumed.load_state_dict(checkpoint["model"])
    resumed_opt.load_state_dict(checkpoint["opt"])
    resumed.load_bagua_state_dict(checkpoint["bagua"])
    steps(resumed, resumed_opt, range(4, 8))
    same = all(torch.equal(a, b) for a, b in zip(net.parameters(), resumed.parameters()))
    return same, checkpoint["bagua"]["bucket_state"][bucket]
