"""The plugin's one-peer gossip against Decent-DP's, step time over gloo.

Decent-DP (``decent-dp`` on PyPI, Wang et al., ICLR 2025: "From Promise to Practice:
Realizing High-performance Decentralized Training") wraps a model in
``DecentralizedDataParallel``: the optimizer steps bucket by bucket in a hook after the
bucket's last gradient, and the bucket's gossip (an allreduce within a 2-rank group,
each rank keeping half) is launched asynchronously and waited for only when the same
bucket is next updated, so it overlaps the next forward and backward. Its topologies
here: ``ring`` (pairs (2i, 2i+1), then (2i, 2i−1), alternating) and ``one-peer-exp``
(at exchange t, pairs i and i + 2^(t mod log2 n)).

The plugin's side:

- ``shift_one``: ``decentralized:hierarchical=False,peer_selection_mode=shift_one``
  (Bagua's D-PSGD: the weights taken at forward are averaged with one peer, the
  pairing shifting each exchange, on the communication thread while forward and
  backward run; the result is copied back before the optimizer step);
- ``sgp``: ``sgp`` (Stochastic Gradient Push on the one-peer exponential graph: the
  gossip after the optimizer step, not overlapped).

(The plugin's ``decentralized`` gossips with one fixed matrix: over the time-varying
one-peer exponential graph it runs only with ``quasi_global_momentum``, a different
algorithm; SGP is the plugin's one-peer exponential gossip.) Compared pairwise as
ratios of step time, ours / Decent-DP's: shift_one / ring, shift_one / one-peer-exp
(both one peer a step, overlapped with compute), sgp / one-peer-exp (the same graph).

Every worker trains the synthetic benchmark's MLP (``--mlp-hidden``, ``--mlp-layers``;
3·32·32 inputs, 10 classes) on one fixed random batch with SGD (lr 0.01, momentum 0.9),
one torch thread a worker. One job per (workers, link); in it every config in turn, a
fresh model each time (same seed), ``--warmup`` untimed steps (Decent-DP builds its
buckets at its second step), then ``--steps`` steps between two barriers (the slowest
rank's time; Decent-DP's last gossip is waited for before the closing barrier), over
``--rounds`` rounds in alternating order (reversed every other round). Reported: the
median over rounds of each config's ms a step, of its CPU ms (all workers' summed),
and of the ratio within each round (paired: the load moves between rounds).

Links (``--links``): ``loopback`` (all workers on one host, gloo over 127.0.0.1) and tc
rates such as ``1gbit``: one emulated node a worker (network namespaces joined by a
bridge, every link limited by a token bucket both ways:
:mod:`bagua_algos.experiments.netem`; needs root; everything it creates is removed).

Decent-DP is not a dependency: ``pip install decent-dp`` (0.2.3 was measured; it needs
``loguru``). Without it the command says so and exits with 2.

    python benchmarks/decentdp_compare.py --workers 4,8 --links loopback,1gbit --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["main", "OURS", "DECENT_DP", "PAIRS", "DECENT_DP_HOWTO"]

MODULE = "bagua_algos.experiments.decentdp_compare"
OURS = {
    "shift_one": "decentralized:hierarchical=False,peer_selection_mode=shift_one",
    "sgp": "sgp",
}
DECENT_DP = {"ring": "ring", "one-peer-exp": "one-peer-exp"}
PAIRS = (("shift_one", "ring"), ("shift_one", "one-peer-exp"), ("sgp", "one-peer-exp"))
DECENT_DP_HOWTO = ("Decent-DP (the decent_dp package) is not importable: pip install decent-dp "
                   "(0.2.3 measured; it pulls loguru)")


# ------------------------------------------------------------------------------ command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="decentdp_compare", description=__doc__.split("\n")[0])
    p.add_argument("--workers", default="4,8", help="','-separated world sizes (powers of 2; default 4,8)")
    p.add_argument("--links", default="loopback,1gbit",
                   help="','-separated: loopback, or a tc rate (one emulated node a worker; needs root)")
    p.add_argument("--configs", default=",".join([*OURS, *DECENT_DP]),
                   help=f"','-separated, of {', '.join([*OURS, *DECENT_DP])} (default all)")
    p.add_argument("--mlp-hidden", type=int, default=1024, help="the MLP's width (default 1024: 5.26 M parameters)")
    p.add_argument("--mlp-layers", type=int, default=3, help="the MLP's hidden layers (default 3)")
    p.add_argument("--batch-size", type=int, default=32, help="a worker's batch (default 32)")
    p.add_argument("--steps", type=int, default=20, help="timed steps a block (default 20)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps before each block (default 5, at least 2)")
    p.add_argument("--rounds", type=int, default=5, help="rounds of every config (default 5)")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds a job may take (default 1200)")
    p.add_argument("--out", default=None, help="write every job's report here (JSON)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return p


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.worker_list = [int(w) for w in args.workers.split(",") if w]
    except ValueError:
        parser.error(f"argument --workers: expected ','-separated integers, got {args.workers!r}")
    if not args.worker_list or any(w < 2 or w & (w - 1) for w in args.worker_list):
        parser.error(f"argument --workers: expected powers of 2 >= 2 (Decent-DP's one-peer-exp), got {args.workers!r}")
    args.link_list = [link.strip().lower() for link in args.links.split(",") if link.strip()]
    if not args.link_list:
        parser.error("argument --links: give loopback or a rate such as 1gbit")
    from bagua_algos.experiments.netem import check_rate

    for link in args.link_list:
        if link != "loopback":
            try:
                check_rate(link)
            except ValueError as err:
                parser.error(f"argument --links: {err}")
    args.config_list = [c for c in args.configs.split(",") if c]
    bad = [c for c in args.config_list if c not in OURS and c not in DECENT_DP]
    if bad or not args.config_list:
        parser.error(f"argument --configs: expected some of {', '.join([*OURS, *DECENT_DP])}, got {args.configs!r}")
    for name in ("mlp_hidden", "mlp_layers", "batch_size", "steps", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"argument --{name.replace('_', '-')}: expected an integer >= 1")
    if args.warmup < 2:
        parser.error("argument --warmup: expected at least 2 (Decent-DP builds its buckets at its second step)")
    return args


def _worker_argv(args) -> list:
    return ["--configs", ",".join(args.config_list), "--mlp-hidden", str(args.mlp_hidden),
            "--mlp-layers", str(args.mlp_layers), "--batch-size", str(args.batch_size), "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--rounds", str(args.rounds)]


# ------------------------------------------------------------------------------ a worker


def _model(args):
    import torch

    from bagua_algos.experiments.synthetic_benchmark import build_model

    torch.manual_seed(42)
    return build_model("mlp", 10, args.mlp_hidden, args.mlp_layers)


def _ours(name: str, args):
    """(model to call, step function, finaliser) for the plugin's config ``name``."""
    import torch

    from bagua_algos.experiments.common import parse_configs

    config = parse_configs(OURS[name])[0]
    model = _model(args)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model.with_bagua([optimizer], config.build_algorithm(), **config.wrap_kwargs)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step(x, y):
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        return loss

    return step, lambda: None, lambda: model.bagua_ddp.detach()


