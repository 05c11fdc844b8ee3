"""Launch many small gloo jobs that use the neighbour exchange and check how they exit.

Usage: neighbor_exit.py LAUNCHES WORKERS

For tests/test_comm.py. Imports torch and the comm module once, then for each launch
forks WORKERS processes (a fork costs nothing, a fresh interpreter seconds) that join
a gloo group, run 15 steps of ``comm.start_neighbor_exchange`` along a chain and then
leave the interpreter normally (``sys.exit``: atexit hooks, module teardown, C++
static destructors), which is where a process group torn down badly aborts
("terminate called without an active exception"). Launches alternate between calling
``comm.destroy_process_group()`` and leaving the group to the module's exit hook.

Prints one JSON line: {"codes": [[exit code of each worker] for each launch]}
(a negative code is the signal that killed the worker).
"""

import gc
import json
import os
import shutil
import sys
import tempfile
from datetime import timedelta

import torch

from bagua_algos.runtime import comm
from forked_job import run_forked_job

STEPS = 15


def worker(rank: int, world: int, store_path: str, destroy: bool) -> int:
    torch.set_num_threads(1)
    store = torch.distributed.FileStore(store_path, world)
    comm.init_process_group(store, rank, world, backend="gloo", timeout=timedelta(seconds=60))
    for step in range(STEPS):
        sends, recvs, got = [], [], {}
        for peer in (rank - 1, rank + 1):
            if 0 <= peer < world:
                sends.append((peer, torch.full((1000,), float(100 * step + rank))))
                got[peer] = torch.zeros(1000)
                recvs.append((peer, got[peer]))
        comm.start_neighbor_exchange(sends, recvs).wait()
        for peer, t in got.items():
            if not bool((t == 100 * step + peer).all()):
                print(f"rank {rank} step {step}: wrong data from {peer}", file=sys.stderr)
                return 5
    if destroy:
        comm.destroy_process_group()
    return 0


def main() -> None:
    launches, world = int(sys.argv[1]), int(sys.argv[2])
    tmp = tempfile.mkdtemp()
    codes = []
    gc.freeze()  # the workers' interpreter teardown then skips scanning what they inherit
    for launch in range(launches):
        store_path = os.path.join(tmp, f"store{launch}")
        destroy = launch % 2 == 0
        codes.append(run_forked_job(world, lambda rank: worker(rank, world, store_path, destroy)))
    shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps({"codes": codes}))


if __name__ == "__main__":
    main()
