"""``reproduce``'s command line: ``list``, ``estimate`` or an experiment by name, every
argument checked before any work starts."""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time

import torch

from bagua_algos.experiments.reproduce.catalog import BY_NAME, EXPERIMENTS, list_experiments
from bagua_algos.experiments.reproduce.context import Context
from bagua_algos.experiments.reproduce.cost import estimate
from bagua_algos.experiments.reproduce.sweeps import LR_EXTEND


SCALES = ("proxy", "seed")
# the command's description: the first line of the package's docstring
DESCRIPTION = "The seeds' tables and figures, one command each, with the seed's numbers beside ours."


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="reproduce", description=DESCRIPTION)
    p.add_argument("experiment", help="an experiment's name, 'list', or 'estimate' (each seed-scale command's "
                                      "FLOPs and expected time)")
    p.add_argument("--scale", choices=SCALES, default="proxy",
                   help="proxy (default: this CPU, minutes) or seed (the seed's data, model, workers, epochs)")
    p.add_argument("--seeds", type=int, default=3, help="training seeds 0..N-1 (default 3)")
    p.add_argument("--out", default="results/reproduce", help="folder for the CSV and PNG (default results/reproduce)")
    p.add_argument("--data-dir", default=None, help="the CIFAR-10 python batches (needed by --scale seed)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--epochs", type=int, default=None, help="override the scale's epochs (shorter runs)")
    p.add_argument("--workers", type=int, default=None, help="override the scale's number of workers")
    p.add_argument("--max-steps", type=int, default=None, help="cut every epoch to this many steps (smoke runs)")
    p.add_argument("--lr-extend", type=int, default=LR_EXTEND,
                   help="where a tuned rate is the best at an edge of its grid, extend the grid by halving "
                        "below / doubling above and train the new rate, at most N times (default 3; 0: the grid "
                        "as given); a row still best at an edge is marked 'at edge'")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: the machine is shared)")
    p.add_argument("--executor", choices=("local", "ray"), default="local",
                   help="where the runs of the experiments built on the heterogeneity sweep train (seed002-*, "
                        "relaysum-table2): local (default) or ray, each run one Ray task (docs/cli.md)")
    p.add_argument("--ray-address", default=None,
                   help="with --executor ray: the cluster's HOST:PORT or auto (default: start a Ray here)")
    p.add_argument("--gpus-per-run", type=float, default=None,
                   help="with --device cuda: GPUs each sweep run holds (default 1; a fraction shares a GPU)")
    p.add_argument("--gpu-tflops", type=float, default=40.0,
                   help="for estimate: the sustained TFLOP/s assumed of one GPU (default 40)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    """Every argument checked before any work starts; a bad one ends with argparse's
    one-line error naming it."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.experiment not in ("list", "estimate") and args.experiment not in BY_NAME:
        parser.error(f"argument experiment: unknown {args.experiment!r}; valid: list, estimate, "
                     f"{', '.join(BY_NAME)}")
    if not (math.isfinite(args.gpu_tflops) and args.gpu_tflops > 0):
        parser.error(f"argument --gpu-tflops: expected a positive number, got {args.gpu_tflops}")
    check_executor(parser, args)
    if args.lr_extend < 0:
        parser.error(f"argument --lr-extend: expected an integer >= 0, got {args.lr_extend}")
    for name in ("seeds", "epochs", "workers", "max_steps", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"argument --{name.replace('_', '-')}: expected an integer >= 1, got {value}")
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device not in ("cpu", "cuda") and not args.device.startswith("cuda:"):
        parser.error(f"argument --device: expected cpu or cuda, got {args.device!r}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("argument --device: cuda, but this machine has no visible GPU; use --device cpu")
    experiment = BY_NAME.get(args.experiment)
    if args.scale == "seed" and experiment is not None and experiment.needs_data:
        from bagua_algos.experiments.data import check_data_dir

        try:
            check_data_dir(args.data_dir)
        except FileNotFoundError as err:
            parser.error(f"argument --data-dir: --scale seed of {args.experiment} trains on CIFAR-10: {err}")
    return args


def check_executor(parser, args) -> None:
    """``--executor ray``: Ray installed and ``--ray-address`` answering, and a sane
    ``--gpus-per-run``, before any work starts (one line, exit 2)."""
    if args.gpus_per_run is not None and not (math.isfinite(args.gpus_per_run) and args.gpus_per_run > 0):
        parser.error(f"argument --gpus-per-run: expected a positive number, got {args.gpus_per_run}")
    if args.executor != "ray":
        if args.ray_address is not None:
            parser.error(f"argument --ray-address: {args.ray_address!r} is where --executor ray sends the runs; add "
                         "--executor ray, or leave --ray-address out")
        return
    from bagua_algos.experiments.sweep.executors import ExecutorError, check_reachable, import_ray

    try:
        if not import_ray().is_initialized():
            check_reachable(args.ray_address)
    except ExecutorError as err:
        parser.error(f"argument {err.flag}: {err.reason}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.experiment == "list":
        list_experiments()
        return 0
    if args.experiment == "estimate":
        torch.set_num_threads(args.threads)
        estimate(args.gpu_tflops, EXPERIMENTS)
        return 0
    torch.set_num_threads(args.threads)
    experiment = BY_NAME[args.experiment]
    started = time.perf_counter()
    experiment.run(Context(args, experiment))
    print(f"   {experiment.name}: {time.perf_counter() - started:.0f} s; torch {torch.__version__}, "
          f"{platform.platform()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
