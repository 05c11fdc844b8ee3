"""PowerSGD benchmarks; each prints a ratio against a baseline measured in the same run.

    python benchmarks/powersgd_benchmark.py compress   # (a) ours vs torch's powerSGD_hook
    python benchmarks/powersgd_benchmark.py memory     # (c) state held vs the model's size

(a) One process (a gloo group of one, so the collectives cost almost nothing): the
gradients of the CIFAR ResNet-18 (Table 10) from one backward on random images, in one
bucket of all of them, compressed and decompressed by our step
(``compression.powersgd.compress_aggregate``) and by torch's ``powerSGD_hook`` (called
with a bucket object that has the methods it uses), both with error feedback and warm
start, on the same gradients; the median time per step after warm-up steps.

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
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

import torch  # noqa: E402


def _one_process_group(tmp: str) -> None:
    import torch.distributed as dist

    from bagua_algos.runtime import comm

    store = dist.FileStore(os.path.join(tmp, "store"), 1)
    comm.init_process_group(store=store, rank=0, world_size=1, backend="gloo", timeout=60)


def _resnet_gradients(seed: int = 0):
    from benchmarks.cifar_resnet import CifarResNet18

    torch.manual_seed(seed)
    model = CifarResNet18()
    x = torch.randn(8, 3, 32, 32)
    y = torch.randint(0, 10, (8,))
    torch.nn.functional.cross_entropy(model(x), y).backward()
    params = [p for p in model.parameters() if p.requires_grad][::-1]  # DDP's bucket order
    return model, params


class _Bucket:
    """What torch's powerSGD_hook calls on a GradBucket."""

    def __init__(self, buffer, params):
        self._buffer = buffer
        self._params = params
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
        return 0

    def is_last(self):
        return True

    def is_the_last_bucket_to_allreduce(self):
        return True


def bench_compress(ranks, steps: int, warmup: int) -> list[dict]:
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_psgd

    from bagua_algos.compression import powersgd as psgd
    from bagua_algos.runtime import comm

    _, params = _resnet_gradients()
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    shapes = [p.shape for p in params]
    rows = []
    for rank in ranks:
        # ours
        plan = psgd.make_plan(shapes, rank, 2.0)
        state = psgd.init_state(plan, 0, flat.dtype, flat.device, True)
        options = psgd.PowerSGDOptions(orthogonalization="auto")
        buffer = flat.clone()

        def mean(t):
            comm.allreduce_inplace(t, comm.ReduceOp.AVG)

        def start(t):
            return comm.allreduce_inplace(t, comm.ReduceOp.AVG, async_op=True)

        def ours():
            grads, offset = [], 0
            for s in shapes:
                n = s.numel()
                grads.append(buffer[offset : offset + n].view(s))
                offset += n
            psgd.compress_aggregate(plan, grads, state, options, mean, start)

        # torch's hook (start at its first compressed step: start_powerSGD_iter must be ≥ 2
        # with error feedback, so its iter is set past it)
        tstate = torch_psgd.PowerSGDState(process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=2,
                                          min_compression_rate=2.0, use_error_feedback=True, warm_start=True,
                                          orthogonalization_epsilon=1e-8)
        tstate.iter = 2
        tbuffer = flat.clone()
        tbucket = _Bucket(tbuffer, params)

        def theirs():
            torch_psgd.powerSGD_hook(tstate, tbucket).wait()

        times = {"ours": [], "torch": []}
        for i in range(warmup + steps):
            for name, fn, buf in (("ours", ours, buffer), ("torch", theirs, tbuffer)):
                buf.copy_(flat)
                start_t = time.perf_counter()
                fn()
                elapsed = time.perf_counter() - start_t
                if i >= warmup:
                    times[name].append(elapsed)
        ours_s, torch_s = statistics.median(times["ours"]), statistics.median(times["torch"])
        rows.append({"rank": rank, "ours_ms": 1e3 * ours_s, "torch_ms": 1e3 * torch_s, "ratio": ours_s / torch_s})
    return rows


def bench_memory(steps: int) -> list[dict]:
    from bagua_algos.algorithms import PowerSGDAlgorithm
    from benchmarks.cifar_resnet import CifarResNet18

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
    parser.add_argument("--ranks", default="1,2,4")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from bagua_algos.runtime import comm

    with tempfile.TemporaryDirectory() as tmp:
        _one_process_group(tmp)
        try:
            _report(args)
        finally:
            comm.destroy_process_group()
    return 0


def _report(args) -> None:
    if args.what == "compress":
        ranks = [int(r) for r in args.ranks.split(",")]
        print(f"torch {torch.__version__}, {args.threads} thread(s), CIFAR ResNet-18 gradients in one bucket, "
              f"median of {args.steps} steps after {args.warmup}")
        print("rank  ours ms   torch ms  ours/torch")
        for row in bench_compress(ranks, args.steps, args.warmup):
            print(f"{row['rank']:>4}  {row['ours_ms']:8.2f}  {row['torch_ms']:8.2f}  {row['ratio']:10.3f}")
    else:
        print("error_in_grad  held MB  model MB  held/model  transient MB (op → optimizer.step)  transient/model")
        for row in bench_memory(args.steps):
            print(f"{str(row['error_in_grad']):>13}  {row['held_bytes'] / 2**20:7.2f}  "
                  f"{row['model_bytes'] / 2**20:8.2f}  {row['ratio']:10.4f}  "
                  f"{row['transient_bytes_during_step'] / 2**20:35.2f}  {row['transient_ratio']:.4f}")


if __name__ == "__main__":
    sys.exit(main())
