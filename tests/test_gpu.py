"""The CUDA path of the runtime (the communication thread's stream and events): skipped
without a GPU. Two gloo workers share one GPU (gloo reduces CUDA tensors too), so the
test runs on any machine with one CUDA device."""

from __future__ import annotations

import pytest
import torch

from gloo_workers import run_workers

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)).cuda()


def _data(step, rank, n):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(8 * n, 32, generator=g), torch.randint(0, 4, (8 * n,), generator=g)
    if rank >= 0:
        x, y = x[8 * rank:8 * (rank + 1)], y[8 * rank:8 * (rank + 1)]
    return x.cuda(), y.cuda()


def _cuda_training(rank, n):
    from bagua_algos.algorithms import DecentralizedAlgorithm, GradientAllReduceAlgorithm

    out = {}
    for key, algorithm in (("allreduce", GradientAllReduceAlgorithm()),
                           ("gossip", DecentralizedAlgorithm(hierarchical=False))):
        model = _model(seed=rank)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model.with_bagua([opt], algorithm, bucket_size=4096)
        for step in range(5):
            x, y = _data(step, rank, n)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        out[key] = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
    return out


def test_cuda_gradient_allreduce_matches_one_process_and_gossip_keeps_models_equal():
    n = 2
    results = run_workers(_cuda_training, n)
    reference = _model(seed=0)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(5):
        x, y = _data(step, -1, n)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(reference(x), y).backward()
        opt.step()
    expected = torch.cat([p.detach().reshape(-1) for p in reference.parameters()]).cpu()
    for out in results:
        torch.testing.assert_close(out["allreduce"], expected, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(results[0]["gossip"], results[1]["gossip"])
