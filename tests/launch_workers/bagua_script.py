"""A training script written for Bagua 0.9, in Bagua's idiom, with no bagua_algos
import: run under ``python -m bagua_algos.launch`` it must work unchanged.

Usage: bagua_script.py OUT_DIR ALGORITHM   (gradient_allreduce | decentralized | async)
Writes OUT_DIR/rank_<RANK>.pt with the final parameters and a few collective results.
"""

import argparse
import os

import torch

import bagua.torch_api as bagua
from bagua.torch_api.algorithms import async_model_average, decentralized, gradient_allreduce
from bagua.torch_api.contrib import fuse_optimizer


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("algorithm")
    args = parser.parse_args()

    local_rank, local_size = bagua.get_local_rank(), bagua.get_local_size()  # before init: from the env
    bagua.init_process_group()
    rank, world = bagua.get_rank(), bagua.get_world_size()

    # A few collectives with Bagua's signatures.
    t = torch.tensor([float(rank + 1)])
    total = torch.zeros(1)
    bagua.allreduce(t, total)
    gathered = torch.zeros(world)
    bagua.allgather(t, gathered)
    comm = bagua.communication._get_default_group().get_global_communicator()

    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if args.algorithm == "gradient_allreduce":
        algorithm = gradient_allreduce.GradientAllReduceAlgorithm()
        optimizer = fuse_optimizer(optimizer)
    elif args.algorithm == "decentralized":
        algorithm = decentralized.DecentralizedAlgorithm()
    else:
        algorithm = async_model_average.AsyncModelAverageAlgorithm(sync_interval_ms=10)
    model = model.with_bagua([optimizer], algorithm)

    for step in range(6):
        g = torch.Generator().manual_seed(10 * step + rank)
        x, y = torch.randn(16, 5, generator=g), torch.randint(0, 2, (16,), generator=g)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if args.algorithm == "gradient_allreduce":
            optimizer.fuse_step()
        else:
            optimizer.step()
    if args.algorithm == "async":
        model.bagua_algorithm.abort(model)

    torch.save(
        {
            "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
            "total": total.item(),
            "gathered": gathered.tolist(),
            "env": (rank, world, local_rank, local_size),
            "comm": (comm.rank(), comm.nranks()),
            "module_name": model.bagua_module_name,
            "bagua_file": bagua.__file__,
        },
        os.path.join(args.out_dir, f"rank_{rank}.pt"),
    )


if __name__ == "__main__":
    main()
