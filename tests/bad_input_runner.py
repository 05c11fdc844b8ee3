"""Running and judging the bad-input probes of ``bad_input_cases``, and the page
docs/probes.md that tabulates their answers.

A probe that needs no process group runs in this process, in a thread watched for
hangs; a distributed probe runs on both ranks of a ``bagua_algos.experiments.gloo_workers.WorkerPool`` of
``WORLD_SIZE`` workers, one pool for all of them (a spawn costs seconds). Every probe
records the exception type and the first line of its message (or "no error" and what
it observed) and its time: it passes when the outcome matches and it finished within
``TIME_LIMIT_S``.

``tests/test_bad_input_answers.py`` runs every probe as a test of its own. This module
is also the command that writes the page (from the repository's root):

    python tests/bad_input_runner.py                      # prints the table
    python tests/bad_input_runner.py --out docs/probes.md # writes the page too
    python tests/bad_input_runner.py -k nan_grad          # only probes whose id has this
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

if __name__ == "__main__":  # run as a command: the checkout importable, ahead of any installed copy
    sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bad_input_cases import PROBES, WORLD_SIZE, Probe, _model, _sgd, _step  # noqa: E402
from bagua_algos.experiments.gloo_workers import WorkerPool  # noqa: E402

TIME_LIMIT_S = 5.0  # a probe that takes longer fails: nothing may hang
HANG_GUARD_S = 20.0  # an in-process probe still running after this is reported as a hang
PG_TIMEOUT_S = 15.0  # the process-group timeout of the distributed probes' workers
CALL_TIMEOUT_S = 180.0  # a distributed probe (the pool's start included) must be back within this


@dataclass
class Outcome:
    id: str
    raised: Optional[str]  # exception type name, None if it returned
    message: str  # first line of the message, or what the probe observed
    full_message: str
    seconds: float
    passed: bool
    why: str = ""  # why it failed


def _first_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[0].strip() if lines else ""


def judge(probe: Probe, exc: Optional[BaseException], value, seconds: float) -> Outcome:
    """The outcome of ``probe`` given what it raised (or returned) and its time."""
    if exc is None:
        observation = "no error" if value is None else str(value)
        raised, full = None, observation
        if probe.expected is not None:
            passed, why = False, f"expected {probe.expected.__name__}, nothing was raised"
        elif probe.match not in observation:
            passed, why = False, f"observation does not contain {probe.match!r}"
        else:
            passed, why = True, ""
    else:
        raised, full = type(exc).__name__, str(exc)
        if probe.expected is None:
            passed, why = False, "expected no error"
        elif not isinstance(exc, probe.expected):
            passed, why = False, f"expected {probe.expected.__name__}"
        elif probe.match not in full:
            passed, why = False, f"message does not contain {probe.match!r}"
        else:
            passed, why = True, ""
    if passed and seconds > TIME_LIMIT_S:
        passed, why = False, f"took {seconds:.1f} s (limit {TIME_LIMIT_S:.0f} s)"
    return Outcome(probe.id, raised, _first_line(full), full, seconds, passed, why)


def _call(fn, *args):
    start = time.perf_counter()
    try:
        value = fn(*args)
        exc = None
    except (Exception, SystemExit) as caught:  # noqa: BLE001 - recording is the point
        value, exc = None, caught
    return exc, value, time.perf_counter() - start


_warmed_up = False


def warm_up() -> None:
    """One plain training step, untimed: the first optimizer step imports and sets up
    parts of torch (seconds on a busy 2-core machine) that no probe should be charged for."""
    global _warmed_up
    if not _warmed_up:
        model = _model()
        _step(model, _sgd(model), 0)
        _warmed_up = True


def run_probe(probe: Probe) -> Outcome:
    """Run a single-process probe in a thread; one still running after HANG_GUARD_S is a hang."""
    if probe.distributed:
        raise ValueError(f"probe {probe.id!r} needs the gloo workers: use run_distributed")
    warm_up()
    box = {}
    thread = threading.Thread(target=lambda: box.update(result=_call(probe.fn)), daemon=True, name=f"probe-{probe.id}")
    thread.start()
    thread.join(HANG_GUARD_S)
    if thread.is_alive():
        return Outcome(probe.id, "HANG", f"no result after {HANG_GUARD_S:.0f} s", "", HANG_GUARD_S, False, "hangs")
    return judge(probe, *box["result"])


def _probe_in_worker(rank, world_size, probe_id):
    """In each pool worker: run and judge one distributed probe, as a plain dict."""
    warm_up()
    probe = next(p for p in PROBES if p.id == probe_id)
    return vars(judge(probe, *_call(probe.fn, rank, world_size)))


def start_pool() -> WorkerPool:
    """The workers every distributed probe runs on (close it when done)."""
    return WorkerPool(WORLD_SIZE, pg_timeout=PG_TIMEOUT_S)


def run_distributed(probe: Probe, pool: WorkerPool) -> Outcome:
    """Run a distributed probe on every rank of ``pool``: rank 0's outcome with the
    slowest rank's time, failed unless every rank's outcome passed."""
    if not probe.distributed:
        raise ValueError(f"probe {probe.id!r} runs in this process: use run_probe")
    judged = [Outcome(**result) for result in pool.run(_probe_in_worker, probe.id, timeout=CALL_TIMEOUT_S)]
    first = judged[0]
    first.seconds = max(o.seconds for o in judged)
    for rank, other in enumerate(judged[1:], start=1):
        if not other.passed and first.passed:
            first.passed, first.why = False, f"rank {rank}: {other.why} ({other.raised or 'no error'}: {other.message})"
    return first


def run_all(probes=None) -> list[Outcome]:
    """Every probe's outcome, in order; one pool for the distributed ones."""
    probes = PROBES if probes is None else probes
    local = {p.id: run_probe(p) for p in probes if not p.distributed}
    remote = {}
    if any(p.distributed for p in probes):
        with start_pool() as pool:
            remote = {p.id: run_distributed(p, pool) for p in probes if p.distributed}
    return [local.get(p.id) or remote[p.id] for p in probes]


