"""The one-process engine's speed, as ratios measured in one run.

    python benchmarks/engine_benchmark.py batching            # n workers at b vs one model at n·b
    python benchmarks/engine_benchmark.py comm --workers 64   # the communication step's share
    python benchmarks/engine_benchmark.py sweep               # the default sweep: sim vs processes

Sections:

- ``batching``: the physical limit of stacking. n workers at batch b (the engine, with
  ``allreduce_average``) against one model at batch n·b (the same arithmetic: one
  forward, backward and SGD step), images/s; blocks of steps interleaved over rounds, the
  ratio is the median of the rounds' (goal ≥ 0.5). Models: ``mlp`` and ``cnn`` on digits'
  8×8 and MNIST's 28×28 images; ``vgg11`` and ``resnet20`` at 3×32×32 (meant for a GPU).
- ``comm``: at ``--workers`` (64), for each model-averaging algorithm (allreduce average, D-PSGD
  on a ring, relay on a chain and a double binary tree), the share of a training step
  spent in the algorithm's hooks and bucket ops (goal < 10 % for the MLP), and each hook's milliseconds per
  step; also for PowerSGD at rank 2 (the sweep's setting), whose hooks compress as well
  as average (no goal). The step and its hooks are timed in the same blocks of steps
  (``--rounds`` blocks of ``--steps``, after ``--warmup`` steps); the median block's.
  On the CPU each algorithm runs twice, its blocks interleaved: with the torch passes and
  with cuda_ext's compiled ones (``--passes``; loaded here, built on first use), and a
  line per algorithm gives the ratio of their hooks' times.
- ``sweep``: the README's default sweep shortened to one α and a few epochs, run as
  processes (``--engine processes``), on the engine one run at a time (``--jobs 1``)
  and on the engine as it runs by default (runs in parallel, one a core), wall clock
  and CPU seconds each (goal ≥ 10×).

On the CPU the first two sections time this process's CPU time (``time.process_time``),
the steps and the engine's hooks alike (``StackedRuntime.clock``), so that other load on
a shared machine does not enter the ratios; the sweep's engines
are separate processes and are timed by the wall clock.

Prints one JSON line per figure after a header naming the machine and device.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

from bagua_algos.algorithms import (AllreduceAverageAlgorithm, DecentralizedAlgorithm,
                                    PowerSGDAlgorithm, RelayAlgorithm)
from bagua_algos.engine import Engine, StackedRuntime
from bagua_algos.engine.rows import torch_passes_only
from bagua_algos.experiments.data import SmallCNN, ResNet20

MODELS = {
    "mlp": ((1, 8, 8), lambda: torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                                    torch.nn.Linear(128, 128), torch.nn.ReLU(),
                                                    torch.nn.Linear(128, 10))),
    "cnn": ((1, 28, 28), lambda: SmallCNN((1, 28, 28), 10)),
    "vgg11": ((3, 32, 32), None),
    "resnet20": ((3, 32, 32), lambda: ResNet20(10)),
}


def _vgg11():
    from torchvision.models import vgg11

    net = vgg11(num_classes=10)
    net.avgpool = torch.nn.Flatten()
    net.classifier = torch.nn.Linear(512, 10)
    return net


def build(name):
    shape, make = MODELS[name]
    torch.manual_seed(0)
    return shape, (make or _vgg11)()


def _clock(device) -> float:
    """Seconds for the batching and comm sections: on the CPU this process's CPU time
    (single-threaded by default, so it is the work done, whatever else loads the
    machine); on a GPU wall-clock time, between synchronisations."""
    return time.process_time() if device.type == "cpu" else time.perf_counter()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.01, momentum=0.9, weight_decay=1e-4)


def batching(args, device) -> list[dict]:
    out = []
    loss_fn = torch.nn.functional.cross_entropy
    for name in args.models:
        shape, module = build(name)
        n, b = args.workers, args.batch
        engine = Engine(module, n, AllreduceAverageAlgorithm(), _sgd, device=device)
        x = torch.randn(n, b, *shape, device=device)
        y = torch.randint(0, 10, (n, b), device=device)
        _, single = build(name)
        single = single.to(device)
        opt = _sgd(single.parameters())
        xs, ys = x.reshape(n * b, *shape), y.reshape(n * b)

        def engine_steps(k):
            for _ in range(k):
                engine.step(x, y, loss_fn)

        def single_steps(k):
            for _ in range(k):
                opt.zero_grad()
                loss_fn(single(xs), ys).backward()
                opt.step()

        ratios, speeds = [], []
        engine_steps(2)
        single_steps(2)
        for _ in range(args.rounds):
            times = []
            for fn in (engine_steps, single_steps):
                _sync(device)
                start = _clock(device)
                fn(args.steps)
                _sync(device)
                times.append(_clock(device) - start)
            ratios.append(times[1] / times[0])  # engine images/s over single images/s
            speeds.append(n * b * args.steps / times[0])
        out.append({"section": "batching", "model": name, "workers": n, "batch": b,
                    "engine_images_per_s": round(statistics.median(speeds), 1),
                    "ratio_vs_one_model_at_n_times_b": round(statistics.median(ratios), 3), "goal": ">= 0.5"})
        print(json.dumps(out[-1]), flush=True)
    return out


HOOKS = StackedRuntime.PHASES  # the algorithm's hooks and bucket ops: its whole communication step


def _passes_variants(args, device) -> dict:
    """The ways the engine's passes run in this comparison: ``torch`` (the row gathers, one
    pass a term) and, on the CPU, ``compiled`` (cuda_ext's engine passes, loaded here)."""
    if device.type != "cpu" and args.passes == "compiled":
        raise SystemExit(f"argument --passes: the compiled passes run on the CPU only, not on {device.type} "
                         "(valid here: both, torch)")
    if device.type != "cpu" or args.passes == "torch":
        return {"torch": torch_passes_only}
    import cuda_ext

    try:
        cuda_ext.load_cpu_passes()  # a first build takes about a minute
    except cuda_ext.ExtensionUnavailable as error:
        if args.passes == "compiled":
            raise SystemExit(f"argument --passes: compiled passes unavailable: {error}")
        print(f"# compiled passes unavailable, timing torch's only: {error}", file=sys.stderr)
        return {"torch": torch_passes_only}
    variants = {"torch": torch_passes_only, "compiled": contextlib.nullcontext}
    return variants if args.passes == "both" else {"compiled": contextlib.nullcontext}


def comm(args, device) -> list[dict]:
    """Per algorithm and way of running the passes (:func:`_passes_variants`): ``--warmup``
    steps, then ``--rounds`` blocks of ``--steps`` steps, the ways' blocks interleaved,
    each block timed whole and hook by hook with the same clock; the share is the hooks'
    time over the block's, the median over blocks (min and max beside it). With both
    ways, a last line per algorithm gives compiled / torch of the hooks' time, per round."""
    out = []
    loss_fn = torch.nn.functional.cross_entropy
    algorithms = {
        "allreduce_average": AllreduceAverageAlgorithm,
        "decentralized_ring": lambda: DecentralizedAlgorithm(topology="ring"),
        "relay_chain": lambda: RelayAlgorithm(topology="chain"),
        "relay_double_binary_tree": lambda: RelayAlgorithm(topology="double_binary_tree"),
        "powersgd_rank2": lambda: PowerSGDAlgorithm(rank=2),
    }
    variants = _passes_variants(args, device)
    for name in args.models:
        for label, make_algorithm in algorithms.items():
            n, b = args.workers, args.batch
            runs = {}
            for variant, context in variants.items():
                with context():
                    shape, module = build(name)
                    engine = Engine(module, n, make_algorithm(), _sgd, device=device)
                    x = torch.randn(n, b, *shape, device=device)
                    y = torch.randint(0, 10, (n, b), device=device)
                    for _ in range(args.warmup):
                        engine.step(x, y, loss_fn)
                engine.runtime.timings = dict.fromkeys(HOOKS, 0.0)
                engine.runtime.clock = lambda: _clock(device)  # the hooks on the steps' clock
                runs[variant] = (context, engine, x, y, {"share": [], "step_ms": [], "hooks_ms": [],
                                                         **{hook: [] for hook in HOOKS}})
            for _ in range(args.rounds):
                for variant, (context, engine, x, y, figures) in runs.items():
                    engine.runtime.timings = dict.fromkeys(HOOKS, 0.0)
                    with context():
                        _sync(device)
                        start = _clock(device)
                        for _ in range(args.steps):
                            engine.step(x, y, loss_fn)
                        _sync(device)
                        total = _clock(device) - start
                    hooks = sum(engine.runtime.timings.values())
                    figures["share"].append(hooks / total)
                    figures["step_ms"].append(total / args.steps * 1e3)
                    figures["hooks_ms"].append(hooks / args.steps * 1e3)
                    for hook in HOOKS:
                        figures[hook].append(engine.runtime.timings[hook] / args.steps * 1e3)
            for variant, (_, _, _, _, figures) in runs.items():
                shares = figures["share"]
                out.append({"section": "comm", "model": name, "algorithm": label, "passes": variant, "workers": n,
                            "batch": b, "step_ms": round(statistics.median(figures["step_ms"]), 2),
                            "hook_ms": {hook: round(statistics.median(figures[hook]), 3) for hook in HOOKS},
                            "comm_share": round(statistics.median(shares), 3),
                            "comm_share_range": [round(min(shares), 3), round(max(shares), 3)],
                            "goal": None if label.startswith("powersgd") else "< 0.10 (mlp)"})
                print(json.dumps(out[-1]), flush=True)
            if len(runs) == 2:
                ratios = [c / t for t, c in zip(runs["torch"][4]["hooks_ms"], runs["compiled"][4]["hooks_ms"])]
                out.append({"section": "comm", "model": name, "algorithm": label, "workers": n,
                            "hooks_compiled_over_torch": round(statistics.median(ratios), 3),
                            "range": [round(min(ratios), 3), round(max(ratios), 3)]})
                print(json.dumps(out[-1]), flush=True)
    return out


def sweep(args, device) -> list[dict]:
    """The shortened sweep as whole commands, start-up included: processes, the engine
    one run at a time (``--jobs 1``) and the engine with its default ``--jobs``, in
    turn, ``--sweep-rounds`` times; wall clock and the CPU seconds of each command (its
    processes together), and the load average at its start."""
    import resource

    common = ["--alphas", "0.1", "--epochs", str(args.sweep_epochs), "--no-progress", "--workers", str(args.workers)]
    commands = {"processes": ["--engine", "processes"], "sim_jobs1": ["--engine", "sim", "--jobs", "1"],
                "sim": ["--engine", "sim"]}
    out = []
    for round_ in range(args.sweep_rounds):
        times, cpu, load = {}, {}, {}
        for name, flags in commands.items():
            load[name] = float(open("/proc/loadavg").read().split()[0]) if os.path.exists("/proc/loadavg") else None
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            start = time.perf_counter()
            subprocess.run([sys.executable, "-m", "bagua_algos.experiments.sweep.cli", *flags, "--out-dir", f"/tmp/engine_benchmark_{name}",
                            *common], check=True, capture_output=True, timeout=3600)
            times[name] = time.perf_counter() - start
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu[name] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        out.append({"section": "sweep", "round": round_ + 1, "workers": args.workers, "epochs": args.sweep_epochs,
                    "alphas": [0.1], **{f"{k}_s": round(v, 1) for k, v in times.items()},
                    **{f"{k}_cpu_s": round(v, 1) for k, v in cpu.items()}, "load_at_start": load,
                    "speedup": round(times["processes"] / times["sim"], 2),
                    "speedup_jobs1": round(times["processes"] / times["sim_jobs1"], 2), "goal": ">= 10"})
        print(json.dumps(out[-1]), flush=True)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(prog="engine_benchmark", description=__doc__.split("\n\n")[0])
    p.add_argument("section", choices=("batching", "comm", "sweep"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    p.add_argument("--models", default=None,
                   help="comma-separated of mlp, cnn, vgg11, resnet20 (default: mlp,cnn on CPU, all four on a GPU; "
                        "comm: mlp)")
    p.add_argument("--workers", type=int, default=None, help="n (default: 16 batching, 64 comm, 8 sweep)")
    p.add_argument("--batch", type=int, default=16, help="batch per worker (default 16)")
    p.add_argument("--steps", type=int, default=10, help="steps per timed block (default 10)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds; comm: timed blocks (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="comm: untimed steps before the first block (default 2)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--passes", default="both", choices=("both", "torch", "compiled"),
                   help="comm on the CPU: time the torch passes, cuda_ext's compiled ones (built on first "
                        "use, about a minute), or both interleaved (default; torch only where it cannot be built)")
    p.add_argument("--sweep-epochs", type=int, default=5, help="epochs of the shortened sweep (default 5)")
    p.add_argument("--sweep-rounds", type=int, default=1, help="rounds of the sweep's three commands (default 1)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("argument --device: cuda, but torch sees no GPU here (valid here: cpu)")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.models is None:
        args.models = "mlp" if args.section == "comm" else (
            "mlp,cnn,vgg11,resnet20" if device.type == "cuda" else "mlp,cnn")
    args.models = [m.strip() for m in args.models.split(",")]
    bad = [m for m in args.models if m not in MODELS]
    if bad:
        p.error(f"argument --models: unknown {bad}; valid: {list(MODELS)}")
    if args.workers is None:
        args.workers = {"batching": 16, "comm": 64, "sweep": 8}[args.section]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    print(json.dumps({"machine": {"cpus": os.cpu_count(), "device": name, "torch": torch.__version__,
                                  "threads": args.threads}}), flush=True)
    {"batching": batching, "comm": comm, "sweep": sweep}[args.section](args, device)


if __name__ == "__main__":
    main()
