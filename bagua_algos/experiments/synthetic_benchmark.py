"""Synthetic data-parallel throughput benchmark: torch DDP and bagua_algos algorithms.

Every worker trains a model on one fixed random batch (no data loading, no accuracy:
only the speed of a training step, communication included). Run it under the
launcher::

    python -m bagua_algos.launch --nproc_per_node 4 benchmarks/synthetic_benchmark.py \\
        --model mlp --batch-size 32 --steps 20 --warmup 5 --configs "ddp;gradient_allreduce"

or let it start the launcher itself (``--spawn N`` re-invokes this script through
``bagua_algos.launcher.launch.main`` on a free port)::

    python benchmarks/synthetic_benchmark.py --spawn 4 --configs "ddp;gradient_allreduce"

With ``--algorithm NAME`` instead of ``--configs`` it speaks Bagua's own benchmark
script's interface and output (``--num-warmup-batches``, ``--num-batches-per-iter``,
``--num-iters``, ``Img/sec per CPU: X +-Y``, ...; see :mod:`bagua_algos.experiments.bagua_synthetic`).

``--configs`` is a ';'-separated list. Each entry is ``ddp`` (torch
DistributedDataParallel), a registered algorithm name, or ``NAME:key=value,...``
(values are read as int, float, bool, None or else string), e.g.
``relay:topology=double_binary_tree`` or ``decentralized:peer_selection_mode=shift_one``.
The keys ``do_flatten`` and ``bucket_size`` (bytes) go to ``with_bagua`` instead of the
algorithm; for ``ddp`` every key goes to ``DistributedDataParallel`` (e.g.
``ddp:bucket_cap_mb=10``). The first entry is the baseline of the ratios.

Timing: one process group for all configs. For each of ``--rounds`` rounds, each
config in turn gets a fresh model (same seed), ``--warmup`` untimed steps, then
``--steps`` steps timed with ``time.perf_counter`` between two barriers (the slowest
rank's time counts). The CPU time of the steps (``time.process_time``: all threads of
a worker, summed over workers) is reported too: on a machine shared with other jobs it
moves much less than the wall-clock time, and on an oversubscribed CPU host it is what
the throughput is made of. A config's result is the median over rounds; interleaving the
configs (in reverse order every other round) spreads the noise of a shared machine
over all of them. The "paired" ratio is the median over rounds of the ratio measured
within one round, the least noisy comparison when the load changes between rounds.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import shlex
import statistics
import sys
import textwrap
import time
from pathlib import Path


from bagua_algos.experiments.common import (DEVICES, BenchConfig, ConfigError, WorkerArgumentParser,
                               cuda_shortage, init_for_device, launch_self, parse_configs, usage_error, without_flag,
                               worker_device)

PROG = "synthetic_benchmark"
MODELS = ("mlp", "cnn", "cifar_resnet18", "resnet18", "resnet50", "vgg11")
IMAGE_SHAPE = (3, 32, 32)
COMMAND_ENV = "SYNTHETIC_BENCHMARK_COMMAND"


# ------------------------------------------------------------------------------ models


def build_model(name: str, num_classes: int, mlp_hidden: int, mlp_layers: int):
    import torch.nn as nn

    if name == "mlp":
        width = IMAGE_SHAPE[0] * IMAGE_SHAPE[1] * IMAGE_SHAPE[2]
        layers: list = [nn.Flatten()]
        for _ in range(mlp_layers):
            layers += [nn.Linear(width, mlp_hidden), nn.ReLU()]
            width = mlp_hidden
        layers.append(nn.Linear(width, num_classes))
        return nn.Sequential(*layers)
    if name == "cnn":
        return nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(128 * 4 * 4, 256), nn.ReLU(), nn.Linear(256, num_classes),
        )
    if name == "cifar_resnet18":  # the PowerSGD paper's ResNet-18 (3x3 stem, no max-pool)
        from bagua_algos.experiments.cifar_resnet import CifarResNet18

        return CifarResNet18(num_classes)
    import torchvision.models as tvm

    return getattr(tvm, name)(weights=None, num_classes=num_classes)


# ---------------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    """The side-by-side mode's parser; its --help ends with Bagua's mode's flags (one
    --help shows every flag of the script, each mode's in its own groups)."""
    from bagua_algos.experiments import bagua_synthetic

    description = textwrap.fill(
        "Synthetic-data training throughput of torch DDP and bagua_algos algorithms, in one of two modes: "
        "side by side (the default: every --configs entry timed in turn, ratios against the first), or "
        "Bagua's own benchmark script's interface (--algorithm NAME), whose flags and defaults are listed "
        "after this mode's.", 88)
    parser = WorkerArgumentParser(
        prog=PROG,
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,  # the epilog is a formatted help already
        description=description,
        epilog=bagua_synthetic.build_parser().format_help(),
    )
    what = parser.add_argument_group("what is timed (side-by-side mode)")
    what.add_argument("--configs", default="ddp;gradient_allreduce",
                      help="';'-separated configs: ddp, ALGO or ALGO:key=value,...; the first is the baseline")
    what.add_argument("--model", choices=MODELS, default="mlp", help="model to train (default mlp)")
    what.add_argument("--batch-size", type=int, default=32, help="images per worker per step (default 32)")
    what.add_argument("--num-classes", type=int, default=10, help="output classes (default 10)")
    what.add_argument("--mlp-hidden", type=int, default=1024,
                      help="hidden width of the mlp (default 1024: about 5.2 M parameters)")
    what.add_argument("--mlp-layers", type=int, default=3, help="hidden layers of the mlp (default 3)")
    what.add_argument("--lr", type=float, default=0.01, help="SGD learning rate (momentum 0.9; default 0.01)")
    what.add_argument("--seed", type=int, default=42, help="seed of the model and the data (default 42)")
    timing = parser.add_argument_group("timing")
    timing.add_argument("--steps", type=int, default=20, help="timed steps per config per round (default 20)")
    timing.add_argument("--warmup", type=int, default=5, help="untimed steps before each timed block (default 5)")
    timing.add_argument("--rounds", type=int, default=3,
                        help="rounds; each times every config once (reversed order every other "
                        "round), the median is reported (default 3)")
    workers = parser.add_argument_group("workers")
    workers.add_argument("--device", choices=DEVICES, default="auto",
                         help="where each worker trains: cuda (GPU LOCAL_RANK, NCCL), cpu (gloo), or auto (default: "
                         "cuda when the node has a GPU per worker, else cpu)")
    workers.add_argument("--threads", type=int, default=1,
                         help="torch threads per worker (default 1: the workers share the cores)")
    workers.add_argument("--spawn", type=int, default=None, metavar="N",
                         help="start N workers through bagua_algos' launcher and run this script in them")
    output = parser.add_argument_group("output")
    output.add_argument("--out", default=None,
                        help="write the results here: CSV if the name ends in .csv, else JSON")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    """Parse and check the flags: in the parent with ``--spawn`` (before any worker
    starts), else in each worker, where an error is printed once per node."""
    parser = build_parser()
    args = parser.parse_args(argv)
    for flag in ("batch_size", "steps", "rounds", "num_classes", "mlp_hidden", "mlp_layers", "threads"):
        if getattr(args, flag) < 1:
            parser.error(f"argument --{flag.replace('_', '-')}: must be >= 1, got {getattr(args, flag)}")
    if args.warmup < 0:
        parser.error(f"argument --warmup: must be >= 0, got {args.warmup}")
    if args.spawn is not None and args.spawn < 1:
        parser.error(f"argument --spawn: must be >= 1, got {args.spawn}")
    if args.device == "cuda":
        shortage = cuda_shortage(args.spawn)
        if shortage:
            parser.error(f"argument --device: {shortage}")
    return args


