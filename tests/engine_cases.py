"""One small job, run two ways: as n gloo processes (the per-rank algorithms) and on the
one-process engine (their stacked forms). tests/test_engine_equality.py compares them.

Both forms start from the same model (seeded), read the same batches (rank i's
DistributedHeterogeneousSampler share, α = 0.1) and take STEPS steps of SGD with
momentum and weight decay; each returns every worker's parameters as one vector in
registration order."""

from __future__ import annotations

import torch

STEPS = 20
BATCH = 8
ALPHA = 0.1
SEED = 3
LR, MOMENTUM, WEIGHT_DECAY = 0.05, 0.9, 1e-4


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


def optimizer(params):
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)


def build_algorithm(name, kwargs, optimizer_=None):
    from bagua_algos import Algorithm

    if name == "qadam":
        return Algorithm.init(name, q_adam_optimizer=optimizer_, **kwargs)
    return Algorithm.init(name, **kwargs)


def _epochs():
    for epoch in range(STEPS):
        yield epoch


def per_rank(rank, world, cases):
    """In a gloo worker: {label: this rank's parameters after STEPS steps} per case."""
    from torch.utils.data import DataLoader, TensorDataset

    from samplers import DistributedHeterogeneousSampler

    x, y = data()
    out = {}
    for label, name, kwargs in cases:
        net = model()
        opt = optimizer(net.parameters())
        net = net.with_bagua([opt], build_algorithm(name, kwargs))
        sampler = DistributedHeterogeneousSampler(TensorDataset(x, y), num_replicas=world, rank=rank, alpha=ALPHA,
                                                  seed=SEED, labels=y)
        loader = DataLoader(TensorDataset(x, y), batch_size=BATCH, sampler=sampler)
        step = 0
        for epoch in _epochs():
            sampler.set_epoch(epoch)
            for xb, yb in loader:
                if step == STEPS:
                    break
                opt.zero_grad()
                torch.nn.functional.cross_entropy(net(xb), yb).backward()
                opt.step()
                step += 1
        net.bagua_ddp.detach()
        out[label] = torch.nn.utils.parameters_to_vector(net.parameters()).detach().clone()
    return out


def stacked(world, name, kwargs):
    """On the engine: [world, d] parameters (registration order) after STEPS steps."""
    from bagua_algos.engine import Engine
    from bagua_algos.engine.data import WorkerShares

    x, y = data()
    net = model()
    engine = Engine(net, world, build_algorithm(name, kwargs), optimizer)
    shares = WorkerShares(y, world, ALPHA, SEED)
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
