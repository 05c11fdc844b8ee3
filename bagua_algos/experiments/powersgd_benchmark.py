"""PowerSGD benchmarks; each prints a ratio against a baseline measured in the same run.

    python benchmarks/powersgd_benchmark.py compress   # (a) ours vs torch's powerSGD_hook
    python benchmarks/powersgd_benchmark.py memory     # (c) state held vs the model's size

(a) One process (a group of one: gloo on CPU, NCCL on CUDA, so the collectives cost
almost nothing), on the device it finds (CUDA when available; ``--device`` chooses):
the gradients of a model (``--model``: the CIFAR ResNet-18 of Table 10, or
torchvision's ResNet-50) from one backward on random inputs, split into buckets as
DDP does (parameters in reverse order, ``--bucket-mb`` MB each, 25 as DDP; 0: one
bucket), compressed and decompressed by our step
(``compression.powersgd.compress_aggregate``, on views into each bucket's buffer, as
the algorithm and the DDP hook call it) and by torch's ``powerSGD_hook`` (called with
a bucket object that has the methods it uses; also with
``batch_tensors_with_same_shape=True``), all with error feedback and warm start, on the
same gradients; the median time per step (every bucket), the three interleaved step by
step, after warm-up steps, at every rank of ``--ranks`` (1,2,4,8) in one run. On CPU a
step's time is this process's CPU time (``time.process_time``, so the time slices that a
shared machine gives to other jobs count for neither side), and cuda_ext's CPU module is
loaded first, built the first time (1-5 minutes on 2 cores; ``--no-cuda-ext`` measures without it),
as a user gets it after ``orthogonalization.prepare("householder", "cpu")``. On CUDA a
step's time is wall time, each timed step ending with ``torch.cuda.synchronize()`` (ours
queues its work without waiting; torch's hook waits inside). The header names the
device, the orthogonalization "auto" resolved to and whether the fused CPU passes ran;
the last column gives the median page faults per step of each side (torch's hook
allocates tensors of the bucket's size every step; when the allocator hands it freshly
mapped memory, the kernel zeroes those pages on first touch, which is the slow mode of
torch's bimodal time).

(c) The bytes of every tensor the algorithm holds between steps (bucket state: error
buffer, Q's, generator state), against the model's parameter bytes, after a few steps
of the ``powersgd`` algorithm on the same ResNet-18, with and without
``error_in_grad``; with it, also the update buffer that exists from the op to the end of
``optimizer.step()``.

The training comparison (b) is ``benchmarks/heterogeneity_sweep.py`` with
``--configs "gradient_allreduce;powersgd:rank=2"`` (see docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path


import torch


@contextlib.contextmanager
def guard_cuda_synchronize_for_cpu():
    """Inside this block ``torch.cuda.synchronize(device)`` returns at once for a CPU
    device (there is nothing to wait for) and is unchanged otherwise.

    torch's ``powerSGD_hook`` calls ``torch.cuda.synchronize(device)`` whenever CUDA is
    available, also when its bucket is on the CPU, where torch refuses a CPU device
    ("Expected a cuda device"). So the hook cannot run on CPU tensors on a machine with
    a GPU; this block lets it (the CPU results are those of a machine without one).
    """
    original = torch.cuda.synchronize

    def synchronize(device=None):
        if isinstance(device, (str, torch.device)) and torch.device(device).type == "cpu":
            return None
        return original(device)

    torch.cuda.synchronize = synchronize
    try:
        yield
    finally:
        torch.cuda.synchronize = original


def _one_process_group(tmp: str, device: torch.device) -> None:
    import torch.distributed as dist

    from bagua_algos.runtime import comm

    store = dist.FileStore(os.path.join(tmp, "store"), 1)
    backend = "nccl" if device.type == "cuda" else "gloo"
    comm.init_process_group(store=store, rank=0, world_size=1, backend=backend, timeout=60)


def _model(name: str):
    if name == "cifar_resnet18":
        from bagua_algos.experiments.cifar_resnet import CifarResNet18

        return CifarResNet18(), (3, 32, 32), 10
    if name == "resnet50":
        import torchvision

        return torchvision.models.resnet50(), (3, 224, 224), 1000
    raise ValueError(f"--model must be cifar_resnet18 or resnet50, got {name!r}")


def _resnet_gradients(seed: int = 0, model_name: str = "cifar_resnet18", device="cpu", batch: int = 8):
    torch.manual_seed(seed)
    model, image, classes = _model(model_name)
    model = model.to(device)
    x = torch.randn(batch, *image, device=device)
    y = torch.randint(0, classes, (batch,), device=device)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    params = [p for p in model.parameters() if p.requires_grad][::-1]  # DDP's bucket order
    return model, params


def _buckets(params, bucket_mb: float):
    """DDP's split: parameters in order, a new bucket once ``bucket_mb`` MB are reached."""
    if bucket_mb <= 0:
        return [list(params)]
    limit = bucket_mb * 2**20
    buckets, current, size = [], [], 0
    for p in params:
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= limit:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


