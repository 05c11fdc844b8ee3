"""The comparison most experiments run: every row trained on a setting for every seed
(its learning rate tuned where the row asks), the seed's numbers beside ours."""

from __future__ import annotations

import math
import statistics

import torch

from bagua_algos.experiments import reproduce_train as rt
from bagua_algos.experiments.reproduce.context import Context, check_memory
from bagua_algos.experiments.reproduce.output import pct, plot_curves, print_table
from bagua_algos.experiments.reproduce.rows import Row, build_config
from bagua_algos.experiments.reproduce.settings import POWERSGD_DIFFERS, POWERSGD_SEED_TEXT
from bagua_algos.experiments.reproduce.sweeps import bracket_lr, lr_extend


QUANTITY_TITLE = {"workers_mean": "workers' test acc (mean over workers)",
                  "worst_worker_tail": "the worst worker's test acc (tail mean)",
                  "averaged_model": "the averaged model's test acc"}


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
    configs = _configs(rows, model)
    runs, lrs, at_edge = _train_rows(ctx, setting, data, configs)
    sent = {}
    if data_column and runs:
        sent = rt.bytes_per_step([c for _, c in configs if c is not None], setting.model, data.image_shape,
                                 data.num_classes)
    steps = rt.steps_per_epoch(setting, len(data.train_y))
    # the reference of the ratios: the first row that ran (the seed's first row, when the package has it)
    base = next((config.label for _, config in configs if config is not None), None)
    columns = dict(seed_columns=seed_columns, data_column=data_column, time_column=time_column, lr_label=lr_label)
    out_rows, table = [], []
    for row, config in configs:
        record, cells = _result_row(row, config, setting, runs, lrs, at_edge, sent=sent, base=base, steps=steps,
                                    seeds=len(ctx.seeds), **columns)
        out_rows.append(record)
        table.append(cells)
    print()
    print_table(_column_titles(setting, base, **columns), table)
    print(f"\n   wrote {ctx.write_csv(out_rows)}")
    if curves:
        _plot(ctx, setting, runs, curves)
    ctx.runs = runs
    return out_rows


def _configs(rows: list[Row], model) -> list[tuple]:
    """(row, its algorithm's configuration) for every row; None, with the reason
    printed, where the package cannot build the row yet."""
    configs = []
    for row in rows:
        config, why = build_config(row, model)
        if config is None:
            print(f"   {row.label}: {why}; skipped")
        configs.append((row, config))
    return configs


def _train_rows(ctx: Context, setting, data, configs: list[tuple]) -> tuple[dict, dict, dict]:
    """Train every buildable row for every seed, at the setting's rate or at the one
    :func:`tune_row` picks where the row has a grid (a row with its own momentum trains
    under the setting's protocol with that momentum). Returns (the runs of each row's
    label, its rate, whether that rate is still at its grid's edge)."""
    runs: dict[str, list] = {}
    lrs: dict[str, float] = {}
    at_edge: dict[str, bool] = {}
    for row, config in configs:
        if config is None:
            continue
        row_setting = setting if row.optimizer_momentum is None else setting.with_(
            protocol=setting.protocol.with_(momentum=row.optimizer_momentum, nesterov=row.optimizer_momentum > 0
                                            and setting.protocol.nesterov))
        lr = row_setting.lr
        trials: dict = {}
        if row.lr_grid:
            lr, at_edge[row.label] = tune_row(ctx, row, row_setting, data, config, trials)
        lrs[row.label] = lr
        runs[row.label] = []
        for k, seed in enumerate(ctx.seeds):
            run = trials[lr][k] if trials else rt.train(row_setting, data, config, seed, lr, ctx.device)
            runs[row.label].append(run)
            accuracy = "diverged" if run.diverged else f"{100 * run.headline(row_setting.protocol):.1f}%"
            print(f"   {row.label} seed {seed}: {accuracy} "
                  f"({run.seconds:.0f} s{', ' + run.diverged if run.diverged else ''})", flush=True)
    return runs, lrs, at_edge