def _decent_dp(name: str, args):
    """(step function, wait for the gossip in flight, finaliser) for Decent-DP's topology ``name``."""
    import torch
    from decent_dp.ddp import DecentralizedDataParallel
    from loguru import logger

    logger.remove()  # Decent-DP's debug lines at every wrap
    logger.add(sys.stderr, level="WARNING")

    model = _model(args)
    ddp = DecentralizedDataParallel(
        model, lambda named: torch.optim.SGD([p for _, p in named], lr=0.01, momentum=0.9), topology=DECENT_DP[name])
    loss_fn = torch.nn.CrossEntropyLoss()

    def step(x, y):  # the optimizer steps in Decent-DP's hooks during backward
        loss = loss_fn(ddp(x), y)
        loss.backward()
        return loss

    def drain():
        for op in ddp._comm_ops:  # the gossip launched by the last step (the next would wait for it)
            if op is not None:
                op.wait()

    return step, drain, drain


def time_block(name: str, args, x, y) -> dict:
    """One block of ``name``: the slowest rank's seconds, all ranks' CPU seconds."""
    import torch

    import bagua_algos
    from bagua_algos.runtime import comm

    step, drain, finish = (_ours if name in OURS else _decent_dp)(name, args)
    for _ in range(args.warmup):
        step(x, y)
    drain()
    bagua_algos.barrier()
    start, cpu_start = time.perf_counter(), time.process_time()
    for _ in range(args.steps):
        loss = step(x, y)
    drain()
    cpu = time.process_time() - cpu_start
    bagua_algos.barrier()
    elapsed = time.perf_counter() - start
    finish()
    totals = torch.tensor([elapsed, cpu], dtype=torch.float64)
    slowest, cpu_sum = totals[:1].clone(), totals[1:].clone()
    comm.allreduce_inplace(slowest, comm.ReduceOp.MAX)
    comm.allreduce_inplace(cpu_sum, comm.ReduceOp.SUM)
    return {"s": slowest.item(), "cpu_s": cpu_sum.item(), "loss": loss.item()}


def run_worker(args) -> int:
    import torch

    import bagua_algos
    from bagua_algos.experiments.common import init_for_device
    from bagua_algos.experiments.synthetic_benchmark import IMAGE_SHAPE

    torch.set_num_threads(1)
    init_for_device("cpu")
    try:
        rank = bagua_algos.get_rank()
        g = torch.Generator().manual_seed(43 + rank)
        x = torch.randn(args.batch_size, *IMAGE_SHAPE, generator=g)
        y = torch.randint(0, 10, (args.batch_size,), generator=g)
        blocks = {name: [] for name in args.config_list}
        for r in range(args.rounds):
            for name in (args.config_list if r % 2 == 0 else args.config_list[::-1]):
                block = time_block(name, args, x, y)
                blocks[name].append(block)
                if rank == 0:
                    print(f"decentdp_compare: round {r + 1}/{args.rounds} {name}: "
                          f"{1000 * block['s'] / args.steps:.1f} ms/step, CPU {1000 * block['cpu_s'] / args.steps:.1f}"
                          f" ms/step, loss {block['loss']:.4f}", flush=True)
        if rank == 0 and args.result:
            Path(args.result).write_text(json.dumps({"blocks": blocks, "world_size": bagua_algos.get_world_size()}))
        bagua_algos.barrier()
    finally:
        bagua_algos.destroy_process_group()
    return 0


