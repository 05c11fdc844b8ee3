"""The sweep's report: the best run of each (config, α), the table printed at the end,
``results.csv`` and ``results.json`` (the plots are :mod:`bagua_algos.experiments.sweep.plots`).

A column of the table and the CSV is one entry of :data:`TABLE_COLUMNS` (title, the
run record's field, format): a new reported quantity is a field of the run's record
(``runs.run_result``) and a row here.
"""

from __future__ import annotations

import csv
import json
import os
import platform
import sys
import time
from pathlib import Path

from bagua_algos.experiments.sweep.config import SweepConfig
from bagua_algos.experiments.sweep.plots import plot_accuracy, plot_histograms

__all__ = ["COMMAND_ENV", "TABLE_COLUMNS", "config_label", "best_runs", "make_report", "format_table",
           "write_outputs", "write_report"]

# The user's command line, kept by the parent for the workers of --engine processes to report.
COMMAND_ENV = "HETEROGENEITY_SWEEP_COMMAND"


def config_label(config) -> str:
    """``relay (double_binary_tree)``, ``decentralized (ring)``, ``decentralized (all)``."""
    kwargs = config.kwargs
    if kwargs.get("quasi_global_momentum"):
        return f"{config.name} ({kwargs.get('topology')}, quasi-global momentum)"
    if "topology" in kwargs:
        return f"{config.name} ({kwargs['topology']})"
    if "peer_selection_mode" in kwargs:
        return f"{config.name} ({kwargs['peer_selection_mode']})"
    if config.name == "powersgd":
        return f"powersgd (rank {kwargs.get('rank', 1)})"
    if config.name == "diloco":  # H, and the streaming settings that differ from DiLoCo's defaults
        parts = [f"H {kwargs.get('sync_every', 500)}"] + [f"{key} {kwargs[key]}" for key in
                                                         ("fragments", "overlap", "compression", "fragment_pattern")
                                                         if kwargs.get(key)]
        return f"diloco ({', '.join(parts)})"
    if config.name == "terngrad":
        clip = kwargs.get("clip")
        return f"terngrad ({kwargs.get('bits', 2)} bits{f', clip {clip}' if clip is not None else ''})"
    return config.name


def write_report(sweep: SweepConfig, runs, failed, started) -> None:
    report = make_report(sweep, runs, sweep.workers, time.perf_counter() - started)
    report["failed_runs"] = failed
    report["results"] = mark_edges(report["results"], runs + failed)
    write_outputs(sweep, report)


def mark_edges(best: list[dict], records: list[dict]) -> list[dict]:
    """Copies of the best runs ``best``, each with its (config, α)'s tried rates,
    ``lr_grid_tried`` (ascending, failed runs too), and ``lr_at_edge``: whether its rate is
    the lowest or the highest of them (the optimum may lie beyond; None with one rate).
    Copies: the run records themselves stay as the run log has them."""
    marked = []
    for row in best:
        tried = sorted({r["lr"] for r in records if (r["config"], r["alpha"]) == (row["config"], row["alpha"])})
        marked.append({**row, "lr_grid_tried": tried,
                       "lr_at_edge": None if len(tried) < 2 else row["lr"] in (tried[0], tried[-1])})
    return marked


HEADLINE = "final_mean_worker_accuracy"
"""The quantity the sweep reports first and tunes the learning rate on when the protocol
names no other: the workers' own models' test accuracy, averaged over the workers (each
worker evaluates its own parameters). The protocol's ``quantity`` chooses another: the
RelaySum paper's worst worker (``final_worst_worker_tail_accuracy``). The averaged model
(1/n) Σ x_i, which no worker holds, is reported beside them, named as such."""


def headline_of(sweep: SweepConfig) -> str:
    """The run record's field the sweep tunes on and reports first: its protocol's quantity."""
    return sweep.protocol.quantity_field


def best_runs(runs: list[dict], headline: str = HEADLINE) -> list[dict]:
    """Per (config, α), the run with the best final ``headline`` (a field of the run's
    record); of equal ones the smaller rate (the safer), whatever order the runs came in."""
    best: dict = {}
    for run in runs:
        key = (run["config"], run["alpha"])
        if key not in best or (run[headline], -run["lr"]) > (best[key][headline], -best[key]["lr"]):
            best[key] = run
    return list(best.values())


