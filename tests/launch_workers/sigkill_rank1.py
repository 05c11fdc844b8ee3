"""Worker for tests/test_launch_failures.py: rank 1 kills itself with SIGKILL (as the
OOM killer would) once every other rank is blocked; the others never end by themselves.

Usage: sigkill_rank1.py MODE, MODE one of
  sleep    the other ranks sleep;
  barrier  the other ranks wait in a barrier that rank 1 never joins (if the barrier
           fails when rank 1 is gone, they sleep).

Every rank first joins one barrier with all the others; then the other ranks signal
(through the process group's store) that they are about to block, and rank 1 waits for
all of them, lets them reach the blocking call, and kills itself.
"""

import os
import signal
import sys
import time
from datetime import timedelta

import torch.distributed as dist

LIMIT = 60  # seconds a blocked rank waits at most (the test's timeout is shorter)


def main():
    mode = sys.argv[1]
    if mode not in ("sleep", "barrier"):
        raise SystemExit(f"unknown mode {mode!r}")
    # The barrier's collective timeout outlasts the test: only the launcher ends it.
    dist.init_process_group("gloo", timeout=timedelta(seconds=LIMIT))
    rank, world = dist.get_rank(), dist.get_world_size()
    store = dist.distributed_c10d._get_default_store()
    dist.barrier()
    if rank == 1:
        store.wait([f"blocking_{r}" for r in range(world) if r != 1], timedelta(seconds=LIMIT))
        time.sleep(0.5)  # let them enter the blocking call
        print("rank 1: killing myself with SIGKILL", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(LIMIT)  # not reached
    store.set(f"blocking_{rank}", "1")
    started = time.time()
    if mode != "sleep":
        try:
            dist.barrier()
        except Exception as exc:  # rank 1 is gone
            print(f"rank {rank}: barrier raised {type(exc).__name__}", file=sys.stderr, flush=True)
    time.sleep(max(0.0, LIMIT - (time.time() - started)))
    sys.exit(0)


if __name__ == "__main__":
    main()
