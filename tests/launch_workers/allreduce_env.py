"""Worker for tests/test_launch.py: all-reduce the ranks (flat and two-level, through
the plugin's comm module) and record the env.

Usage: allreduce_env.py OUT_DIR
Writes OUT_DIR/rank_<RANK>.json with the launcher-provided environment.
"""

import json
import os
import sys
from datetime import timedelta

import torch

import bagua_algos
from bagua_algos.runtime import comm


def main():
    out_dir = sys.argv[1]
    bagua_algos.init_process_group(timeout=timedelta(seconds=30))
    rank = bagua_algos.get_rank()
    world = bagua_algos.get_world_size()
    t = torch.tensor([float(rank)])
    bagua_algos.allreduce_inplace(t)
    expected = world * (world - 1) / 2
    if t.item() != expected:
        print(f"rank {rank}: all_reduce gave {t.item()}, expected {expected}",
              file=sys.stderr)
        sys.exit(5)
    two_level = torch.tensor([float(rank)])
    comm.hierarchical_allreduce_inplace(two_level, comm.ReduceOp.AVG)
    if two_level.item() != expected / world:
        print(f"rank {rank}: hierarchical average gave {two_level.item()}", file=sys.stderr)
        sys.exit(6)
    keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK",
            "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"]
    record = {k: os.environ.get(k) for k in keys}
    record["allreduce_sum"] = t.item()
    record["comm"] = [comm.get_local_rank(), comm.get_local_size(), comm.get_node_rank()]
    path = os.path.join(out_dir, f"rank_{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)
    comm.destroy_process_group()


if __name__ == "__main__":
    main()