def spawn(nproc: int, argv: list[str]) -> None:
    """Run this script in ``nproc`` workers through the launcher (which exits on failure)."""
    launch_self("bagua_algos.experiments.synthetic_benchmark", nproc, without_flag(argv, "--spawn"), COMMAND_ENV)


# ------------------------------------------------------------------------------- worker


def host_info(world_size: int) -> dict:
    import torch

    from bagua_algos.runtime import comm

    cpu_model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu_model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return {
        "host": platform.node(),
        "platform": platform.platform(),
        "cpu_model": cpu_model,
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "backend": comm.get_backend_name(),
        "device": (f"cuda ({torch.cuda.get_device_name()}, {torch.cuda.device_count()} GPU(s))"
                   if comm.get_backend_name() == "nccl" else "cpu"),
        "world_size": world_size,
        "torch_threads_per_worker": torch.get_num_threads(),
        "master_addr": os.environ.get("MASTER_ADDR"),
    }


def command_line(world_size: int) -> str:
    given = os.environ.get(COMMAND_ENV)
    if given:
        return given
    script = os.path.relpath(os.path.abspath(sys.argv[0]), os.getcwd())
    local = os.environ.get("LOCAL_WORLD_SIZE", str(world_size))
    return shlex.join(["python", "-m", "bagua_algos.launch", "--nproc_per_node", local, script, *sys.argv[1:]])


