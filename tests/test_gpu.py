"""The GPU paths, each against the same run on the CPU: every algorithm and every
collective on CUDA tensors. Skipped without a GPU; the NCCL tests between processes
also need two GPUs (NCCL cannot put two ranks on one device).

- gloo with CUDA tensors (three or four workers sharing GPU 0): the runtime stages
  them through host memory, so relay, gossip over a topology and the low-precision
  ring work instead of aborting the process in gloo's socket writes;
- NCCL in one process: CUDA tensors over NCCL and CPU tensors over gloo in one job;
- NCCL between processes, one GPU each (two GPUs or more).

Same seed, same result: the models are built and the batches drawn on the CPU, then
moved, so a CUDA run starts where the CPU run starts and may differ only by float
rounding. TernGrad runs with nearest rounding here: stochastic rounding draws from the
device's generator (CPU and CUDA generators give different numbers for one seed).
"""

from __future__ import annotations

import functools

import pytest
import torch

from gloo_workers import run_workers
from test_comm import TWO_NODES, _all_collectives

CUDA = torch.cuda.is_available()
GPUS = torch.cuda.device_count() if CUDA else 0
pytestmark = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
needs_two_gpus = pytest.mark.skipif(
    GPUS < 2, reason=f"NCCL between processes needs a GPU per process: two or more, this machine has {GPUS}")

STEPS = 6
ALGORITHMS = [
    "gradient_allreduce", "gradient_allreduce_hierarchical", "allreduce_average", "decentralized_all",
    "decentralized_ring", "relay_chain", "relay_double_binary_tree", "powersgd", "terngrad", "bytegrad",
    "low_precision_decentralized", "qadam",
]
# Quantized messages: CUDA's fused multiply-add can round a value to the other side of a
# quantization boundary, and that one entry then moves by a whole level (bytes otherwise
# equal), so these are compared at the size of a level rather than of a float rounding.
QUANTIZED = {"terngrad": 5e-3, "bytegrad": 1e-3, "low_precision_decentralized": 1e-3, "qadam": 1e-3}
# With one worker a ring or a tree has no neighbour: those are left to the multi-worker runs.
ONE_WORKER = [a for a in ALGORITHMS if a not in ("decentralized_ring", "relay_double_binary_tree")]


def _build(name: str, device: torch.device):
    """(model, optimizer, algorithm) for ``name``; the model starts equal on every device."""
    from bagua_algos import algorithms as A

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)).to(device)
    if name == "qadam":
        optimizer = A.QAdamOptimizer(model.parameters(), lr=0.01, warmup_steps=2)
        return model, optimizer, A.QAdamAlgorithm(optimizer)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    algorithm = {
        "gradient_allreduce": A.GradientAllReduceAlgorithm,
        "gradient_allreduce_hierarchical": functools.partial(A.GradientAllReduceAlgorithm, hierarchical=True),
        "allreduce_average": A.AllreduceAverageAlgorithm,
        "decentralized_all": functools.partial(A.DecentralizedAlgorithm, hierarchical=False),
        "decentralized_ring": functools.partial(A.DecentralizedAlgorithm, topology="ring"),
        "relay_chain": functools.partial(A.RelayAlgorithm, topology="chain"),
        "relay_double_binary_tree": A.RelayAlgorithm,
        "powersgd": functools.partial(A.PowerSGDAlgorithm, rank=2, min_compression_rate=1.0),
        "terngrad": functools.partial(A.TernGradAlgorithm, stochastic=False),
        "bytegrad": A.ByteGradAlgorithm,
        "low_precision_decentralized": functools.partial(A.LowPrecisionDecentralizedAlgorithm, hierarchical=False),
    }[name]()
    return model, optimizer, algorithm


def _train(name: str, device: torch.device) -> torch.Tensor:
    """This worker's parameters after STEPS steps of ``name`` on ``device`` (on the CPU)."""
    from bagua_algos.runtime import comm

    rank = comm.get_rank()
    model, optimizer, algorithm = _build(name, device)
    model.with_bagua([optimizer], algorithm, bucket_size=4096)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(8, 32, generator=g).to(device), torch.randint(0, 4, (8,), generator=g).to(device)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    model.bagua_ddp.detach()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()


