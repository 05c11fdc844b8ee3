"""Short training runs of the algorithm table's rows on a worker, for the tests that
compare runs of one seed across devices, backends or transports (tests/test_gpu.py:
CUDA against CPU, NCCL against gloo; tests/test_host_staging.py: through host copies
against direct).

Same seed, same start: the model is built and every batch drawn on the CPU, then
moved, so a CUDA run starts where the CPU run starts and may differ only by float
rounding (a row's ``tolerance``)."""

from __future__ import annotations

import torch

from bagua_algos.algorithms.table import ALGORITHM_TABLE, config_by_label

STEPS = 6


def labels_for(world_size: int, *, across_devices: bool = False) -> list[str]:
    """The rows whose runs are compared here: those that run with ``world_size``
    workers and give one result per seed (not the background rounds of async); with
    ``across_devices``, only those whose CPU and CUDA runs agree (not stochastic
    rounding)."""
    return [c.label for c in ALGORITHM_TABLE
            if c.runs_with(world_size) and not c.background_rounds and (c.device_independent or not across_devices)]


def train(label: str, device: torch.device, steps: int = STEPS) -> torch.Tensor:
    """This worker's parameters (on the CPU) after ``steps`` steps of row ``label`` on
    ``device``; a row with background rounds is stopped with ``abort`` at the end."""
    from bagua_algos.runtime import comm

    config = config_by_label(label)
    rank = comm.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)).to(device)
    optimizer = config.optimizer_for(model.parameters(), lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9))
    model.with_bagua([optimizer], config.build(optimizer), bucket_size=4096)
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(8, 32, generator=g).to(device), torch.randint(0, 4, (8,), generator=g).to(device)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    if config.background_rounds:
        model.bagua_algorithm.abort(model)
    model.bagua_ddp.detach()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()


def train_all(labels: list[str], device: torch.device) -> dict[str, torch.Tensor]:
    """:func:`train` for every row of ``labels``, in order (every worker the same)."""
    return {label: train(label, device) for label in labels}


def assert_runs_agree(got: dict, want: dict, rank: int, what: str) -> None:
    """Every row's parameters in ``got`` equal those in ``want`` to the row's tolerance."""
    assert got.keys() == want.keys()
    for label in want:
        torch.testing.assert_close(got[label], want[label], atol=config_by_label(label).tolerance, rtol=1e-4,
                                   msg=lambda m: f"{label}, rank {rank}, {what}: {m}")