# ============================================================================= output


def _cell(text: str, limit: int = 150) -> str:
    text = " ".join(str(text).split())
    if len(text) > limit:
        text = text[: limit - 1] + "…"
    return text.replace("|", "\\|")


def table(probes, outcomes) -> str:
    rows = ["| # | probe | runs in | what the user did | expected | outcome | message (first line) / observation | s | result |",
            "|---|---|---|---|---|---|---|---|---|"]
    for number, (probe, o) in enumerate(zip(probes, outcomes), start=1):
        expected = probe.expected.__name__ if probe.expected else "no error"
        outcome = o.raised or "no error"
        result = "pass" if o.passed else f"**FAIL**: {o.why}"
        rows.append(
            f"| {number} | `{probe.id}` | {'2 gloo workers' if probe.distributed else 'this process'} | "
            f"{_cell(probe.action, 110)} | {expected} | {outcome} | "
            f"{_cell(o.message)} | {o.seconds:.3f} | {_cell(result, 160)} |"
        )
    return "\n".join(rows)


def summary(probes, outcomes) -> str:
    failed = [(p, o) for p, o in zip(probes, outcomes) if not o.passed]
    lines = [f"{len(probes)} probes ({sum(not p.distributed for p in probes)} in one process, "
             f"{sum(p.distributed for p in probes)} in {WORLD_SIZE} gloo workers): "
             f"{len(probes) - len(failed)} pass, {len(failed)} fail; slowest probe "
             f"{max(o.seconds for o in outcomes):.2f} s (limit {TIME_LIMIT_S:.0f} s)."]
    for p, o in failed:
        note = f" Known issue: {p.known_issue}." if p.known_issue else ""
        lines.append(f"- `{p.id}` ({p.action}): {o.why}.{note} "
                     f"Reproduce: `python tests/bad_input_runner.py -k {p.id}`.")
    return "\n".join(lines)


