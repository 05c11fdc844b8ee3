"""Relay on the one-process engine, this tree against others, measured in one run.

    python benchmarks/relay_engine_compare.py --tree a5e8a79=/tmp/relay_a5e8a79

Each tree is a checkout of the repository (``git worktree add /tmp/relay_a5e8a79
a5e8a79``); the first, ``now``, is the checkout this module lives in. For every
repetition, each tree runs in a subprocess of its own with ``PYTHONPATH`` set to that
tree (the trees' order reversed every other repetition, so that a drift of the machine's
load falls on both alike), and the subprocess times relay on the engine for each
topology: ``--workers`` (64) workers of the engine benchmark's MLP (64-128-128-10, batch
16 a worker, SGD with momentum), ``--warmup`` untimed steps (enough for a chain of 64's
counts to reach their fixed point, as in any longer run), then ``--blocks`` blocks of
``--steps`` steps. What is timed is the engine's hooks (the algorithm's whole
communication step) and, of them, the one after the optimizer step (relay's round), on
this process's CPU clock (``time.process_time``, one torch thread, as ``engine_benchmark
comm``), so that other load on a shared machine enters less (it still shares the caches
and the memory bus); a subprocess reports the median block's milliseconds per step of
each. The torch passes only (no compiled ones), in every tree.

A tree's engine is driven through what it has: the ``StackedRuntime``'s ``timings``
and ``clock`` where the engine runs the algorithm's own impl, or, in a tree whose
engine runs a form per algorithm (``engine.form``, as at a5e8a79), the form's three
calls timed the same way (``engine_benchmark comm`` did so there).

Prints a header, one JSON line per (repetition, tree: [hooks, round] ms per step per
topology) and, per topology, the median over repetitions of each tree's milliseconds
per step (``_ms`` the hooks, ``_round_ms`` the round) and the median ratio of the first
tree (``now``) to every other over the repetitions' pairs, with the pairs' range (of
the hooks; ``_round`` the round's). Also the parameters' checksum after
the run per tree and topology: the same data and steps in every tree, so equal
checksums say the trees computed the same values.

This module imports only the standard library at its top: a subprocess runs it as a
file (``runpy``) with another tree's package on the path.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import runpy
import statistics
import subprocess
import sys
import time
from pathlib import Path

TOPOLOGIES = ("chain", "binary_tree", "double_binary_tree")
PHASES = ("before_forward", "after_backward", "after_step")  # the engine's hooks; relay's round is after_step
REPO = Path(__file__).resolve().parents[2]
_PASSES_MODULES = ("bagua_algos.engine.rows", "bagua_algos.runtime.rows", "bagua_algos.engine.forms.rows")


# ------------------------------------------------------------------ in the subprocess


def _torch_passes_only():
    """The tree's switch to torch's row passes (the compiled ones are not loaded here
    anyway), wherever the tree keeps it; a no-op context in a tree without one."""
    import contextlib
    import importlib

    for name in _PASSES_MODULES:
        try:
            return importlib.import_module(name).torch_passes_only()
        except (ImportError, AttributeError):
            continue
    return contextlib.nullcontext()


class _TimedForm:
    """An older engine's form (``before_forward``, ``after_backward``, ``after_step``,
    each called with the step number) with each call's seconds added up."""

    def __init__(self, form, clock):
        self.form, self.clock, self.seconds = form, clock, dict.fromkeys(PHASES, 0.0)

    def _timed(self, name, steps):
        start = self.clock()
        getattr(self.form, name)(steps)
        self.seconds[name] += self.clock() - start

    def before_forward(self, steps):
        self._timed("before_forward", steps)

    def after_backward(self, steps):
        self._timed("after_backward", steps)

    def after_step(self, steps):
        self._timed("after_step", steps)