def _result_row(row: Row, config, setting, runs: dict, lrs: dict, at_edge: dict, *, sent: dict, base, steps: int,
                seeds: int, seed_columns: list[str], data_column: bool, time_column: bool,
                lr_label: bool) -> tuple[dict, list]:
    """One row's CSV record and table cells: the seed's columns, then ours (accuracy
    mean [min, max] over seeds; the worst worker's and the averaged model's; the rate;
    MiB per epoch with the compression against ``base``; the time per batch as a ratio
    to ``base``'s, seed by seed)."""
    record = {"method": row.label, **{f"seed {c}": row.seed.get(c, "") for c in seed_columns}}
    cells = [row.label] + [row.seed.get(c, "") for c in seed_columns]
    if config is None:
        return {**record, "ours": "not yet in the package"}, cells + ["not yet in the package"]
    mean, low, high = rt.spread([r.headline(setting.protocol) for r in runs[row.label]])
    worst = rt.spread([r.final_worst_worker_accuracy for r in runs[row.label]])[0]
    averaged = rt.spread([r.final_averaged_accuracy for r in runs[row.label]])[0]
    record.update({"quantity": setting.protocol.quantity, "protocol": setting.protocol.describe(setting.epochs),
                   "workers_accuracy_worst": worst, "averaged_model_accuracy": averaged})
    record.update({"test_accuracy_mean": mean, "test_accuracy_min": low, "test_accuracy_max": high,
                   "lr": lrs[row.label], "lr_at_edge": at_edge.get(row.label, ""), "seeds": seeds})
    cells.append(pct(mean, low, high))
    # the worst worker's and the averaged model's (mean over seeds): equal to the
    # headline for an algorithm that keeps every worker's model equal
    cells.append("same" if math.isclose(worst, mean, abs_tol=1e-9) and math.isclose(averaged, mean, abs_tol=1e-9)
                 else f"{100 * worst:.1f}% | {100 * averaged:.1f}%")
    if lr_label:
        cells.append(f"{lrs[row.label]:g}" + (" (at edge)" if at_edge.get(row.label) else ""))
    elif at_edge.get(row.label):
        cells[0] += f" (lr {lrs[row.label]:g} at edge)"
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
    return record, cells


def _column_titles(setting, base, *, seed_columns: list[str], data_column: bool, time_column: bool,
                   lr_label: bool) -> list[str]:
    """The table's column titles, in :func:`_result_row`'s order of cells."""
    columns = ["method"] + [f"seed: {c}" for c in seed_columns] + [
        f"ours: {QUANTITY_TITLE[setting.protocol.quantity]} (mean [min, max] over seeds)",
        "worst worker | averaged model"]
    if lr_label:
        columns.append("ours: lr")
    if data_column:
        columns.append("ours: data/epoch")
    if time_column:
        columns.append(f"ours: time/batch (x {base})")
    return columns


def _plot(ctx: Context, setting, runs: dict, curves: str) -> None:
    """Every row's test accuracy (``curves="accuracy"``) or training loss (``"loss"``)
    per epoch to ``<name>.png`` (the mean over seeds, with the min-max band)."""
    key, label = {"accuracy": ("test_accuracy", "test accuracy (the workers' models, mean)"),
                  "loss": ("train_loss", "training loss")}[curves]
    plot_curves(ctx.path(".png"), {k: [getattr(r, key) for r in v] for k, v in runs.items()}, label,
                f"{ctx.experiment.source}, {ctx.scale} scale: {setting.describe()}")
    print(f"   wrote {ctx.path('.png')}")


def tune_row(ctx: Context, row: Row, setting, data, config, trials: dict) -> tuple[float, bool]:
    """The row's rate tuned apart, as the seed tuned these rows, on the mean final
    accuracy over every seed (a diverged run counts -1, below any accuracy): a rate one
    seed survives and another does not (Random Block, Random K near their stability
    limit) is not chosen. The grid is extended where its best is at an edge
    (:func:`~sweeps.bracket_lr`, at most ``--lr-extend`` rates); ``trials`` gets every
    rate's runs. Returns (the rate, whether it is still at the grid's edge)."""
    def evaluate(rates):
        for g in rates:
            trials[g] = [rt.train(setting, data, config, seed, g, ctx.device) for seed in ctx.seeds]
        return {g: statistics.mean(-1 if r.diverged else r.headline(setting.protocol) for r in trials[g])
                for g in rates}

    lr, scores, edge = bracket_lr(row.lr_grid, evaluate, lr_extend(ctx))
    print(f"   {row.label}: lr tuned over {sorted(scores)} (given {list(row.lr_grid)}) on {len(ctx.seeds)} seeds "
          f"-> {lr:g}{' (at edge)' if edge else ''}")
    return lr, edge
