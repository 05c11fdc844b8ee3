"""Worker for tests/test_netem.py: a few training steps with one algorithm, then the
final parameters to a file, so runs on different layouts can be compared.

Usage: train_and_dump.py OUT_DIR ALGORITHM
(ALGORITHM: gradient_allreduce | decentralized_hierarchical)
Each worker trains on its own slice of a fixed global batch (by global rank), so the
result depends on the world size only, not on how workers are split into nodes.
Writes OUT_DIR/rank_<RANK>.pt with the flattened parameters and the node layout.
"""

import os
import sys
from datetime import timedelta

import torch

import bagua_algos
from bagua_algos.algorithms import DecentralizedAlgorithm, GradientAllReduceAlgorithm
from bagua_algos.runtime import comm

STEPS = 4
PER_WORKER = 8


def main():
    out_dir, name = sys.argv[1], sys.argv[2]
    bagua_algos.init_process_group(timeout=timedelta(seconds=60))
    rank, world = bagua_algos.get_rank(), bagua_algos.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    algorithm = {
        "gradient_allreduce": lambda: GradientAllReduceAlgorithm(),
        "decentralized_hierarchical": lambda: DecentralizedAlgorithm(hierarchical=True),
    }[name]()
    model = model.with_bagua([optimizer], algorithm)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(world * PER_WORKER, 16, generator=g)
        y = torch.randint(0, 3, (world * PER_WORKER,), generator=g)
        mine = slice(rank * PER_WORKER, (rank + 1) * PER_WORKER)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x[mine]), y[mine]).backward()
        optimizer.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    layout = (comm.get_node_rank(), comm.get_local_rank(), comm.get_local_size())
    path = os.path.join(out_dir, f"rank_{rank}.pt")
    torch.save({"params": flat, "layout": layout}, path + ".tmp")
    os.replace(path + ".tmp", path)
    comm.destroy_process_group()


if __name__ == "__main__":
    main()