def _synthetic_batch(args, device):
    import torch

    g = torch.Generator().manual_seed(args.seed + 1)  # drawn on the CPU: the same batch on every device
    data = torch.randn(args.batch_size, *IMAGE_SHAPE, generator=g)
    target = torch.randint(0, args.num_classes, (args.batch_size,), generator=g)
    return data.to(device), target.to(device)


def _wrap(config: BenchConfig, args, device):
    """(model to call, optimizer, finaliser) for a fresh model wrapped as ``config`` says."""
    import torch

    torch.manual_seed(args.seed)
    model = build_model(args.model, args.num_classes, args.mlp_hidden, args.mlp_layers).to(device)
    if config.is_qadam:
        # Adam's step is larger than SGD's at the same rate. The switch to compression
        # rebuilds the buckets, and as in Bagua that re-broadcasts the parameters and
        # Adam's two state tensors (3x the model from one rank): by default it falls
        # in the untimed steps (forward of step --warmup), so the timed steps measure
        # the compressed phase only.
        optimizer = config.build_qadam_optimizer(model.parameters(), lr=args.lr * 0.1,
                                                  default_warmup_steps=max(2, args.warmup - 1))
        model.with_bagua([optimizer], config.build_algorithm(optimizer), **config.wrap_kwargs)
        return model, optimizer, lambda: _finish(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    if config.is_ddp:
        ddp = torch.nn.parallel.DistributedDataParallel(model, **config.kwargs)
        return ddp, optimizer, lambda: None
    model.with_bagua([optimizer], config.build_algorithm(), **config.wrap_kwargs)
    return model, optimizer, lambda: _finish(model)


def _finish(model) -> None:
    """Unhook ``model``; an algorithm that averages in the background (``async``) is
    stopped first, or its rounds would go on competing with the next config's steps."""
    abort = getattr(model.bagua_algorithm, "abort", None)
    if abort is not None:
        abort(model)
    model.bagua_ddp.detach()


def time_config(config: BenchConfig, args, data, target, world_size: int) -> dict:
    """One timed block of ``config``: seconds of the slowest rank and the last loss."""
    import torch
    import bagua_algos
    from bagua_algos.runtime import comm

    model, optimizer, finish = _wrap(config, args, data.device)
    sync = torch.cuda.synchronize if data.is_cuda else (lambda: None)
    model.train()
    loss_fn = torch.nn.CrossEntropyLoss()

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(data), target)
        loss.backward()
        optimizer.step()
        return loss

    for _ in range(args.warmup):
        step()
    sync()
    bagua_algos.barrier()
    comm.reset_bytes_sent()
    start, cpu_start = time.perf_counter(), time.process_time()
    for _ in range(args.steps):
        loss = step()
    sync()
    cpu = time.process_time() - cpu_start
    sent = comm.bytes_sent()  # bytes this worker handed to comm (torch DDP's are not seen)
    bagua_algos.barrier()
    elapsed = time.perf_counter() - start
    finish()
    slowest = torch.tensor([elapsed], dtype=torch.float64)
    comm.allreduce_inplace(slowest, comm.ReduceOp.MAX)
    cpu_total = torch.tensor([cpu], dtype=torch.float64)
    comm.allreduce_inplace(cpu_total, comm.ReduceOp.SUM)
    sent_mean = torch.tensor([float(sent)], dtype=torch.float64)
    comm.allreduce_inplace(sent_mean, comm.ReduceOp.SUM)
    return {"elapsed_s": float(slowest.item()), "cpu_s": float(cpu_total.item()), "loss": float(loss.item()),
            "bytes_per_step": None if config.is_ddp else sent_mean.item() / world_size / args.steps}


