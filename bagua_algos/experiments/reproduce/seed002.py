"""Seed 002, the RelaySGD thesis: Figures 5.1-5.3 and Tables A.1-A.3, from the
heterogeneity sweep."""

from __future__ import annotations

import math
import statistics

from bagua_algos.experiments import reproduce_train as rt
from bagua_algos.experiments.reproduce.output import pct, plot_curves, print_table
from bagua_algos.experiments.reproduce.published import ALPHAS, LR_GRID, THESIS_A
from bagua_algos.experiments.reproduce.sweeps import bracket_lr, best_over_grid, lr_extend, sweep_argv, sweep_seeds


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
    base = sweep_argv(ctx, swept, 8, seed002_epochs(ctx), lr_grid, SEED002_PROTOCOL)
    seed_text = ("CIFAR-10, VGG-11, 8 GPUs x 32, lr tuned over {0.01, 0.025, 0.05, 0.075, 0.1} on 50 epochs "
                 "(Tables A.1-A.3 are those 50-epoch runs; the figures train 200 epochs at the chosen rates)")
    ctx.header(seed_text, f"heterogeneity_sweep {' '.join(base)} --seed S for S in {ctx.seeds}",
               "proxy: scikit-learn's digits (1437 training images) and a 2-layer MLP, batch 16, 30 epochs for "
               "both the grid and the figures, no augmentation, instead of CIFAR-10/VGG-11/50 and 200 epochs; "
               "D-PSGD is Bagua's 'all' mode without hierarchy (the thesis's 'fully connected'); the thesis "
               "names no optimizer or schedule: the RelaySum paper's protocol, whose setting it copies, with the "
               "workers' mean accuracy reported")
    return sweep_seeds(ctx, base, swept, labels, "seed002_sweep")


def seed002_epochs(ctx) -> int:
    """30 at the proxy scale; the thesis's 50 (Tables A) or 200 (the figures) at the seed's."""
    if ctx.scale == "proxy":
        return 30
    return 50 if ctx.experiment.name == "seed002-tableA" else 200


def bracketed(ctx, runs, label, alpha) -> tuple[list, bool]:
    """The runs of (row, α) over the thesis's grid, extended (:func:`bracket_lr`) while
    the best rate on the mean over the seeds of the workers' mean accuracy (a diverged run
    0) is an edge of the rates tried; every rate added is swept for this row and α alone.
    Returns (the runs of every rate tried, whether the best is still at an edge)."""
    mine = [r for r in runs if r["row"] == label and r["alpha"] == alpha]

    def evaluate(rates):
        missing = [g for g in rates if not any(math.isclose(r["lr"], g) for r in mine)]
        if missing:
            base = sweep_argv(ctx, [label], 8, seed002_epochs(ctx), missing, SEED002_PROTOCOL, (alpha,))
            mine.extend(sweep_seeds(ctx, base, [label], [label], f"seed002_extend_{label}"))
        return {g: statistics.mean(r["final_mean_worker_accuracy"] for r in mine if math.isclose(r["lr"], g))
                for g in rates}

    _, _, edge = bracket_lr(LR_GRID, evaluate, lr_extend(ctx))
    return mine, edge


def seed002_figure(ctx, labels, title):
    runs = sweep(ctx, labels)
    rows, table = [], []
    series = {}
    for alpha in ALPHAS:
        for label in labels:
            tried, edge = bracketed(ctx, runs, label, alpha)
            best = best_over_grid(tried, label, alpha)
            mean, low, high = rt.spread([r["final_mean_worker_accuracy"] for r in best])
            seed_acc, seed_lr = thesis_best(label, alpha)
            lrs = sorted({r["lr"] for r in best})
            rows.append({"protocol": " ".join(SEED002_PROTOCOL), "row": label, "alpha": alpha,
                         "seed_best_acc_50_epochs": seed_acc, "seed_lr": seed_lr,
                         "ours_mean": mean, "ours_min": low, "ours_max": high, "ours_lrs": lrs, "lr_at_edge": edge,
                         "lrs_tried": sorted({r["lr"] for r in tried}),
                         "ours_worst_worker_mean": rt.spread([r["final_min_worker_accuracy"] for r in best])[0],
                         "ours_averaged_model_mean": rt.spread([r["final_averaged_model_accuracy"] for r in best])[0]})
            table.append([f"{alpha:g}", label, f"{100 * seed_acc:.2f}% (lr {seed_lr:g})", pct(mean, low, high),
                          f"{100 * rows[-1]['ours_worst_worker_mean']:.1f}%",
                          f"{100 * rows[-1]['ours_averaged_model_mean']:.1f}%",
                          ",".join(f"{g:g}" for g in lrs) + (" (at edge)" if edge else "")])
            # one panel per alpha, as the thesis draws them: per row, each seed's best run
            for i, r in enumerate(sorted(best, key=lambda r: r["seed"])):
                per_seed = series.setdefault(label, [])
                if len(per_seed) <= i:
                    per_seed.append({})
                per_seed[i][f"alpha={alpha:g}"] = r.get("curve_mean_worker_accuracy") or r["curve_min_worker_accuracy"]
    print()
    print_table(["alpha", "row", "seed: best of grid (50 ep.)", "ours: workers' models (mean), best lr",
                 "ours: worst worker", "ours: averaged model", "ours: lr chosen"], table)
    print("   the grid extended by halving / doubling while the best rate (the mean over the seeds) was at its edge, "
          "at most --lr-extend times; (at edge): still there after them; each seed's best rate of those tried")
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
