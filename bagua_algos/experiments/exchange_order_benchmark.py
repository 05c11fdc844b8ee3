"""How the posting order of a neighbour exchange's sends and receives affects its time
on gloo: every worker of a chain sends one message to each neighbour and receives one
from each, posted in several orders, against a ring allreduce of the same message.

Meant for bandwidth-limited links (on loopback the orders hardly differ)::

    sudo python benchmarks/netem.py --nodes 4 --rate 100mbit -- \\
        benchmarks/exchange_order_benchmark.py --megabytes 21

Rank 0 prints the median wall time of each pattern over ``--repeats`` exchanges (after
one untimed). Uses torch.distributed directly, so it measures gloo, not the plugin.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist


def chain_neighbours(rank: int, world: int) -> list[int]:
    return [peer for peer in (rank - 1, rank + 1) if 0 <= peer < world]


def patterns(message: torch.Tensor, inbox: dict, rank: int, world: int) -> dict:
    peers = chain_neighbours(rank, world)

    def wait(works):
        for work in works:
            work.wait()

    def sends_first():
        wait([dist.isend(message, p) for p in peers] + [dist.irecv(inbox[p], p) for p in peers])

    def receives_first():
        wait([dist.irecv(inbox[p], p) for p in peers] + [dist.isend(message, p) for p in peers])

    def per_neighbour():
        wait([w for p in peers for w in (dist.irecv(inbox[p], p), dist.isend(message, p))])

    def batched():
        ops = [dist.P2POp(dist.isend, message, p) for p in peers]
        ops += [dist.P2POp(dist.irecv, inbox[p], p) for p in peers]
        wait(dist.batch_isend_irecv(ops))

    def one_direction():  # a lower bound: each link carries one message one way
        works = [dist.isend(message, rank + 1)] if rank + 1 < world else []
        works += [dist.irecv(inbox[rank - 1], rank - 1)] if rank > 0 else []
        wait(works)

    return {
        "ring allreduce (reference)": lambda: dist.all_reduce(message),
        "one direction only": one_direction,
        "isend to both, then irecv from both": sends_first,
        "batch_isend_irecv": batched,
        "irecv from both, then isend to both": receives_first,
        "per neighbour: irecv, isend": per_neighbour,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megabytes", type=float, default=21.0, help="message size in MB (default 21: the mlp)")
    parser.add_argument("--repeats", type=int, default=3, help="timed exchanges per pattern (default 3)")
    args = parser.parse_args(argv)
    if args.megabytes <= 0 or args.repeats < 1:
        parser.error("--megabytes must be > 0 and --repeats >= 1")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world < 2:
        parser.error("run it on at least 2 workers")
    numel = int(args.megabytes * 1e6 / 4)
    message = torch.ones(numel)
    inbox = {p: torch.empty(numel) for p in range(world)}
    for name, run in patterns(message, inbox, rank, world).items():
        run()
        times = []
        for _ in range(args.repeats):
            dist.barrier()
            start = time.perf_counter()
            run()
            dist.barrier()
            times.append(time.perf_counter() - start)
        if rank == 0:
            print(f"{name:<40} {statistics.median(times) * 1e3:8.0f} ms", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
