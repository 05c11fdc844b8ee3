"""Worker for tests/test_launch.py: all-reduce the ranks and record the env.

Usage: allreduce_env.py OUT_DIR
Writes OUT_DIR/rank_<RANK>.json with the launcher-provided environment.
"""

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist


def main():
    out_dir = sys.argv[1]
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank = dist.get_rank()
    world = dist.get_world_size()
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    expected = world * (world - 1) / 2
    if t.item() != expected:
        print(f"rank {rank}: all_reduce gave {t.item()}, expected {expected}",
              file=sys.stderr)
        sys.exit(5)
    keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK",
            "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"]
    record = {k: os.environ.get(k) for k in keys}
    record["allreduce_sum"] = t.item()
    path = os.path.join(out_dir, f"rank_{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
