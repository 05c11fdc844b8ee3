"""Throughput against link bandwidth: the synthetic benchmark over emulated networks.

For each rate, N emulated nodes (network namespaces joined by tbf-limited veth links,
see :mod:`bagua_algos.experiments.netem`) run one job of ``synthetic_benchmark.py --configs ...``:
every config timed in the same job, interleaved over rounds, so the ratios to the
first config (the baseline) are measured side by side. Needs root::

    python benchmarks/network_sweep.py --nodes 4 --rates 100mbit,1gbit,10gbit \\
        --model mlp --configs "gradient_allreduce;allreduce_average;relay:topology=chain"

Writes ``OUT/results.json`` (every job's full report), ``OUT/results.csv`` (one row per
rate × config) and ``OUT/throughput_vs_bandwidth.png`` (images/s against the link
rate, one line per config), and prints a table of images/s and ratios per rate.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path


from bagua_algos.experiments.common import ConfigError, free_port, parse_configs
from bagua_algos.experiments.netem import EmulatedNetwork, NetemError, rate_bits, check_rate, check_support

# the synthetic benchmark, run by the launcher as a module (python -m) in every node
SYNTHETIC = ["-m", "bagua_algos.experiments.synthetic_benchmark"]
DEFAULT_CONFIGS = ("gradient_allreduce;allreduce_average;decentralized:hierarchical=false;"
                   "relay:topology=chain;relay:topology=binary_tree;relay:topology=double_binary_tree")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=4, help="emulated nodes (default 4)")
    parser.add_argument("--nproc-per-node", type=int, default=1, help="workers per node (default 1)")
    parser.add_argument("--rates", default="100mbit,1gbit,10gbit", help="','-separated link rates (tc syntax)")
    parser.add_argument("--configs", default=DEFAULT_CONFIGS, help="synthetic_benchmark's --configs; first = baseline")
    parser.add_argument("--model", default="mlp", help="synthetic_benchmark's --model (default mlp)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per rate before the job is stopped")
    parser.add_argument("--out-dir", type=Path, default=Path("results/network"))
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.rate_list = [check_rate(r.strip()) for r in args.rates.split(",") if r.strip()]
    except ValueError as error:
        parser.error(f"argument --rates: {error}")
    if not args.rate_list:
        parser.error("argument --rates: give at least one rate, e.g. 1gbit")
    try:
        parse_configs(args.configs)
    except ConfigError as error:
        parser.error(f"argument --configs: {error}")
    for flag in ("nodes", "nproc_per_node", "batch_size", "steps", "rounds"):
        if getattr(args, flag) < 1:
            parser.error(f"argument --{flag.replace('_', '-')}: must be >= 1, got {getattr(args, flag)}")
    return args


def run_rate(args, rate: str) -> dict:
    out = args.out_dir / f"rate_{rate}.json"
    script = [*SYNTHETIC, "--model", args.model, "--batch-size", str(args.batch_size),
              "--steps", str(args.steps), "--warmup", str(args.warmup), "--rounds", str(args.rounds),
              "--configs", args.configs, "--out", str(out.resolve())]
    with EmulatedNetwork(args.nodes, rate) as net:
        net.run_job(script, args.nproc_per_node, args.timeout, free_port(), args.out_dir / f"logs_{rate}")
    return json.loads(out.read_text())


def table(reports: dict) -> str:
    lines = []
    for rate, report in reports.items():
        lines.append(f"{rate}: baseline {report['baseline']}")
        for row in report["results"]:
            sent = row.get("bytes_per_step")
            sent_text = f", {sent / 1e6:8.3f} MB sent/worker/step" if sent is not None else ""
            lines.append(f"  {row['config']:<40} {row['images_per_s']:9.1f} images/s  "
                         f"ratio {row['images_per_s_ratio']:.3f}{sent_text}")
    return "\n".join(lines)


def write_outputs(args, reports: dict) -> None:
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "results.json").write_text(json.dumps(reports, indent=2) + "\n")
    with open(args.out_dir / "results.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["rate", "config", "images_per_s", "images_per_s_ratio", "ms_per_step", "bytes_per_step"])
        for rate, report in reports.items():
            for row in report["results"]:
                writer.writerow([rate, row["config"], row["images_per_s"], row["images_per_s_ratio"],
                                 row["ms_per_step"], row.get("bytes_per_step")])
    plot_throughput(reports, f"{args.model}, {args.nodes} nodes × {args.nproc_per_node} worker(s), emulated links",
                    args.out_dir / "throughput_vs_bandwidth.png")


def plot_throughput(reports: dict, title: str, path: Path) -> None:
    """images/s against the link rate, one line per config, on log-log axes (the
    configs span two orders of magnitude at the slowest rate); every line has its own
    colour, marker and dash, so twelve configs stay apart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    rates = list(reports)
    configs = [row["config"] for row in reports[rates[0]]["results"]]
    colours = plt.get_cmap("tab20").colors
    markers, dashes = "osD^vP*Xh<>p", ["-", "--", "-.", ":"]
    for index, config in enumerate(configs):
        ys = [next(r["images_per_s"] for r in reports[rate]["results"] if r["config"] == config) for rate in rates]
        ax.plot([rate_bits(rate) / 1e6 for rate in rates], ys, label=config, color=colours[(2 * index) % 20 + (index >= 10)],
                marker=markers[index % len(markers)], linestyle=dashes[index % len(dashes)])
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("link rate per direction (Mbit/s)")
    ax.set_ylabel("images/s (all workers)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    reason = check_support()
    if reason:
        print(f"network_sweep: {reason}", file=sys.stderr)
        return 2
    args.out_dir.mkdir(parents=True, exist_ok=True)
    reports = {}
    try:
        for rate in args.rate_list:
            print(f"network_sweep: {rate} ...", file=sys.stderr, flush=True)
            reports[rate] = run_rate(args, rate)
    except NetemError as error:
        print(f"network_sweep: {error}", file=sys.stderr)
        if not reports:
            return 1
    write_outputs(args, reports)
    print(table(reports))
    print(f"network_sweep: wrote {args.out_dir}/results.{{json,csv}} and throughput_vs_bandwidth.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