def _hook_seconds(engine, clock):
    """A function returning the seconds of the engine's hooks per phase (``PHASES``)
    since it was last called."""
    runtime = getattr(engine, "runtime", None)
    if runtime is not None:
        runtime.clock = clock
        runtime.timings = dict.fromkeys(PHASES, 0.0)

        def take():
            seconds, runtime.timings = runtime.timings, dict.fromkeys(PHASES, 0.0)
            return seconds
        return take
    timed = engine.form = _TimedForm(engine.form, clock)

    def take_form():
        seconds, timed.seconds = timed.seconds, dict.fromkeys(PHASES, 0.0)
        return seconds
    return take_form


def _measure(topology: str, args) -> dict:
    """Relay on ``topology`` on this tree's engine: milliseconds per step of its hooks
    per block, and the parameters' checksum after the run."""
    import torch
    from bagua_algos.algorithms import RelayAlgorithm
    from bagua_algos.engine import Engine

    n, b = args.workers, args.batch
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                 torch.nn.Linear(128, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    engine = Engine(module, n, RelayAlgorithm(topology=topology),
                    lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9, weight_decay=1e-4))
    x, y = torch.randn(n, b, 1, 8, 8), torch.randint(0, 10, (n, b))
    loss_fn = torch.nn.functional.cross_entropy
    for _ in range(args.warmup):
        engine.step(x, y, loss_fn)
    take = _hook_seconds(engine, time.process_time)
    blocks, rounds = [], []
    for _ in range(args.blocks):
        take()
        for _ in range(args.steps):
            engine.step(x, y, loss_fn)
        seconds = take()
        blocks.append(sum(seconds.values()) / args.steps * 1e3)
        rounds.append(seconds["after_step"] / args.steps * 1e3)
    params = engine.runtime.model.params if hasattr(engine, "runtime") else engine.model.params
    return {"ms": statistics.median(blocks), "round_ms": statistics.median(rounds),
            "blocks_ms": [round(v, 3) for v in blocks], "checksum": float(params.detach().double().sum())}


def _worker(argv) -> None:
    p = argparse.ArgumentParser(prog="relay_engine_compare worker")
    for name in ("workers", "batch", "warmup", "blocks", "steps", "threads"):
        p.add_argument(f"--{name}", type=int, required=True)
    p.add_argument("--topologies", required=True)
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    import bagua_algos

    out = {"package": str(Path(bagua_algos.__file__).resolve().parents[1]), "torch": torch.__version__,
           "load": os.getloadavg()[0]}
    with _torch_passes_only():
        for topology in args.topologies.split(","):
            out[topology] = _measure(topology, args)
    print(json.dumps(out), flush=True)


# ------------------------------------------------------------------------ the driver


def _tree(text: str) -> tuple[str, Path]:
    label, sep, path = text.partition("=")
    if not sep or not label or not path:
        raise argparse.ArgumentTypeError(f"{text!r}: a tree is LABEL=PATH (a checkout of the repository)")
    root = Path(path).resolve()
    if not (root / "bagua_algos" / "__init__.py").is_file():
        raise argparse.ArgumentTypeError(f"{text!r}: {root} holds no bagua_algos package (a checkout of the "
                                         "repository, e.g. git worktree add /tmp/relay_a5e8a79 a5e8a79)")
    return label, root