class HookBucket:
    """What torch's powerSGD_hook calls on a GradBucket."""

    def __init__(self, buffer, params, index=0, last=True):
        self._buffer = buffer
        self._params = params
        self._index = index
        self._last = last
        self._grads = []
        offset = 0
        for p in params:
            self._grads.append(buffer[offset : offset + p.numel()].view(p.shape))
            offset += p.numel()

    def buffer(self):
        return self._buffer

    def gradients(self):
        return self._grads

    def parameters(self):
        return self._params

    def index(self):
        return self._index

    def is_last(self):
        return self._last

    def is_the_last_bucket_to_allreduce(self):
        return self._last


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda})"
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} torch thread(s))"


def bench_compress(ranks, steps: int, warmup: int, device="cpu", model_name: str = "cifar_resnet18",
                   bucket_mb: float = 25.0) -> list[dict]:
    device = torch.device(device)
    _, params = _resnet_gradients(model_name=model_name, device=device)
    buckets = _buckets(params, bucket_mb)
    flats = [torch.cat([p.grad.reshape(-1) for p in bucket]) for bucket in buckets]
    rows = []
    for rank in ranks:
        runs = (("ours", *_ours(buckets, flats, rank, device)),
                ("torch", *_torch_hook(buckets, flats, rank, batched=False)),
                ("torch_batched", *_torch_hook(buckets, flats, rank, batched=True)))
        med = _median_seconds(runs, flats, steps, warmup, device)
        rows.append({"rank": rank, "ours_ms": 1e3 * med["ours"], "torch_ms": 1e3 * med["torch"],
                     "ratio": med["ours"] / med["torch"], "torch_batched_ms": 1e3 * med["torch_batched"],
                     "ratio_batched": med["ours"] / med["torch_batched"], "buckets": len(buckets),
                     "faults": (med["ours_faults"], med["torch_faults"], med["torch_batched_faults"])})
    return rows


def _ours(buckets, flats, rank: int, device):
    """Our step on every bucket (one plan and state per bucket, gradients as views into
    the bucket's buffer, as the algorithm and the DDP hook call it), and its buffers.
    The orthogonalization is prepared as the algorithm prepares it (cuda_ext built the
    first time)."""
    from bagua_algos.compression import orthogonalization
    from bagua_algos.compression import powersgd as psgd
    from bagua_algos.runtime import comm

    orthogonalization.prepare("auto", device)
    options = psgd.PowerSGDOptions(orthogonalization="auto")
    buffers = [flat.clone() for flat in flats]
    per_bucket = []
    for index, (bucket, buffer) in enumerate(zip(buckets, buffers)):
        shapes = [p.shape for p in bucket]
        plan = psgd.make_plan(shapes, rank, 2.0)
        state = psgd.init_state(plan, index, buffer.dtype, device, True)
        grads, offset = [], 0
        for s in shapes:
            grads.append(buffer[offset : offset + s.numel()].view(s))
            offset += s.numel()
        per_bucket.append((plan, state, grads))

    def mean(t):
        comm.allreduce_inplace(t, comm.ReduceOp.AVG)

    def start(t):
        return comm.allreduce_inplace(t, comm.ReduceOp.AVG, async_op=True)

    def step():
        for plan, state, grads in per_bucket:
            psgd.compress_aggregate(plan, grads, state, options, mean, start)

    return step, buffers


