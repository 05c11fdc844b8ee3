"""Bagua's synthetic benchmark, on bagua_algos: the same flags and the same lines.

Bagua's ``examples/benchmark/synthetic_benchmark.py`` (after Horovod's) trains a
torchvision model on one fixed random batch and prints images per second. This is
that benchmark for every registered algorithm, on CPU (gloo) or GPU, reachable as
``benchmarks/synthetic_benchmark.py --algorithm NAME ...`` (the side-by-side
``--configs`` mode of that script stays as it is)::

    python -m bagua_algos.launch --nproc_per_node 4 benchmarks/synthetic_benchmark.py \\
        --algorithm relay --topology chain --model resnet18 --image-size 32 --num-classes 10

Output, on rank 0 (``DEVICE`` is GPU or CPU)::

    Model: resnet18
    Batch size: 32
    Number of CPUs: 4
    Running warmup...
    Running benchmark...
    Iter #0: 812.3 img/sec CPU          (every --log-interval iterations; all workers)
    Img/sec per CPU: 203.1 +-4.2         (mean over iterations ± 1.96 standard deviations)
    Total img/sec on 4 CPU(s): 812.3 +-16.8
    Bytes sent per worker per step: 1.02e+06 (mean), 1.02e+06 (max)   (comm.bytes_sent())

Algorithm arguments: ``--topology`` (relay, decentralized), ``--rank`` (powersgd),
``--bits`` (terngrad); giving one to an algorithm that has no such argument is an
error naming it. ``qadam`` gets its own optimizer (``QAdamOptimizer``), as in Bagua.
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import sys
import time
from pathlib import Path


from bagua_algos.experiments.common import WorkerArgumentParser
from topologies import available_topologies

PROG = "synthetic_benchmark --algorithm"
LOCAL_MODELS = ("mlp", "cnn")  # besides every torchvision classification model
# flag → the algorithm argument it sets
ALGORITHM_FLAGS = {"topology": "topology", "rank": "rank", "bits": "bits"}


def build_parser() -> argparse.ArgumentParser:
    parser = WorkerArgumentParser(prog=PROG, allow_abbrev=False,
                                  usage="synthetic_benchmark --algorithm NAME [flags below]",
                                  formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                  description="Bagua's synthetic throughput benchmark on bagua_algos.")
    what = parser.add_argument_group("what is timed (Bagua's mode: --algorithm NAME)")
    what.add_argument("--algorithm", default="gradient_allreduce", help="a registered algorithm name")
    trees = available_topologies(trees_only=True)
    others = [name for name in available_topologies() if name not in trees]
    what.add_argument("--topology", default=None,
                      help=f"topology of relay ({', '.join(trees)}) or decentralized (those or {', '.join(others)})")
    what.add_argument("--rank", type=int, default=None, help="PowerSGD's rank")
    what.add_argument("--bits", type=int, default=None, help="TernGrad's bits per value")
    what.add_argument("--model", default="resnet50", help="a torchvision model name, or mlp / cnn")
    what.add_argument("--batch-size", type=int, default=32, help="input batch size per worker")
    what.add_argument("--image-size", type=int, default=224, help="height and width of the images")
    what.add_argument("--num-classes", type=int, default=1000, help="output classes")
    timing = parser.add_argument_group("timing (Bagua's mode)")
    timing.add_argument("--num-warmup-batches", type=int, default=10, help="warm-up batches, not timed")
    timing.add_argument("--num-batches-per-iter", type=int, default=10, help="batches per timed iteration")
    timing.add_argument("--num-iters", type=int, default=10, help="timed iterations")
    timing.add_argument("--log-interval", type=int, default=1, help="print an Iter line every N iterations")
    workers = parser.add_argument_group("workers (Bagua's mode)")
    workers.add_argument("--deterministic", action="store_true", help="seed everything by rank, deterministic kernels")
    workers.add_argument("--no-cuda", action="store_true", help="train on the CPU even if a GPU is present")
    workers.add_argument("--threads", type=int, default=1, help="torch threads per worker on CPU")
    workers.add_argument("--spawn", type=int, default=None, metavar="N",
                         help="start N local workers through bagua_algos' launcher and run this in them")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    """Parse and check every flag, the algorithm's arguments included (its constructor
    runs here, without a process group): in the parent with ``--spawn``, before any
    worker starts; else in each worker, where an error is printed once per node."""
    parser = build_parser()
    args = parser.parse_args(argv)
    for flag in ("batch_size", "num_batches_per_iter", "num_iters", "log_interval", "image_size",
                 "num_classes", "threads"):
        if getattr(args, flag) < 1:
            parser.error(f"argument --{flag.replace('_', '-')}: must be >= 1, got {getattr(args, flag)}")
    if args.spawn is not None and args.spawn < 1:
        parser.error(f"argument --spawn: must be >= 1, got {args.spawn}")
    if args.num_warmup_batches < 0:
        parser.error(f"argument --num-warmup-batches: must be >= 0, got {args.num_warmup_batches}")
    from bagua_algos.runtime.algorithm import GlobalAlgorithmRegistry

    names = GlobalAlgorithmRegistry.available_algorithms()
    if args.algorithm not in names:
        parser.error(f"argument --algorithm: unknown algorithm {args.algorithm!r}; registered: {sorted(names)}")
    if args.model not in LOCAL_MODELS:
        import torchvision.models as tvm

        available = tvm.list_models(module=tvm)
        if args.model not in available:
            parser.error(f"argument --model: {args.model!r} is neither mlp, cnn nor a torchvision "
                         f"classification model (e.g. resnet18, resnet50, vgg16)")
    try:
        kwargs = algorithm_kwargs(args)
    except ValueError as error:
        parser.error(str(error))
    if args.algorithm != "qadam":  # qadam takes none of the flags, and is built on its optimizer
        cls = GlobalAlgorithmRegistry.get(args.algorithm)
        for flag, name in ALGORITHM_FLAGS.items():  # one flag at a time: the error names it
            if name in kwargs:
                try:
                    cls(**{name: kwargs[name]})
                except (TypeError, ValueError) as error:
                    parser.error(f"argument --{flag}: {error}")
    return args


def algorithm_kwargs(args) -> dict:
    """The algorithm's arguments from --topology/--rank/--bits; ValueError if it has no such argument."""
    from bagua_algos.runtime.algorithm import GlobalAlgorithmRegistry

    cls = GlobalAlgorithmRegistry.get(args.algorithm)
    accepted = inspect.signature(cls.__init__).parameters
    kwargs = {}
    for flag, name in ALGORITHM_FLAGS.items():
        value = getattr(args, flag)
        if value is None:
            continue
        if name not in accepted:
            raise ValueError(f"argument --{flag}: algorithm {args.algorithm!r} takes no {name!r} argument")
        kwargs[name] = value
    return kwargs