def _run_tree(root: Path, args) -> dict:
    """One subprocess on ``root``'s package: its JSON line."""
    flags = [f"--{name}={getattr(args, name)}" for name in ("workers", "batch", "warmup", "blocks", "steps", "threads")]
    code = ("import runpy, sys; sys.argv = [sys.argv[0], '--worker'] + sys.argv[1:]; "
            f"runpy.run_path({str(Path(__file__).resolve())!r}, run_name='__main__')")
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS=str(args.threads))
    done = subprocess.run([sys.executable, "-c", code, *flags, f"--topologies={','.join(args.topologies)}"],
                          env=env, cwd=root, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        raise SystemExit(f"relay_engine_compare: the run on {root} failed (exit {done.returncode}):\n{done.stderr}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if Path(result["package"]) != root:
        raise SystemExit(f"relay_engine_compare: the run meant for {root} imported bagua_algos from "
                         f"{result['package']}")
    return result


def _summary(trees: list, runs: dict, topologies) -> list[dict]:
    base = trees[0][0]
    out = []
    for topology in topologies:
        row = {"topology": topology}
        for label, _ in trees:
            row[f"{label}_ms"] = round(statistics.median(r[topology]["ms"] for r in runs[label]), 3)
            row[f"{label}_round_ms"] = round(statistics.median(r[topology]["round_ms"] for r in runs[label]), 3)
            row[f"{label}_checksum"] = runs[label][-1][topology]["checksum"]
        for label, _ in trees[1:]:
            pairs = [a[topology]["ms"] / b[topology]["ms"] for a, b in zip(runs[base], runs[label])]
            row[f"{base}/{label}"] = round(statistics.median(pairs), 3)
            row[f"{base}/{label}_range"] = [round(min(pairs), 3), round(max(pairs), 3)]
            pairs = [a[topology]["round_ms"] / b[topology]["round_ms"] for a, b in zip(runs[base], runs[label])]
            row[f"{base}/{label}_round"] = round(statistics.median(pairs), 3)
        out.append(row)
    return out



def _topologies(text: str) -> list[str]:
    names = [t for t in text.split(",") if t]
    bad = [t for t in names if t not in TOPOLOGIES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: topologies are a comma-separated list of {', '.join(TOPOLOGIES)}")
    return names


def build_parser() -> argparse.ArgumentParser:
    # (imported here: the module's top level also runs under another tree's path, in the workers)
    from bagua_algos.experiments.sweep.cli import int_at_least

    _positive, _non_negative = int_at_least(1, "a positive integer"), int_at_least(0, "an integer >= 0")
    p = argparse.ArgumentParser(prog="relay_engine_compare", description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", action="append", type=_tree, required=True,
                   help="LABEL=PATH: another checkout to time against this one (repeatable)")
    p.add_argument("--repetitions", type=_positive, default=5, help="subprocesses per tree, interleaved (default 5)")
    p.add_argument("--workers", type=_positive, default=64, help="engine workers (default 64)")
    p.add_argument("--batch", type=_positive, default=16, help="batch per worker (default 16)")
    p.add_argument("--warmup", type=_non_negative, default=70, help="untimed steps per topology (default 70)")
    p.add_argument("--blocks", type=_positive, default=4, help="timed blocks per topology (default 4)")
    p.add_argument("--steps", type=_positive, default=16, help="steps per block (default 16)")
    p.add_argument("--threads", type=_positive, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--topologies", type=_topologies, default=list(TOPOLOGIES),
                   help=f"comma-separated, of {', '.join(TOPOLOGIES)} (default all)")
    p.add_argument("--timeout", type=_positive, default=900, help="seconds per subprocess (default 900)")
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        _worker(argv[1:])
        return 0
    args = build_parser().parse_args(argv)
    trees = [("now", REPO)] + args.tree
    labels = [label for label, _ in trees]
    if len(set(labels)) != len(labels):
        raise SystemExit(f"argument --tree: labels must differ from each other and from 'now': {labels}")
    print(json.dumps({"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                      "python": platform.python_version(), "load": os.getloadavg(),
                      "trees": {label: str(root) for label, root in trees}, "workers": args.workers,
                      "threads": args.threads, "warmup": args.warmup, "blocks": args.blocks, "steps": args.steps}),
          flush=True)
    runs = {label: [] for label in labels}
    for rep in range(args.repetitions):
        order = trees if rep % 2 == 0 else trees[::-1]
        for label, root in order:
            result = _run_tree(root, args)
            runs[label].append(result)
            print(json.dumps({"repetition": rep, "tree": label, "load": round(result["load"], 2),
                              **{t: [round(result[t]["ms"], 3), round(result[t]["round_ms"], 3)] for t in args.topologies}}),
                  flush=True)
    for row in _summary(trees, runs, args.topologies):
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
