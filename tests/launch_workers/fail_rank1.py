"""Worker for tests/test_launch.py: rank 1 dies with exit code 3 after init,
rank 0 waits in a barrier that can only end by the collective's timeout
(30 s) or by the launcher stopping it.
"""

import os
import sys
import time
from datetime import timedelta

import torch.distributed as dist


def main():
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    if dist.get_rank() == 1:
        print("rank 1: exiting with code 3", file=sys.stderr, flush=True)
        os._exit(3)
    started = time.time()
    try:
        dist.barrier()
    except Exception as exc:  # peer gone: keep blocking until stopped
        print(f"rank 0: barrier raised {type(exc).__name__}; sleeping",
              file=sys.stderr, flush=True)
        time.sleep(max(0.0, 60 - (time.time() - started)))
    sys.exit(0)


if __name__ == "__main__":
    main()