def build_model(args):
    import torch.nn as nn

    if args.model == "mlp":
        width = 3 * args.image_size * args.image_size
        return nn.Sequential(nn.Flatten(), nn.Linear(width, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                             nn.Linear(1024, args.num_classes))
    if args.model == "cnn":
        return nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4),
                             nn.Flatten(), nn.Linear(64 * 16, args.num_classes))
    import torchvision.models as tvm

    return tvm.get_model(args.model, weights=None, num_classes=args.num_classes)


def build_algorithm_and_optimizer(args, model):
    import torch

    import bagua_algos
    from bagua_algos.runtime.algorithm import GlobalAlgorithmRegistry

    lr = 0.01 * bagua_algos.get_world_size()  # Bagua's script scales the rate by the world size
    if args.algorithm == "qadam":
        from bagua_algos.algorithms import QAdamAlgorithm, QAdamOptimizer

        optimizer = QAdamOptimizer(model.parameters(), lr=lr * 0.1, warmup_steps=args.num_warmup_batches)
        return QAdamAlgorithm(optimizer), optimizer
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    return GlobalAlgorithmRegistry.get(args.algorithm)(**algorithm_kwargs(args)), optimizer


def run(args) -> dict:
    """Train and time in this worker (inside a launched job); returns rank 0's figures."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    import bagua_algos
    from bagua_algos.runtime import comm

    from bagua_algos.experiments.common import init_for_device, worker_device

    # Bagua's script runs on GPU LOCAL_RANK unless --no_cuda; here a node with fewer
    # GPUs than workers runs on CPU instead of failing.
    cuda = not args.no_cuda and worker_device("auto") == "cuda"
    if not cuda:
        torch.set_num_threads(args.threads)
    init_for_device("cuda" if cuda else "cpu")
    rank, world = bagua_algos.get_rank(), bagua_algos.get_world_size()
    if args.deterministic:
        torch.manual_seed(rank)
        np.random.seed(rank)
        torch.use_deterministic_algorithms(True, warn_only=True)
        if cuda:
            torch.backends.cudnn.benchmark = False
    else:
        torch.manual_seed(0)
        if cuda:
            torch.backends.cudnn.benchmark = True
    device = torch.device("cuda") if cuda else torch.device("cpu")
    model = build_model(args).to(device)
    algorithm, optimizer = build_algorithm_and_optimizer(args, model)
    model = model.with_bagua([optimizer], algorithm)
    data = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    target = torch.randint(0, args.num_classes, (args.batch_size,), device=device)

    def step():
        optimizer.zero_grad()
        F.cross_entropy(model(data), target).backward()
        optimizer.step()

    def timed(batches: int) -> float:
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(batches):
            step()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    kind = "GPU" if cuda else "CPU"

    def log(text: str) -> None:
        if rank == 0:
            print(text, flush=True)

    log(f"Model: {args.model}")
    log(f"Batch size: {args.batch_size}")
    log(f"Number of {kind}s: {world}")
    log("Running warmup...")
    timed(args.num_warmup_batches)
    log("Running benchmark...")
    rates = []
    sent_before = comm.bytes_sent()
    for i in range(args.num_iters):
        rate = args.batch_size * args.num_batches_per_iter / timed(args.num_batches_per_iter)
        rates.append(rate)
        if i % args.log_interval == 0:
            log(f"Iter #{i}: {rate * world:.1f} img/sec {kind}")
    steps = args.num_iters * args.num_batches_per_iter
    sent = torch.tensor([float(comm.bytes_sent() - sent_before) / steps] * 2)
    comm.allreduce_inplace(sent[:1], comm.ReduceOp.SUM)  # mean over workers: trees and gossip differ by rank
    comm.allreduce_inplace(sent[1:], comm.ReduceOp.MAX)
    per_step, per_step_max = sent[0].item() / world, sent[1].item()
    mean = statistics.fmean(rates)
    spread = 1.96 * float(np.std(rates))
    log(f"Img/sec per {kind}: {mean:.1f} +-{spread:.1f}")
    log(f"Total img/sec on {world} {kind}(s): {world * mean:.1f} +-{world * spread:.1f}")
    log(f"Bytes sent per worker per step: {per_step:.4g} (mean), {per_step_max:.4g} (max)")
    comm.barrier()
    comm.destroy_process_group()
    return {"img_sec_per_worker": mean, "img_sec_conf": spread, "bytes_per_step": per_step}


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.spawn is not None:
        from bagua_algos.experiments.common import launch_self, without_flag

        launch_self("bagua_algos.experiments.synthetic_benchmark", args.spawn,
                    without_flag(argv, "--spawn"), "SYNTHETIC_BENCHMARK_COMMAND")
        return
    run(args)


if __name__ == "__main__":
    main()