def summarize(configs, per_round: dict, cpu_per_round: dict, args, world_size: int) -> list[dict]:
    """One row per config: medians over rounds and the ratios to the first config."""
    images = world_size * args.batch_size * args.steps
    rows = []
    base_label = configs[0].spec
    base_times = per_round[base_label]
    for config in configs:
        times = per_round[config.spec]
        ips = [images / t for t in times]
        ms = [1000.0 * t / args.steps for t in times]
        cpu_ms = [1000.0 * t / args.steps for t in cpu_per_round[config.spec]]
        rows.append({
            "config": config.spec,
            "images_per_s": statistics.median(ips),
            "ms_per_step": statistics.median(ms),
            "ms_per_step_min": min(ms),
            "ms_per_step_max": max(ms),
            "round_images_per_s": ips,
            "round_ms_per_step": ms,
            "cpu_ms_per_step": statistics.median(cpu_ms),
            "round_cpu_ms_per_step": cpu_ms,
        })
    base = rows[0]
    for row, config in zip(rows, configs):
        row["step_time_ratio"] = row["ms_per_step"] / base["ms_per_step"]
        row["images_per_s_ratio"] = row["images_per_s"] / base["images_per_s"]
        row["step_time_ratio_paired"] = statistics.median(
            t / b for t, b in zip(per_round[config.spec], base_times)
        )
        row["cpu_time_ratio"] = row["cpu_ms_per_step"] / base["cpu_ms_per_step"]
    return rows


# Besides the baseline, the seed's Table 5.1 compares every algorithm with these two.
REFERENCE_CONFIGS = {"allreduce_average": "AA", "gradient_allreduce": "GA"}


def add_reference_ratios(rows: list[dict]) -> None:
    """``images_per_s_vs_NAME`` and ``bytes_vs_NAME`` on every row, for each reference
    config (exactly ``allreduce_average`` / ``gradient_allreduce``) that was timed."""
    for name in REFERENCE_CONFIGS:
        reference = next((row for row in rows if row["config"] == name), None)
        if reference is None:
            continue
        for row in rows:
            row[f"images_per_s_vs_{name}"] = row["images_per_s"] / reference["images_per_s"]
            sent, ref_sent = row.get("bytes_per_step"), reference.get("bytes_per_step")
            row[f"bytes_vs_{name}"] = sent / ref_sent if sent is not None and ref_sent else None


