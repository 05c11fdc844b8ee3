"""Worker for tests/test_exit.py: train under the async algorithm and exit *without*
calling ``abort()``. Before the exit hook this process hung at exit forever (the
executor's own exit hook joined a loop that only abort() ends)."""

import sys
from datetime import timedelta

import torch

import bagua_algos
from bagua_algos.algorithms import AsyncModelAverageAlgorithm


def main():
    bagua_algos.init_process_group(timeout=timedelta(seconds=30))
    rank = bagua_algos.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model = model.with_bagua([optimizer], AsyncModelAverageAlgorithm(sync_interval_ms=5))
    g = torch.Generator().manual_seed(rank)
    for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 10):
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 2, (16,), generator=g)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    rounds = model.bagua_algorithm.rounds
    print(f"rank {rank}: trained, {rounds} background rounds so far; exiting without abort()", flush=True)


if __name__ == "__main__":
    main()
