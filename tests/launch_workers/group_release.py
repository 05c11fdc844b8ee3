"""Fork gloo workers that train a step and leave; report which gloo threads outlive the group.

Usage: group_release.py WORKERS MODE

For tests/test_comm.py. Each worker joins a gloo group through comm, builds its first
optimizer *after* init_process_group (which imports torch.distributed.nn.functional,
whose functions capture the live default group as a default argument), trains one
step under with_bagua and leaves the group. It then lists the threads of its process
that belong to gloo: a freed group leaves none.

- MODE "comm": comm.destroy_process_group(), threads listed right after it; then a
  second group, and torch.distributed.nn.functional.all_reduce over its default group
  (the defaults comm rewrote must still work).
- MODE "torch": torch's own dist.destroy_process_group(); threads listed at exit, after
  comm's exit hook.

Prints one JSON line: {"workers": [{"gloo_threads": [...], "second_group_sum": x}, ...]}
(no second_group_sum in mode "torch").
"""

import atexit
import gc
import json
import os
import sys
import tempfile
import warnings
from datetime import timedelta

import torch

import bagua_algos  # noqa: F401 - patches nn.Module.with_bagua
from bagua_algos.algorithms import gradient_allreduce
from bagua_algos.runtime import comm
from forked_job import run_forked_job

GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop")


def gloo_threads() -> list[str]:
    """The names of this process's gloo threads (after a collection, so that nothing
    merely unreachable keeps a group alive)."""
    gc.collect()
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return sorted(n for n in names if n in GLOO_THREADS)


def worker(rank: int, world: int, mode: str, tmp: str, out_path: str) -> None:
    def report(**fields) -> None:
        with open(out_path, "w") as f:
            json.dump({"gloo_threads": gloo_threads(), **fields}, f)

    if mode == "torch":
        atexit.register(report)  # registered before comm's hook, so it runs after it
    torch.set_num_threads(1)
    timeout = timedelta(seconds=60)
    store = torch.distributed.FileStore(os.path.join(tmp, "store1"), world)
    comm.init_process_group(store, rank, world, backend="gloo", timeout=timeout)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # the first optimizer: after init
    model = model.with_bagua([optimizer], gradient_allreduce.GradientAllReduceAlgorithm())
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    if mode == "torch":
        torch.distributed.destroy_process_group()
        return
    comm.destroy_process_group()
    threads = gloo_threads()

    import torch.distributed.nn.functional as dist_fn

    store = torch.distributed.FileStore(os.path.join(tmp, "store2"), world)
    comm.init_process_group(store, rank, world, backend="gloo", timeout=timeout)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated in torch, still shipped
        total = dist_fn.all_reduce(torch.full((2,), float(rank + 1)))
    comm.destroy_process_group()
    with open(out_path, "w") as f:
        json.dump({"gloo_threads": threads, "second_group_sum": float(total[0])}, f)


def main() -> None:
    world, mode = int(sys.argv[1]), sys.argv[2]
    tmp = tempfile.mkdtemp()
    codes = run_forked_job(
        world, lambda rank: worker(rank, world, mode, tmp, os.path.join(tmp, f"rank{rank}.json")))
    if any(codes):
        print(json.dumps({"codes": codes}))
        sys.exit(1)
    reports = []
    for rank in range(world):
        with open(os.path.join(tmp, f"rank{rank}.json")) as f:
            reports.append(json.load(f))
    print(json.dumps({"workers": reports}))


if __name__ == "__main__":
    main()
