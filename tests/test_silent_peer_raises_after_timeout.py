"""A peer that stops taking steps is an error on the others after the process group's
timeout, never a hang: gradient allreduce (flat and hierarchical), decentralized
(hierarchical and over a gossip topology) and relay, each on its own 4 gloo workers
(two "nodes" of two) with a 3-second timeout."""

from __future__ import annotations

import pathlib
import time

import pytest
import torch

from bagua_algos.algorithms import DecentralizedAlgorithm, GradientAllReduceAlgorithm, RelayAlgorithm
from bagua_algos.experiments.gloo_workers import run_workers


def bn_model(seed: int = 0, hidden: int = 12) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(5, hidden), torch.nn.BatchNorm1d(hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 2)
    )


def train(model, opt, steps, rank, start=0):
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(8, 5, generator=g), torch.randint(0, 2, (8,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


SILENT_CASES = {
    "gradient_allreduce": lambda: GradientAllReduceAlgorithm(),
    "gradient_allreduce_hierarchical": lambda: GradientAllReduceAlgorithm(hierarchical=True),
    "decentralized_hierarchical": lambda: DecentralizedAlgorithm(hierarchical=True),
    "decentralized_ring": lambda: DecentralizedAlgorithm(topology="ring"),
    "relay": lambda: RelayAlgorithm(topology="chain"),
}


SILENCE_CAP_S = 30.0  # the silent peer's longest silence; the others must raise well before


def _file_barrier(directory: pathlib.Path, rank: int, n: int, cap_s: float = 60.0) -> None:
    """Every worker here before any goes on, through files, not the group: the first
    collective then starts on every worker within a poll of the others, however long each
    took to build its model and first optimizer (which imports torch._dynamo: seconds on
    a loaded machine, against the group's 3-second timeout)."""
    directory.mkdir(exist_ok=True)
    (directory / str(rank)).touch()
    deadline = time.monotonic() + cap_s
    while len(list(directory.iterdir())) < n and time.monotonic() < deadline:
        time.sleep(0.02)


def _silent_peer(rank, n, case, work_dir):
    model = bn_model(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _file_barrier(pathlib.Path(work_dir) / "ready", rank, n)
    model.with_bagua([opt], SILENT_CASES[case]())
    train(model, opt, 1, rank)
    done = pathlib.Path(work_dir) / "done"
    done.mkdir(exist_ok=True)
    if rank == n - 1:
        # Silent: takes no further step until every other worker has its outcome (so its
        # return cannot be what ends their wait), at most SILENCE_CAP_S.
        deadline = time.monotonic() + SILENCE_CAP_S
        while len(list(done.iterdir())) < n - 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        return None
    start = time.monotonic()
    try:
        # Gossip reaches the silent peer's far neighbours one hop per step.
        train(model, opt, 8, rank, start=1)
        outcome = time.monotonic() - start, "no error"
    except Exception as exc:  # noqa: BLE001 - the point is that it raises
        outcome = time.monotonic() - start, f"{type(exc).__name__}: {exc}"[:300]
    (done / str(rank)).touch()
    return outcome


@pytest.mark.parametrize("case", sorted(SILENT_CASES))
def test_a_silent_peer_is_an_error_after_the_timeout(case, tmp_path):
    results = run_workers(_silent_peer, 4, case, str(tmp_path), pg_timeout=3.0, timeout=120,
                          env={"LOCAL_WORLD_SIZE": "2"})
    for rank, result in enumerate(results[:-1]):
        elapsed, message = result
        assert message != "no error", (rank, case)
        assert elapsed < 20.0, (rank, case, elapsed, message)
