"""The host staging of comm (gloo cannot take device memory, so CUDA tensors go through
host copies), run on the CPU so that it is checked on every machine: with staging
forced for every tensor, every collective, the neighbour exchange, the two-level
allreduce and every algorithm (each row of the algorithm table that gives one result
per seed) give exactly what they give without it. On a GPU,
tests/test_gpu.py runs the same code on real CUDA tensors."""

from __future__ import annotations

import torch

from algorithm_runs import labels_for, train_all
from collective_cases import TWO_NODES, all_collectives, staging_communicators
from bagua_algos.experiments.gloo_workers import run_workers


def _everything(rank, n):
    from bagua_algos.runtime import comm

    objects = staging_communicators()

    def run() -> dict:
        out = {f"collectives/{cn}": all_collectives(cn, obj) for cn, obj in objects.items()}
        right, left = (rank + 1) % n, (rank - 1) % n
        mine = torch.arange(5.0) + 10 * rank
        got = {"left": torch.zeros(5), "right": torch.zeros(5), "self": torch.zeros(5)}
        comm.neighbor_exchange([(right, mine), (left, mine * 2), (rank, mine)],
                               [(left, got["left"]), (right, got["right"]), (rank, got["self"])])
        out["neighbor_exchange"] = got
        t = torch.arange(6.0) * (rank + 1)
        comm.hierarchical_allreduce_inplace(t, comm.ReduceOp.AVG, async_op=True).wait()
        out["hierarchical"] = {"avg": t}
        out["algorithms"] = train_all(labels_for(n), torch.device("cpu"))
        return out

    direct = run()
    comm._Staging.needs_host = lambda self, t: True  # every tensor through a host copy
    return direct, run()


def test_staging_through_host_copies_changes_no_result():
    for rank, (direct, staged) in enumerate(run_workers(_everything, 4, env=TWO_NODES, timeout=300)):
        assert direct.keys() == staged.keys()
        for part in direct:
            for key in direct[part]:
                torch.testing.assert_close(staged[part][key], direct[part][key], rtol=0, atol=0,
                                           msg=lambda m: f"{part}/{key}, rank {rank}: {m}")