def _torch_hook(buckets, flats, rank: int, batched: bool):
    """torch's powerSGD_hook on every bucket, and its buffers. It starts at its first
    compressed step: start_powerSGD_iter must be ≥ 2 with error feedback, so its iter
    is set past it."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd

    state = torch_psgd.PowerSGDState(process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=2,
                                     min_compression_rate=2.0, use_error_feedback=True, warm_start=True,
                                     orthogonalization_epsilon=1e-8, batch_tensors_with_same_shape=batched)
    state.iter = 2
    buffers = [flat.clone() for flat in flats]
    hook_buckets = [HookBucket(buffer, bucket, index, index == len(buckets) - 1)
                    for index, (buffer, bucket) in enumerate(zip(buffers, buckets))]

    def step():
        for hook_bucket in hook_buckets:
            torch_psgd.powerSGD_hook(state, hook_bucket).wait()

    return step, buffers


def _median_seconds(runs, flats, steps: int, warmup: int, device) -> dict:
    """The median seconds per step of each (name, step, buffers) of ``runs``, interleaved
    step by step; each step starts from the same gradients (``flats``), and the median
    page faults per step (``name + "_faults"``).

    On CPU a step's time is the CPU time of this process (``time.process_time``: every
    thread of it, gloo's too, and the kernel's work for it, such as the page faults of
    fresh allocations), so the time slices a shared machine gives to other processes
    are not counted to either side; with one torch thread a step is one thread's work
    plus the collectives. On CUDA it is wall time, each timed step ending with a
    synchronize."""
    on_cuda = device.type == "cuda"
    clock = time.perf_counter if on_cuda else time.process_time

    def sync():
        if on_cuda:
            torch.cuda.synchronize(device)

    times = {name: [] for name, _, _ in runs}
    faults = {name: [] for name, _, _ in runs}
    guard = guard_cuda_synchronize_for_cpu() if device.type == "cpu" else contextlib.nullcontext()
    with guard:
        for i in range(warmup + steps):
            for name, step, buffers in runs:
                for buffer, flat in zip(buffers, flats):
                    buffer.copy_(flat)
                sync()
                faults_before = _page_faults()
                started = clock()
                step()
                sync()
                if i >= warmup:
                    times[name].append(clock() - started)
                    faults[name].append(_page_faults() - faults_before)
    medians = {name: statistics.median(values) for name, values in times.items()}
    medians.update({f"{name}_faults": statistics.median(values) for name, values in faults.items()})
    return medians


def _page_faults() -> int:
    """Page faults of this process so far (minor and major): a step that touches freshly
    mapped memory (a large tensor allocated anew) pays the kernel to zero its pages."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_minflt + usage.ru_majflt


def bench_memory(steps: int) -> list[dict]:
    from bagua_algos.algorithms import PowerSGDAlgorithm
    from bagua_algos.experiments.cifar_resnet import CifarResNet18

    rows = []
    for error_in_grad in (False, True):
        torch.manual_seed(0)
        model = CifarResNet18()
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        model.with_bagua([opt], PowerSGDAlgorithm(rank=2, error_in_grad=error_in_grad))
        transient = 0
        for _ in range(steps):
            if not error_in_grad:
                opt.zero_grad()
            x = torch.randn(8, 3, 32, 32)
            torch.nn.functional.cross_entropy(model(x), torch.randint(0, 10, (8,))).backward()
            impl = model.bagua_algorithm
            transient = max(transient, sum(a.numel() * a.element_size() for a, _ in impl._approx_buffers.values()))
            opt.step()
        held = 0
        for bucket in model.bagua_buckets:
            held += _tensor_bytes(bucket.state)
        model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        rows.append({"error_in_grad": error_in_grad, "held_bytes": held, "model_bytes": model_bytes,
                     "ratio": held / model_bytes, "transient_bytes_during_step": transient,
                     "transient_ratio": transient / model_bytes})
        model.bagua_ddp.detach()
    return rows


