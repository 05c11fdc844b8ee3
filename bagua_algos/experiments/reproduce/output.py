"""The printed tables and the plots every experiment shares."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path


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