def format_table(rows: list[dict], baseline: str) -> str:
    headers = ["config", "images/s", "ms/step", "ms/step min-max",
               "step-time ratio", "images/s ratio", "paired step-time ratio",
               "CPU ms/step", "CPU-time ratio", "bytes sent/step", "bytes ratio"]
    references = [name for name in REFERENCE_CONFIGS if rows and f"images_per_s_vs_{name}" in rows[0]]
    for name in references:
        headers += [f"images/s vs {REFERENCE_CONFIGS[name]}", f"bytes vs {REFERENCE_CONFIGS[name]}"]
    body = []
    for r in rows:
        extra = []
        for name in references:
            sent = r.get(f"bytes_vs_{name}")
            extra += [f"{r[f'images_per_s_vs_{name}']:.3f}", "n/a" if sent is None else f"{sent:.4f}"]
        body.append([
            r["config"],
            f"{r['images_per_s']:.1f}",
            f"{r['ms_per_step']:.1f}",
            f"{r['ms_per_step_min']:.1f}-{r['ms_per_step_max']:.1f}",
            f"{r['step_time_ratio']:.3f}",
            f"{r['images_per_s_ratio']:.3f}",
            f"{r['step_time_ratio_paired']:.3f}",
            f"{r['cpu_ms_per_step']:.1f}",
            f"{r['cpu_time_ratio']:.3f}",
            "n/a" if r.get("bytes_per_step") is None else f"{r['bytes_per_step']:.0f}",
            "n/a" if r.get("bytes_ratio") is None else f"{r['bytes_ratio']:.4f}",
            *extra,
        ])
    widths = [max(len(h), *(len(line[i]) for line in body)) for i, h in enumerate(headers)]
    lines = [
        " | ".join(h.ljust(w) for h, w in zip(headers, widths)),
        "-+-".join("-" * w for w in widths),
    ]
    for line in body:
        lines.append(" | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))))
    lines.append(
        f"step-time ratio = ms/step of the config / ms/step of the baseline ({baseline}); "
        f"<= 1.05 means at most 5% slower."
    )
    lines.append(
        "images/s ratio = images/s of the config / images/s of the baseline; higher is faster. "
        "paired = median over rounds of the same-round step-time ratio."
    )
    lines.append(
        "CPU ms/step = CPU time of a step summed over all workers (all threads); "
        "CPU-time ratio = config / baseline."
    )
    lines.append(
        "bytes sent/step = bytes a worker hands to bagua_algos' collectives per step (comm.bytes_sent(), "
        "mean over workers; n/a for torch DDP); bytes ratio = config / baseline."
    )
    for name in references:
        lines.append(f"images/s vs {REFERENCE_CONFIGS[name]}, bytes vs {REFERENCE_CONFIGS[name]} = "
                     f"the same ratios against {name} (as in the seed's Table 5.1).")
    return "\n".join(lines)


def write_results(path: str, report: dict) -> None:
    target = Path(path)
    if target.parent != Path(""):
        target.parent.mkdir(parents=True, exist_ok=True)
    if target.suffix.lower() == ".csv":
        fields = ["config", "images_per_s", "ms_per_step", "ms_per_step_min", "ms_per_step_max",
                  "step_time_ratio", "images_per_s_ratio", "step_time_ratio_paired",
                  "cpu_ms_per_step", "cpu_time_ratio", "bytes_per_step", "bytes_ratio",
                  *(f"{kind}_vs_{name}" for name in REFERENCE_CONFIGS for kind in ("images_per_s", "bytes")),
                  "baseline",
                  "model", "world_size", "batch_size", "steps", "warmup", "rounds", "torch"]
        with open(target, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
            writer.writeheader()
            for row in report["results"]:
                writer.writerow({**row, **{k: report["settings"].get(k) for k in fields if k in report["settings"]},
                                 "baseline": report["baseline"], "world_size": report["host"]["world_size"],
                                 "torch": report["host"]["torch"]})
    else:
        with open(target, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")


def run_worker(args, configs) -> None:
    import torch
    import bagua_algos

    torch.set_num_threads(args.threads)
    device = init_for_device(worker_device(args.device))
    try:
        rank, world_size = bagua_algos.get_rank(), bagua_algos.get_world_size()
        say = print if rank == 0 else (lambda *a, **k: None)
        info = host_info(world_size)
        n_params = sum(p.numel() for p in build_model(args.model, args.num_classes, args.mlp_hidden, args.mlp_layers).parameters())
        say(f"{PROG}: command: {command_line(world_size)}")
        say(f"{PROG}: device {info['device']}, world size {world_size}, backend {info['backend']}, torch {info['torch']}, "
            f"python {info['python']}, {info['torch_threads_per_worker']} torch thread(s) per worker")
        say(f"{PROG}: host {info['host']}: {info['cpu_count']} CPUs ({info['cpus_usable']} usable), "
            f"{info['cpu_model']}, {info['platform']}")
        say(f"{PROG}: model {args.model} ({n_params / 1e6:.2f} M parameters), batch {args.batch_size} per worker, "
            f"{args.warmup} warmup + {args.steps} timed steps, {args.rounds} round(s), "
            f"configs {[c.spec for c in configs]} (baseline {configs[0].spec})", flush=True)

        data, target = _synthetic_batch(args, device)
        per_round: dict[str, list[float]] = {c.spec: [] for c in configs}
        cpu_per_round: dict[str, list[float]] = {c.spec: [] for c in configs}
        losses: dict[str, float] = {}
        sent_per_step: dict = {}
        for r in range(args.rounds):
            # odd rounds run the configs in reverse (A B, B A, ...): a slow drift of the
            # machine's load then favours no config
            for config in (configs if r % 2 == 0 else configs[::-1]):
                result = time_config(config, args, data, target, world_size)
                per_round[config.spec].append(result["elapsed_s"])
                cpu_per_round[config.spec].append(result["cpu_s"])
                losses[config.spec] = result["loss"]
                sent_per_step[config.spec] = result["bytes_per_step"]
                ms = 1000.0 * result["elapsed_s"] / args.steps
                say(f"{PROG}: round {r + 1}/{args.rounds} {config.spec}: {ms:.1f} ms/step, "
                    f"{world_size * args.batch_size * args.steps / result['elapsed_s']:.1f} images/s, "
                    f"CPU {1000.0 * result['cpu_s'] / args.steps:.1f} ms/step, "
                    f"loss {result['loss']:.4f}", flush=True)

        rows = summarize(configs, per_round, cpu_per_round, args, world_size)
        for row in rows:
            row["final_loss"] = losses[row["config"]]
            row["bytes_per_step"] = sent_per_step[row["config"]]
            base_sent = sent_per_step[configs[0].spec]
            row["bytes_ratio"] = row["bytes_per_step"] / base_sent if row["bytes_per_step"] and base_sent else None
        add_reference_ratios(rows)
        say("")
        say(format_table(rows, configs[0].spec), flush=True)
        if rank == 0 and args.out:
            settings = {k: v for k, v in vars(args).items() if k not in ("out", "spawn")}
            settings["parameters"] = n_params
            report = {
                "command": command_line(world_size),
                "host": info,
                "settings": settings,
                "baseline": configs[0].spec,
                "results": rows,
            }
            write_results(args.out, report)
            say(f"{PROG}: results written to {args.out}", flush=True)
        bagua_algos.barrier()
    finally:
        bagua_algos.destroy_process_group()


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a == "--algorithm" or a.startswith("--algorithm=") for a in argv):
        # Bagua's own script's interface: one algorithm, Bagua's output lines
        from bagua_algos.experiments import bagua_synthetic

        bagua_synthetic.main(argv)
        return
    args = parse_args(argv)
    try:
        configs = parse_configs(args.configs)
    except ConfigError as err:
        usage_error(PROG, str(err))
    if args.spawn is not None:
        spawn(args.spawn, argv)
        return
    run_worker(args, configs)


if __name__ == "__main__":
    main()
