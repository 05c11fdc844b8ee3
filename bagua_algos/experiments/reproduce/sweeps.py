"""The heterogeneity sweep run for the seed 002 and RelaySum experiments: its arguments,
one sweep per seed (reused when its arguments match), and the runs chosen from it."""

from __future__ import annotations

import json
import statistics

import torch

from bagua_algos.experiments.reproduce.published import ALPHAS


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
