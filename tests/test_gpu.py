"""The GPU paths, each against the same run on the CPU: every algorithm and every
collective on CUDA tensors. Skipped without a GPU; the NCCL tests between processes
also need two GPUs (NCCL cannot put two ranks on one device).

- gloo with CUDA tensors (three or four workers sharing GPU 0): the runtime stages
  them through host memory, so relay, gossip over a topology and the low-precision
  ring work instead of aborting the process in gloo's socket writes;
- NCCL in one process: CUDA tensors over NCCL and CPU tensors over gloo in one job;
- NCCL between processes, one GPU each (two GPUs or more).

The algorithms are the rows of bagua_algos/algorithms/table.py (tests/algorithm_runs.py
trains them). Same seed, same result: the models are built and the batches drawn on the
CPU, then moved, so a CUDA run starts where the CPU run starts and may differ only by a
row's tolerance. Rows with stochastic rounding are left out of the comparison: the CPU
and CUDA generators expand one key to different numbers.
"""

from __future__ import annotations

import pytest
import torch

from algorithm_runs import assert_runs_agree, labels_for, train, train_all
from collective_cases import TWO_NODES, all_collectives, staging_communicators
from bagua_algos.experiments.gloo_workers import run_workers

CUDA = torch.cuda.is_available()
GPUS = torch.cuda.device_count() if CUDA else 0
pytestmark = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
needs_two_gpus = pytest.mark.skipif(
    GPUS < 2, reason=f"NCCL between processes needs a GPU per process: two or more, this machine has {GPUS}")

GLOO_WORKERS = 3


def _cuda_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _cpu_and_cuda(rank, n):
    """Every comparable row trained on the CPU, then on CUDA, in this job; and the
    async row, whose background rounds end with abort()'s synchronous average."""
    labels = labels_for(n, across_devices=True)
    return {"cpu": train_all(labels, torch.device("cpu")), "cuda": train_all(labels, _cuda_device()),
            "async": (train("async", torch.device("cpu"), steps=20), train("async", _cuda_device(), steps=20))}


def _assert_cpu_equals_cuda(results):
    for rank, out in enumerate(results):
        assert_runs_agree(out["cuda"], out["cpu"], rank, "CUDA against CPU")
    for device in (0, 1):  # abort() ends with a synchronous average: equal models
        for out in results[1:]:
            torch.testing.assert_close(out["async"][device], results[0]["async"][device])


def test_every_algorithm_on_cuda_tensors_over_gloo_equals_the_cpu_run():
    """Three gloo workers share GPU 0: relay, the ring and the low-precision ring send
    CUDA tensors point to point, which gloo takes only through host memory."""
    _assert_cpu_equals_cuda(run_workers(_cpu_and_cuda, GLOO_WORKERS, timeout=600, pg_timeout=120))


def _nccl_one_process(rank, n):
    from bagua_algos.runtime import comm

    assert comm.get_backend_name() == "nccl" and torch.cuda.current_device() == 0
    cpu, cuda = torch.ones(3), torch.ones(3, device="cuda")
    comm.allreduce_inplace(cpu, comm.ReduceOp.SUM)  # gloo
    comm.allreduce_inplace(cuda, comm.ReduceOp.AVG)  # NCCL
    return {"tensors": (cpu, cuda.cpu()), **_cpu_and_cuda(rank, n)}


def test_nccl_in_one_process_carries_cuda_tensors_and_cpu_tensors():
    [out] = run_workers(_nccl_one_process, 1, backend="nccl", timeout=300)
    assert out["tensors"][0].tolist() == [1.0] * 3 and out["tensors"][1].tolist() == [1.0] * 3
    _assert_cpu_equals_cuda([out])


def _collectives_on_both(rank, n):
    return {cn: (all_collectives(cn, obj, "cpu"), all_collectives(cn, obj, "cuda"))
            for cn, obj in staging_communicators().items()}


def test_every_collective_on_cuda_tensors_over_gloo_equals_cpu():
    """Every collective of comm, over the job, a subgroup and the node communicators
    (two "nodes" of two workers), on CUDA tensors staged through host memory."""
    for rank, out in enumerate(run_workers(_collectives_on_both, 4, env=TWO_NODES, timeout=300)):
        for cn, (cpu, cuda) in out.items():
            assert cpu.keys() == cuda.keys()
            for key in cpu:
                torch.testing.assert_close(cuda[key], cpu[key], msg=lambda m: f"{cn}/{key}, rank {rank}: {m}")


def _train_on(rank, n, kind):
    device = _cuda_device() if kind == "cuda" else torch.device("cpu")
    return train_all(labels_for(n, across_devices=True), device)


@needs_two_gpus
def test_every_algorithm_on_nccl_equals_the_gloo_cpu_run():
    n = min(GPUS, 4)
    on_cpu = run_workers(_train_on, n, "cpu", timeout=300)
    on_gpus = run_workers(_train_on, n, "cuda", backend="nccl", timeout=300)
    for rank, (cpu, gpu) in enumerate(zip(on_cpu, on_gpus)):
        assert_runs_agree(gpu, cpu, rank, "NCCL against gloo")
