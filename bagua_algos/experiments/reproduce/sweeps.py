"""The heterogeneity sweep run for the seed 002 and RelaySum experiments: its arguments,
one sweep per seed (reused when its arguments match), and the runs chosen from it."""

from __future__ import annotations

import json

import torch

from bagua_algos.experiments.reproduce.published import ALPHAS


def spec_of(label: str, specs: dict | None = None) -> str:
    """The sweep's ``--configs`` entry of a row: ``specs[label]`` where given (a row run
    with other arguments than its table row's), else the algorithm table's row."""
    from bagua_algos.algorithms.table import config_by_label
    from bagua_algos.experiments.common import config_spec

    return (specs or {}).get(label) or config_spec(config_by_label(label))


def sweep_extends_itself() -> bool:
    """Whether this package's heterogeneity sweep takes ``--lr-extend`` (it extends a
    row's grid on its own seed's runs). ``reproduce`` brackets on the mean over its seeds
    (:func:`bracket_lr`), so it turns the sweep's own extension off."""
    from bagua_algos.experiments.sweep import cli as hs

    return not hs.build_parser().parse_known_args(["--lr-extend", "0"])[1]


def sweep_argv(ctx, labels: list, workers: int, epochs: int, lr_grid, protocol: list, alphas=ALPHAS,
               specs: dict | None = None) -> list[str]:
    """The heterogeneity sweep's arguments for the table rows ``labels`` (``specs``:
    :func:`spec_of`) at every α of ``alphas`` over ``lr_grid`` under ``protocol`` (the
    sweep's protocol flags, e.g. ``["--protocol", "relaysum"]``): digits and its MLP
    (batch 16) at the proxy scale; CIFAR-10 and VGG-11 (batch 32, on the chosen device)
    at the seed's; ``--workers``, ``--epochs`` and ``--max-steps`` of the command line
    override."""
    base = ["--workers", str(ctx.args.workers or workers), "--epochs", str(ctx.args.epochs or epochs),
            "--alphas", ",".join(f"{a:g}" for a in alphas), "--lr-grid", ",".join(f"{g:g}" for g in lr_grid),
            "--configs", ";".join(spec_of(label, specs) for label in labels), "--no-progress",
            *protocol]
    if sweep_extends_itself():
        base += ["--lr-extend", "0"]
    if ctx.scale == "proxy":
        base += ["--dataset", "digits", "--model", "mlp", "--batch-size", "16"]
    else:
        base += ["--dataset", "cifar10", "--data-dir", ctx.args.data_dir, "--model", "vgg11", "--batch-size", "32",
                 "--device", "cuda" if ctx.device.type == "cuda" else "cpu", "--threads", str(torch.get_num_threads())]
    if ctx.args.max_steps:
        base += ["--max-steps-per-epoch", str(ctx.args.max_steps)]
    return base


def sweep_seeds(ctx, base: list, swept: list, labels, prefix: str, specs: dict | None = None) -> list[dict]:
    """The heterogeneity sweep with arguments ``base`` (the table rows ``swept``), once
    per seed, each into ``--out`` / ``<prefix>_<hash of its arguments>_seed<S>``; a sweep
    already there with the same arguments is reused. Returns every run of the rows in
    ``labels``, each with its ``row`` label and ``seed``."""
    import hashlib

    from bagua_algos.experiments.sweep import cli as hs

    by_spec = {spec_of(label, specs): label for label in swept}
    runs = []
    for seed in ctx.seeds:
        argv = base + ["--seed", str(seed)]
        key = hashlib.sha1(" ".join(argv).encode()).hexdigest()[:10]
        out = ctx.out / f"{prefix}_{key}_seed{seed}"
        if (out / "results.json").is_file():
            print(f"   seed {seed}: reusing the sweep in {out} (the same arguments)")
        else:
            hs.main(argv + ["--out-dir", str(out)] + ctx.sweep_flags())
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


# the default of ``reproduce --lr-extend``: how many times a row's grid may grow
LR_EXTEND = 3


def lr_extend(ctx) -> int:
    """``--lr-extend`` of the command line (its default where a caller's arguments lack it)."""
    return getattr(ctx.args, "lr_extend", LR_EXTEND)


def bracket_lr(grid, evaluate, extend: int = LR_EXTEND) -> tuple[float, dict, bool]:
    """Tune a rate over ``grid`` so that the best is bracketed by worse rates.

    ``evaluate(rates)`` trains the given rates and returns ``{rate: score}`` (higher is
    better; a rate that diverged must score below every rate that trained, e.g. -inf or
    the caller's floor). While the best rate is the smallest of the grid the grid gains
    half of it, while it is the largest the grid gains its double (a one-rate grid gains
    both), each new rate trained, at most ``extend`` times. A peak inside the grid ends
    the search at once: the peak of a unimodal score that lies k halvings (doublings)
    beyond the grid's edge is found, bracketed, after k + 1 extensions. Ties go to the smaller
    rate (the safer one). Returns (best rate, every rate's score, whether the best is
    still an edge of the grid it ended with: the optimum may lie beyond it)."""
    grid = sorted({float(g) for g in grid})
    if not grid:
        raise ValueError("bracket_lr: grid is empty; give at least one learning rate")
    if not (isinstance(extend, int) and extend >= 0):
        raise ValueError(f"bracket_lr: extend must be an integer >= 0, got {extend!r}")
    scores = dict(evaluate(grid))
    extensions = 0
    while True:
        rates = sorted(scores)
        best = max(rates, key=lambda r: scores[r])  # the first (smallest) of equal scores
        low, high = best == rates[0], best == rates[-1]
        if not (low or high) or extensions == extend:
            return best, scores, low or high
        new = ([rates[0] / 2] if low else []) + ([rates[-1] * 2] if high else [])
        scores.update(evaluate(new))
        extensions += 1