def _tensor_bytes(value) -> int:
    if torch.is_tensor(value):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="powersgd_benchmark", description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("compress", "memory"))
    parser.add_argument("--ranks", default="1,2,4,8")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--model", default="cifar_resnet18", choices=("cifar_resnet18", "resnet50"))
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="DDP-like bucket size in MB (0: one bucket)")
    parser.add_argument("--no-cuda-ext", dest="cuda_ext", action="store_false",
                        help="on CPU, do not load cuda_ext's CPU module (by default it is loaded, built the first "
                             "time: 1-5 minutes on 2 cores; our step then takes its orthogonalization and fused passes)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.what == "memory":
        device = torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    from bagua_algos.runtime import comm

    with tempfile.TemporaryDirectory() as tmp:
        _one_process_group(tmp, device)
        try:
            _report(args, device)
        finally:
            comm.destroy_process_group()
    return 0


def _report(args, device) -> None:
    if args.what == "compress":
        from bagua_algos.compression import orthogonalization

        ranks = [int(r) for r in args.ranks.split(",")]
        started = time.perf_counter()
        if args.cuda_ext and device.type == "cpu":  # "auto" never builds it on CPU: built here the first time
            orthogonalization.prepare("householder", device)
        method = orthogonalization.prepare("auto", device)  # on GPUs: builds cuda_ext the first time
        prepare_s = time.perf_counter() - started
        if method == "householder":
            import cuda_ext

            method += " (cuda_ext)" if cuda_ext.is_loaded(device) else " (householder_torch fallback)"
        for_r1 = orthogonalization._resolve("auto", {device}, 1)
        if not method.startswith(for_r1):
            method = f"{method} for r >= 2, {for_r1} for r = 1"
        if device.type == "cpu":
            from bagua_algos.compression import powersgd as psgd

            method += f"; fused CPU passes {'on' if psgd._fused_cpu_passes() is not None else 'off'}"
        rows = bench_compress(ranks, args.steps, args.warmup, device, args.model, args.bucket_mb)
        print(f"device: {describe_device(device)}; torch {torch.__version__}; {args.model} gradients in "
              f"{rows[0]['buckets']} bucket(s) of <= {args.bucket_mb:g} MB; our orthogonalization auto = {method} "
              f"(prepared in {prepare_s:.2f} s); "
              f"median of {args.steps} steps after {args.warmup}")
        print("rank  ours ms   torch ms  ours/torch  torch batched ms  ours/torch batched  "
              "page faults/step (ours, torch, batched)")
        for row in rows:
            print(f"{row['rank']:>4}  {row['ours_ms']:8.2f}  {row['torch_ms']:8.2f}  {row['ratio']:10.3f}  "
                  f"{row['torch_batched_ms']:16.2f}  {row['ratio_batched']:18.3f}  "
                  f"{' / '.join(f'{f:g}' for f in row['faults'])}")
    else:
        print("error_in_grad  held MB  model MB  held/model  transient MB (op → optimizer.step)  transient/model")
        for row in bench_memory(args.steps):
            print(f"{str(row['error_in_grad']):>13}  {row['held_bytes'] / 2**20:7.2f}  "
                  f"{row['model_bytes'] / 2**20:8.2f}  {row['ratio']:10.4f}  "
                  f"{row['transient_bytes_during_step'] / 2**20:35.2f}  {row['transient_ratio']:.4f}")


if __name__ == "__main__":
    sys.exit(main())
