"""The sweep's plots: test accuracy against epochs, one panel per α, and each α's
per-worker class counts. With no run to draw (every run diverged) each figure is one
empty panel that says so, so the files the report names exist and are not stale."""

from __future__ import annotations

from pathlib import Path

__all__ = ["plot_accuracy", "plot_histograms"]


def _empty_figure(plt, path: Path, note: str) -> None:
    """One blank panel carrying ``note`` (why there is nothing to draw)."""
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.axis("off")
    ax.text(0.5, 0.5, note, ha="center", va="center", wrap=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _no_run_note(report: dict | None) -> str:
    failed = len((report or {}).get("failed_runs") or [])
    return f"every run diverged ({failed} stopped by a non-finite loss; results.json lists them): nothing to plot"


def plot_accuracy(rows: list[dict], path: Path, report: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not rows:
        _empty_figure(plt, path, _no_run_note(report))
        return
    alphas = sorted({r["alpha"] for r in rows}, reverse=True)
    fig, axes = plt.subplots(1, len(alphas), figsize=(5 * len(alphas), 4), sharey=True, squeeze=False)
    for ax, alpha in zip(axes[0], alphas):
        for row in (r for r in rows if r["alpha"] == alpha):
            epochs = range(1, len(row["curve_min_worker_accuracy"]) + 1)
            line, = ax.plot(epochs, row.get("curve_mean_worker_accuracy") or row["curve_min_worker_accuracy"],
                            label=f"{row['label']} (lr {row['lr']:g})")
            ax.plot(epochs, row["curve_min_worker_accuracy"], color=line.get_color(), linestyle=":", alpha=0.7)
            ax.plot(epochs, row["curve_averaged_model_accuracy"], color=line.get_color(), linestyle="--",
                    alpha=0.5, linewidth=0.8)
        ax.set_title(f"alpha = {alpha:g}")
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("test accuracy")
    fig.text(0.5, 0.005, "solid: the workers' own models (mean); dotted: worst worker; dashed: the averaged model", ha="center", fontsize=8)
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.suptitle(f"{report['world_size']} workers, {report['settings']['dataset']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_histograms(rows: list[dict], path: Path, report: dict | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    if not rows:
        _empty_figure(plt, path, _no_run_note(report))
        return
    by_alpha = {}
    for row in rows:
        by_alpha.setdefault(row["alpha"], row["class_histogram"])
    alphas = sorted(by_alpha, reverse=True)
    fig, axes = plt.subplots(1, len(alphas), figsize=(5 * len(alphas), 3.5), squeeze=False)
    for ax, alpha in zip(axes[0], alphas):
        counts = np.asarray(by_alpha[alpha])
        bottom = np.zeros(counts.shape[0])
        cmap = plt.get_cmap("tab10")
        for c in range(counts.shape[1]):
            ax.bar(range(counts.shape[0]), counts[:, c], bottom=bottom, color=cmap(c % 10), label=str(c))
            bottom += counts[:, c]
        ax.set_title(f"alpha = {alpha:g}")
        ax.set_xlabel("worker")
        ax.set_xticks(range(counts.shape[0]))
    axes[0][0].set_ylabel("training samples per class")
    axes[0][-1].legend(title="class", fontsize=7, ncol=1, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
