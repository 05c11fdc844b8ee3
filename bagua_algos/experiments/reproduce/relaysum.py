"""The RelaySum paper (Vogels et al. 2021), Table 2, from the heterogeneity sweep."""

from __future__ import annotations

import textwrap

from bagua_algos.experiments import reproduce_train as rt
from bagua_algos.experiments.reproduce.output import pct, plot_alpha, print_table
from bagua_algos.experiments.reproduce.published import ALPHAS, RELAYSUM_TABLE2
from bagua_algos.experiments.reproduce.sweeps import sweep_argv, sweep_seeds, tuned_over_seeds


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