def make_report(sweep: SweepConfig, runs, world_size: int, seconds: float) -> dict:
    import torch

    from bagua_algos.experiments.data import describe_setup

    command = os.environ.get(COMMAND_ENV) or " ".join([Path(sys.executable).name, *sys.argv])
    return {
        "command": command,
        "protocol": sweep.protocol.describe(),
        "setup": describe_setup(sweep.dataset, sweep.model),  # the model (parameters) and the data pipeline
        "headline": headline_of(sweep),
        "settings": sweep.settings(),
        "world_size": world_size,
        "engine": sweep.engine,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "seconds": seconds,
        "results": best_runs(runs, headline_of(sweep)),
        "all_runs": runs,
    }


TABLE_COLUMNS = [
    ("algorithm (topology)", "label", "{}"),
    ("alpha", "alpha", "{:g}"),
    ("lr", "lr", "{:g}"),
    ("workers' acc (mean)", "final_mean_worker_accuracy", "{:.4f}"),
    ("worst worker acc", "final_min_worker_accuracy", "{:.4f}"),
    ("worst worker, tail mean", "final_worst_worker_tail_accuracy", "{:.4f}"),
    ("averaged model acc", "final_averaged_model_accuracy", "{:.4f}"),
]


def table_columns(headline: str = HEADLINE) -> list:
    """TABLE_COLUMNS with the ``headline`` quantity's column first after the lr (marked *)."""
    first, rest = TABLE_COLUMNS[:3], TABLE_COLUMNS[3:]
    lead = [(f"* {title}", key, fmt) for title, key, fmt in rest if key == headline]
    return first + lead + [column for column in rest if column[1] != headline]


def format_table(rows: list[dict], headline: str = HEADLINE) -> str:
    columns = table_columns(headline)
    cells = [[fmt.format(row[key]) + (" (edge)" if key == "lr" and row.get("lr_at_edge") else "")
              for _, key, fmt in columns] for row in rows]
    widths = [max([len(title), *(len(c[i]) for c in cells)]) for i, (title, _, _) in enumerate(columns)]  # no row: the titles
    line = lambda values: "  ".join(v.ljust(w) for v, w in zip(values, widths))  # noqa: E731
    return "\n".join([line([t for t, _, _ in columns]), line(["-" * w for w in widths])] + [line(c) for c in cells])


def write_outputs(sweep: SweepConfig, report: dict) -> None:
    out = Path(sweep.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = sorted(report["results"], key=lambda r: (-r["alpha"], r["label"]))
    with open(out / "results.json", "w") as f:
        json.dump(report, f, indent=1)
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.writer(f)
        columns = table_columns(report["headline"])
        writer.writerow([key for _, key, _ in columns] + ["config", "seconds", "protocol", "lr_at_edge",
                                                          "lr_grid_tried"])
        for row in rows:
            edge = row.get("lr_at_edge")
            writer.writerow([row.get(key, "") for _, key, _ in columns] + [
                row["config"], f"{row['seconds']:.1f}", report["protocol"], "" if edge is None else edge,
                ";".join(f"{lr:g}" for lr in row.get("lr_grid_tried", []))])
    plot_accuracy(rows, out / "accuracy_vs_epoch.png", report)
    plot_histograms(rows, out / "class_histograms.png", report)
    print(f"\n{report['command']}\n{report['world_size']} workers ({report['engine']} engine), {sweep.dataset}, "
          f"{sweep.model}, {sweep.epochs} epochs, {report['seconds']:.0f} s\n{report['protocol']}\n"
          f"(* the protocol's quantity: each (algorithm, alpha)'s lr chosen on it"
          + ("; (edge): still the lowest or highest rate tried after --lr-extend, the optimum may lie beyond"
             if any(row.get("lr_at_edge") for row in rows) else "") + ")\n")
    print(format_table(rows, report["headline"]))
    if not rows:  # every run stopped by a non-finite loss: say so instead of an empty table
        failed = len(report.get("failed_runs") or [])
        print(f"every run diverged ({failed} run{'s' if failed != 1 else ''}, listed under failed_runs in "
              "results.json): try a smaller --lr or --lr-grid")
    print(f"\nwritten: {out / 'results.csv'}, {out / 'results.json'}, {out / 'accuracy_vs_epoch.png'}, "
          f"{out / 'class_histograms.png'}")