# ------------------------------------------------------------------------------ the jobs


def run_job(args, workers: int, link: str) -> dict:
    """One job of ``workers`` workers over ``link``; rank 0's record."""
    from bagua_algos.experiments.common import free_port

    result = Path(tempfile.mkdtemp(prefix="decentdp_compare_")) / "job.json"
    script = ["-m", MODULE, "--worker", "--result", str(result), *_worker_argv(args)]
    env_before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        if link == "loopback":
            command = [sys.executable, "-m", "bagua_algos.launch", "--nproc_per_node", str(workers),
                       "--master_addr", "127.0.0.1", "--master_port", str(free_port()), *script]
            subprocess.run(command, check=True, timeout=args.timeout)
        else:
            from bagua_algos.experiments.netem import EmulatedNetwork

            with EmulatedNetwork(workers, link) as net:
                net.run_job(script, 1, args.timeout, free_port())
    finally:
        if env_before is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env_before
    record = json.loads(result.read_text())
    record.update({"workers": workers, "link": link, "load_after": os.getloadavg()[0]})
    return record


def summarize(record: dict, steps: int) -> dict:
    """Per config: median ms a step [min, max] and CPU ms; per pair: the paired ratio
    (median over rounds of ours / Decent-DP's within the round) and its range."""
    blocks = record["blocks"]
    rows = {}
    for name, runs in blocks.items():
        ms = [1000 * b["s"] / steps for b in runs]
        cpu = [1000 * b["cpu_s"] / steps for b in runs]
        rows[name] = {"ms": statistics.median(ms), "ms_min": min(ms), "ms_max": max(ms),
                      "cpu_ms": statistics.median(cpu)}
    pairs = {}
    for ours, theirs in PAIRS:
        if ours in blocks and theirs in blocks:
            ratios = [a["s"] / b["s"] for a, b in zip(blocks[ours], blocks[theirs])]
            cpu = [a["cpu_s"] / b["cpu_s"] for a, b in zip(blocks[ours], blocks[theirs])]
            pairs[f"{ours} / {theirs}"] = {"ratio": statistics.median(ratios), "min": min(ratios),
                                           "max": max(ratios), "cpu_ratio": statistics.median(cpu)}
    return {"rows": rows, "pairs": pairs}


def report(records: list, steps: int) -> None:
    for record in records:
        summary = summarize(record, steps)
        record["summary"] = summary
        print(f"\n{record['workers']} workers, {record['link']} (load average after: {record['load_after']:.1f})")
        for name, row in summary["rows"].items():
            side = "ours" if name in OURS else "Decent-DP"
            print(f"  {side:<9} {name:<13} {row['ms']:8.1f} ms/step [{row['ms_min']:.1f}, {row['ms_max']:.1f}]"
                  f"  CPU {row['cpu_ms']:8.1f} ms/step (all workers)")
        for pair, ratio in summary["pairs"].items():
            print(f"  {pair:<28} step time {ratio['ratio']:.3f} [{ratio['min']:.3f}, {ratio['max']:.3f}] "
                  f"(paired, median over rounds)  CPU {ratio['cpu_ratio']:.3f}")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.worker:
        return run_worker(args)
    if any(c in DECENT_DP for c in args.config_list):
        try:
            import decent_dp.ddp  # noqa: F401
        except ImportError as err:
            print(f"decentdp_compare: {DECENT_DP_HOWTO} ({err})", file=sys.stderr)
            return 2
    if any(link != "loopback" for link in args.link_list):
        from bagua_algos.experiments.netem import check_support

        reason = check_support()
        if reason:
            print(f"decentdp_compare: {reason} (or pass --links loopback)", file=sys.stderr)
            return 2
    import torch

    print(f"decentdp_compare: workers {args.worker_list}, links {args.link_list}, configs {args.config_list}; MLP "
          f"{args.mlp_layers} x {args.mlp_hidden}, batch {args.batch_size}, {args.warmup} + {args.steps} steps, "
          f"{args.rounds} rounds; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, torch "
          f"{torch.__version__}", flush=True)
    records = []
    for workers in args.worker_list:
        for link in args.link_list:
            print(f"decentdp_compare: {workers} workers over {link} ...", flush=True)
            try:
                records.append(run_job(args, workers, link))
            except Exception as err:  # noqa: BLE001 - one failed job is reported, the others still run
                print(f"decentdp_compare: {workers} workers over {link} failed: {err}", flush=True)
                records.append({"workers": workers, "link": link, "error": str(err)})
    report([r for r in records if "error" not in r], args.steps)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(records, indent=2) + "\n")
        print(f"decentdp_compare: wrote {args.out}")
    return 0 if all("error" not in r for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
