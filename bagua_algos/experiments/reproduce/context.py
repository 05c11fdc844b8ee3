"""One experiment's command line, output folder and data (:class:`Context`), and the
memory check before training."""

from __future__ import annotations

import csv
import os
import sys
from pathlib import Path

import torch

from bagua_algos.experiments import reproduce_train as rt


class Context:
    """One experiment's command line, output folder and data."""

    def __init__(self, args, experiment):
        self.args = args
        self.experiment = experiment
        self.scale = args.scale
        self.out = Path(args.out)
        check_out(self.out)
        self.device = torch.device(args.device)
        self.seeds = list(range(args.seeds))
        self.runs = {}  # label -> [Run per seed] of the last comparison (for a figure's extra panels)
        self._data = {}

    def setting(self, family: dict) -> rt.Setting:
        setting = family[self.scale]
        changes = {k: v for k, v in (("epochs", self.args.epochs), ("workers", self.args.workers),
                                      ("max_steps_per_epoch", self.args.max_steps)) if v is not None}
        return setting.with_(**changes)

    def data(self, dataset: str):
        if dataset not in self._data:
            self._data[dataset] = rt.load(dataset, self.args.data_dir, 0, self.device)
        return self._data[dataset]

    def sweep_flags(self) -> list[str]:
        """What the heterogeneity sweeps of this experiment add to their arguments, kept out
        of the hash that names a sweep's folder (they do not change its runs): where the runs
        train (``--executor``, ``--ray-address``, ``--gpus-per-run``), and ``--lr-extend 0``,
        since reproduce brackets each row's rate itself, over the seeds (``sweeps.bracket_lr``)."""
        flags = ["--lr-extend", "0", "--executor", getattr(self.args, "executor", "local")]
        if getattr(self.args, "ray_address", None):
            flags += ["--ray-address", self.args.ray_address]
        if getattr(self.args, "gpus_per_run", None) is not None:
            flags += ["--gpus-per-run", f"{self.args.gpus_per_run:g}"]
        return flags

    def path(self, suffix: str) -> Path:
        return self.out / f"{self.experiment.name}{suffix}"

    def header(self, seed_text: str, ours: str, differs: str) -> None:
        e = self.experiment
        print(f"== {e.name}: {e.source} -- {e.summary}")
        print(f"   seed's setting: {seed_text}")
        print(f"   ours ({self.scale} scale, {self.device}, {describe_device(self.device)}): {ours}")
        print(f"   differs: {differs if self.scale == 'proxy' else 'seed scale: ' + e.seed_scale_differs}")

    def write_csv(self, rows: list[dict]) -> Path:
        path = self.path(".csv")
        keys = list(dict.fromkeys(k for row in rows for k in row))
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, keys)
            writer.writeheader()
            writer.writerows(rows)
        return path


def check_out(out: Path) -> None:
    """``--out`` must be a folder this process can create and write in, checked before
    any training (a file is created there and removed); else one line naming it, exit 2
    (argparse's status for a bad argument)."""
    import tempfile

    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write-check-"):
            pass
    except OSError as error:
        print(f"reproduce: error: argument --out: cannot write in {str(out)!r} ({error.strerror or error}); give a "
              "folder you can create and write in", file=sys.stderr)
        raise SystemExit(2) from None


def describe_device(device) -> str:
    """The device as the headers and figures name it: the GPU's name, or the CPU's cores
    and torch's threads."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"


def check_memory(ctx, setting: rt.Setting, model, data) -> None:
    """Stop before training when the stacked workers would not fit the device (the
    sweep's estimate, bagua_algos/experiments/sweep/memory.py), naming both figures."""
    from bagua_algos.experiments.sweep.memory import available_bytes, needed_bytes

    data_bytes = sum(t.numel() * t.element_size() for t in (data.train_x, data.train_y, data.test_x, data.test_y))
    need = needed_bytes("sim", setting.workers, model, data.train_x[0].cpu(), setting.batch, data_bytes)
    have = available_bytes(ctx.device)
    if need > have:
        sys.exit(f"reproduce: {setting.workers} workers of {setting.model} at batch {setting.batch} need about "
                 f"{need / 2**30:.1f} GiB and {ctx.device} has {have / 2**30:.1f} GiB available; use --workers "
                 "with fewer workers or a larger device")