def _async_ends_equal(device: torch.device) -> torch.Tensor:
    """The async algorithm trains with background rounds, then abort() averages once."""
    from bagua_algos.algorithms import AsyncModelAverageAlgorithm

    model, optimizer, _ = _build("gradient_allreduce", device)
    model.with_bagua([optimizer], AsyncModelAverageAlgorithm(sync_interval_ms=1))
    for step in range(20):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 32, generator=g).to(device), torch.randint(0, 4, (8,), generator=g).to(device)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    model.bagua_algorithm.abort(model)
    model.bagua_ddp.detach()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()


def _cuda_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _cpu_and_cuda(rank, n, names):
    """Every algorithm of ``names`` trained on the CPU, then on CUDA, in this job."""
    out = {name: (_train(name, torch.device("cpu")), _train(name, _cuda_device())) for name in names}
    out["async"] = (_async_ends_equal(torch.device("cpu")), _async_ends_equal(_cuda_device()))
    return out


def _assert_cpu_equals_cuda(results, names):
    for rank, out in enumerate(results):
        for name in names:
            cpu, cuda = out[name]
            torch.testing.assert_close(cuda, cpu, atol=QUANTIZED.get(name, 1e-5), rtol=1e-4,
                                       msg=lambda m: f"{name}, rank {rank}: {m}")
    for device in (0, 1):  # abort() ends with a synchronous average: equal models
        for out in results[1:]:
            torch.testing.assert_close(out["async"][device], results[0]["async"][device])


def test_every_algorithm_on_cuda_tensors_over_gloo_equals_the_cpu_run():
    """Three gloo workers share GPU 0: relay, the ring and the low-precision ring send
    CUDA tensors point to point, which gloo takes only through host memory."""
    results = run_workers(_cpu_and_cuda, 3, ALGORITHMS, timeout=600, pg_timeout=120)
    _assert_cpu_equals_cuda(results, ALGORITHMS)


def _nccl_one_process(rank, n):
    from bagua_algos.runtime import comm

    assert comm.get_backend() == "nccl" and torch.cuda.current_device() == 0
    cpu, cuda = torch.ones(3), torch.ones(3, device="cuda")
    comm.allreduce_inplace(cpu, comm.ReduceOp.SUM)  # gloo
    comm.allreduce_inplace(cuda, comm.ReduceOp.AVG)  # NCCL
    return {"tensors": (cpu, cuda.cpu()), **_cpu_and_cuda(rank, n, ONE_WORKER)}


def test_nccl_in_one_process_carries_cuda_tensors_and_cpu_tensors():
    [out] = run_workers(_nccl_one_process, 1, backend="nccl", timeout=300)
    assert out["tensors"][0].tolist() == [1.0] * 3 and out["tensors"][1].tolist() == [1.0] * 3
    _assert_cpu_equals_cuda([out], ONE_WORKER)


def _collectives_on_both(rank, n):
    from bagua_algos.runtime import comm

    default = comm._get_default_group()
    sub = comm.new_group([3, 1, 2])
    objects = {"world": None, "sub": sub, "intra": default.get_intra_node_communicator(),
               "inter": default.get_inter_node_communicator()}
    return {cn: (_all_collectives(cn, obj, "cpu"), _all_collectives(cn, obj, "cuda")) for cn, obj in objects.items()}


def test_every_collective_on_cuda_tensors_over_gloo_equals_cpu():
    """Every collective of comm, over the job, a subgroup and the node communicators
    (two "nodes" of two workers), on CUDA tensors staged through host memory."""
    for rank, out in enumerate(run_workers(_collectives_on_both, 4, env=TWO_NODES, timeout=300)):
        for cn, (cpu, cuda) in out.items():
            assert cpu.keys() == cuda.keys()
            for key in cpu:
                torch.testing.assert_close(cuda[key], cpu[key], msg=lambda m: f"{cn}/{key}, rank {rank}: {m}")


def _train_all(rank, n, kind):
    device = _cuda_device() if kind == "cuda" else torch.device("cpu")
    return {name: _train(name, device) for name in ALGORITHMS}


@needs_two_gpus
def test_every_algorithm_on_nccl_equals_the_gloo_cpu_run():
    n = min(GPUS, 4)
    on_cpu = run_workers(_train_all, n, "cpu", timeout=300)
    on_gpus = run_workers(_train_all, n, "cuda", backend="nccl", timeout=300)
    for rank, (cpu, gpu) in enumerate(zip(on_cpu, on_gpus)):
        for name in ALGORITHMS:
            torch.testing.assert_close(gpu[name], cpu[name], atol=QUANTIZED.get(name, 1e-5), rtol=1e-4,
                                       msg=lambda m: f"{name}, rank {rank}: {m}")