PAGE_INTRO = """\
Every row is one thing a user can get wrong and what bagua_algos answers. The standard:
bad input is refused at once with an error that names the argument and what would be
valid; the module is left as it was; nothing hangs (every probe must finish within
{limit:.0f} s). A probe passes when the exception type matches (a subclass counts) and
its message contains the expected text. Rows whose expectation is "no error" document
behaviour that is deliberately not an error; their observation must contain the
expected text. The probes live in `tests/bad_input_cases.py`;
`tests/test_bad_input_answers.py` checks each of them as a test of its own.

Probes that need a process group run on both ranks of one pool of 2 gloo workers,
spawned once and given the probes one after another (the row shows rank 0's outcome
and the slower rank's time; a probe fails if either rank's outcome is wrong); the
others run in the calling process, each in a thread watched for hangs. Times are taken
after one untimed warm-up training step (the first optimizer step sets up parts of
torch).

**NaN and inf gradients** (`nan_grad_*`, `inf_grad_*`) are not refused: as under torch
DDP they propagate silently. NaN in one rank's gradients reaches every rank: through
the gradient allreduce at once, through model averaging (allreduce_average,
decentralized, relay, async) at the next averaging. Nothing checks for them (a check
would cost a synchronisation per step); guard the loss yourself
(`torch.isfinite(loss)`, gradient clipping, `torch.amp.GradScaler`).
"""


FOUND_AND_FIXED = """\
## Found by the probes and fixed

Each was a failing probe first; the fixes have their own tests in
`tests/test_argument_checks.py`.

- `ga_average_string`, `dec_hierarchical_string`: `GradientAllReduceAlgorithm(average="false")`
  and `DecentralizedAlgorithm(hierarchical="false")` were read with `bool()`, so the
  string "false" silently meant True. The flags must now be True or False (TypeError).
- `relay_seed_string`: `RelayAlgorithm(seed="x")` failed with Python's
  `invalid literal for int()`, not naming `seed`; `seed=1.7` was truncated to 1. Now
  `seed must be an int`.
- `dec_disconnected_topology`: a user's own `Topology` with several components was
  accepted by `DecentralizedAlgorithm`; the components never exchange models, so the
  models are never averaged (a silent wrong result). Now refused: `is not connected`.
- `dec_all_frozen`: a module whose parameters all have `requires_grad=False` was refused
  by `DecentralizedAlgorithm` (and `AsyncModelAverageAlgorithm`) with the internal
  `bucket '0' needs at least one Bagua tensor`. The message now names the cause.
- `wrap_sparse_embedding`: `nn.Embedding(..., sparse=True)` under gradient_allreduce
  crashed inside torch at the first backward after `zero_grad()`
  (`Cannot access data pointer of Tensor that doesn't have storage`, in
  `BaguaBucket.before_ops`). The gradient hook now refuses a sparse gradient by the
  parameter's name (NotImplementedError; model-averaging algorithms, which do not
  communicate gradients, still accept it).
"""


def page(probes, outcomes, command: str, seconds: Optional[float] = None) -> str:
    cuda = "a GPU" if torch.cuda.is_available() else "no GPU"
    header = [
        "# Bad-input probes",
        "",
        f"Generated by `{command}` on {datetime.date.today().isoformat()}: "
        f"{os.cpu_count()} CPU cores, {cuda}, torch {torch.__version__.split('+')[0]}, "
        f"Python {platform.python_version()}, {platform.system()}.",
        "",
        PAGE_INTRO.format(limit=TIME_LIMIT_S),
        "## Summary",
        "",
        summary(probes, outcomes)
        + (f"\n\nThe whole run (the one spawn of the 2 gloo workers included) took {seconds:.1f} s." if seconds else ""),
        "",
        FOUND_AND_FIXED,
        "## Probes",
        "",
        table(probes, outcomes),
        "",
    ]
    return "\n".join(header)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Probe bagua_algos with bad input and tabulate the answers.")
    parser.add_argument("--out", type=Path, help="also write the markdown page here (e.g. docs/probes.md)")
    parser.add_argument("-k", dest="select", help="only probes whose id contains this text")
    args = parser.parse_args(argv)
    probes = [p for p in PROBES if not args.select or args.select in p.id]
    start = time.perf_counter()
    outcomes = run_all(probes)
    elapsed = time.perf_counter() - start
    print(table(probes, outcomes))
    print()
    print(summary(probes, outcomes))
    print(f"all probes: {elapsed:.1f} s")
    if args.out:
        shown = " ".join(["python", "tests/bad_input_runner.py", *(argv if argv is not None else sys.argv[1:])])
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(page(probes, outcomes, shown, elapsed))
        print(f"wrote {args.out}")
    return 0 if all(o.passed for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())

