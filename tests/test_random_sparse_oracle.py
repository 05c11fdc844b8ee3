"""Random K and Random Block (seed 001 Table 4) trained on the one-process engine against
the independent re-implementation of the reference code in ``random_sparse_oracle.py``:
the same model, batches, seeds and schedule; SGD with momentum and weight decay after
the reduction; several steps; every worker's parameters equal the oracle's to float
tolerance. The oracle holds its own rules (sizes r·(n + m), shared indices, averaging
without rescaling, memory = A − D(C(A)), momentum after decompression), so a change of
any of them in the package fails here."""

from __future__ import annotations

import pytest
import torch

from bagua_algos import Algorithm
from bagua_algos.engine import Engine

import random_sparse_oracle as oracle

WORKERS = 4
BATCH = 8
STEPS = 12
LR, MOMENTUM, WEIGHT_DECAY = 0.05, 0.9, 1e-4


def _model():
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.ReLU(), torch.nn.Linear(24, 16),
                               torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _batches():
    g = torch.Generator().manual_seed(17)
    centres = torch.randn(4, 12, generator=g) * 2
    out = []
    for _ in range(STEPS):
        y = torch.randint(0, 4, (WORKERS, BATCH), generator=g)
        out.append((centres[y] + torch.randn(WORKERS, BATCH, 12, generator=g), y))
    return out


def _engine_run(name, kwargs):
    """[WORKERS] dicts of parameters after STEPS engine steps, and the bucket layout."""
    module = _model()
    engine = Engine(module, WORKERS, Algorithm.init(name, **kwargs),
                    lambda p: torch.optim.SGD(p, lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY))
    layout = None
    for x, y in _batches():
        engine.step(x, y, torch.nn.functional.cross_entropy)
        if layout is None:
            layout = [[t.bagua_tensor_name for t in b.tensors] for b in engine.runtime.bagua_buckets]
    return [engine.model.worker_state(i) for i in range(WORKERS)], layout


def _oracle_run(method, layout, rank, seed, error_feedback, min_compression_rate=2.0):
    module = _model()
    shapes = {k: tuple(p.shape) for k, p in module.named_parameters()}
    reducer = oracle.RandomSparseReducer(method, layout, shapes, WORKERS, rank, seed=seed,
                                         error_feedback=error_feedback, min_compression_rate=min_compression_rate)
    params = oracle.train(module, reducer, oracle.SGDMomentum(MOMENTUM, WEIGHT_DECAY), _batches(),
                          torch.nn.functional.cross_entropy, LR)
    return params, reducer


CASES = [
    ("random_k", 1, 0, True),
    ("random_k", 2, 3, True),  # rank 2: the 4 x 16 layer is sent whole (PowerSGD's rate rule)
    ("random_k", 1, 1, False),
    ("random_block", 1, 0, True),
    ("random_block", 2, 7, True),
    ("random_block", 1, 2, False),
]


@pytest.mark.parametrize("method,rank,seed,error_feedback", CASES)
def test_engine_equals_the_reference_semantics(method, rank, seed, error_feedback):
    workers, layout = _engine_run(method, {"powersgd_rank": rank, "seed": seed, "error_feedback": error_feedback})
    expected, reducer = _oracle_run(method, layout, rank, seed, error_feedback)
    for w, state in enumerate(workers):
        for name, value in expected.items():
            torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{method} r={rank} worker {w} {name}: {m}")
    # the case compresses: some tensor sends fewer values than it has, and the run is not SGD's
    assert any(reducer.sizes[k] < v.numel() for k, v in expected.items())
    sgd = oracle.train(_model(), None, oracle.SGDMomentum(MOMENTUM, WEIGHT_DECAY), _batches(),
                       torch.nn.functional.cross_entropy, LR)
    assert any(not torch.allclose(sgd[k], expected[k], rtol=1e-3, atol=1e-4) for k in sgd)


def test_the_oracle_is_sensitive_to_its_rules():
    """The equality above would catch a scaled, unshared or unremembered update: each such
    variant of the oracle moves the parameters away from the reference one."""
    layout = _engine_run("random_k", {"powersgd_rank": 1})[1]
    reference, _ = _oracle_run("random_k", layout, 1, 0, True)
    variants = {}
    variants["no memory"], _ = _oracle_run("random_k", layout, 1, 0, False)
    variants["another seed"], _ = _oracle_run("random_k", layout, 1, 1, True)

    class Rescaled(oracle.RandomSparseReducer):
        def reduce(self, grads):
            out = super().reduce(grads)
            return {k: v * (v.numel() / self.sizes[k]) for k, v in out.items()}

    module = _model()
    shapes = {k: tuple(p.shape) for k, p in module.named_parameters()}
    rescaled = Rescaled("random_k", layout, shapes, WORKERS, 1, min_compression_rate=2.0)
    variants["rescaled by numel / b"] = oracle.train(module, rescaled, oracle.SGDMomentum(MOMENTUM, WEIGHT_DECAY),
                                                     _batches(), torch.nn.functional.cross_entropy, LR)
    for label, params in variants.items():
        assert any(not torch.allclose(params[k], reference[k], rtol=1e-3, atol=1e-4) for k in params), label


def test_memory_keeps_what_was_not_sent():
    """Error feedback loses nothing: after any number of steps, the sum of the applied
    updates plus the workers' mean memory is the sum of the workers' mean gradients."""
    module = _model()
    shapes = {k: tuple(p.shape) for k, p in module.named_parameters()}
    reducer = oracle.RandomSparseReducer("random_block", [list(shapes)], shapes, WORKERS, 1)
    g = torch.Generator().manual_seed(3)
    applied = {k: torch.zeros(s) for k, s in shapes.items()}
    total = {k: torch.zeros(s) for k, s in shapes.items()}
    for _ in range(6):
        grads = [{k: torch.randn(s, generator=g) for k, s in shapes.items()} for _ in range(WORKERS)]
        for k, v in reducer.reduce(grads).items():
            applied[k] += v
        for k in shapes:
            total[k] += torch.stack([gr[k] for gr in grads]).mean(0)
    for k, s in shapes.items():
        memory = torch.stack([m[k] for m in reducer.memory]).mean(0).view(s)
        torch.testing.assert_close(applied[k] + memory, total[k], rtol=1e-5, atol=1e-5)
        if reducer.sizes[k] < memory.numel():
            assert memory.abs().sum() > 0
