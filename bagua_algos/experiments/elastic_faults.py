"""Kill-and-restart runs: a worker SIGKILLed in the middle of training under
``--max_restarts``, the job resumed from its last checkpoint by the elastic agent, and
the outcome measured against an uninterrupted run resumed from the same checkpoint.

    nice -n 5 python benchmarks/elastic_faults.py --runs 20 --out elastic_faults.json
    bagua-algos elastic-faults --runs 20 --out elastic_faults.json     # the same

It runs the checkout's examples/fault_tolerance.py (examples/ is not installed), so it
needs the package installed from a checkout (``pip install -e .``); elsewhere it says so.

For each algorithm family (``FAMILIES``) and run: examples/fault_tolerance.py starts on
``--nproc_per_node`` CPU workers under the chosen launcher (the plugin's, static
rendezvous; or torchrun, c10d) with ``--max_restarts``; once the victim rank has
logged a step drawn at random between two checkpoints, it is killed with SIGKILL.
Reported per family: runs failed (exit code ≠ 0, or a final model that differs from
the reference's) and hung (past ``--timeout``, the whole session killed), restarts
(rounds after the first), steps lost (the step logged at the kill minus the step
resumed from), seconds from the kill to the first step of the new round, and the
final test accuracy of the restarted run against the reference: the same job, never
killed, resumed from a copy of the checkpoint the restarted run resumed from; on CPU
the two must agree bit for bit (every tensor of every rank's final state).
tests/test_elastic_restarts.py runs one such run for every family.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bagua_algos.experiments.common import free_port

# The repository's checkout this package runs from (bagua_algos/experiments/ -> the root):
# this benchmark runs its examples/fault_tolerance.py.
REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "fault_tolerance.py"
TRACKER = "latest_checkpointed_iteration.txt"
FAMILIES = {
    "exact": ["gradient_allreduce"],
    "gossip": ["decentralized", "low_precision_decentralized"],
    "relay": ["relay"],
    "compressed": ["powersgd", "bytegrad"],
}
LAUNCHERS = ("bagua", "torchrun")


def worker_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    env.update(OMP_NUM_THREADS="1", BAGUA_ALGOS_BACKEND="gloo", PYTHONFAULTHANDLER="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def _children() -> dict[int, list[int]]:
    """ppid → pids of every process now running (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    return children


def _descendants(pid: int) -> list[int]:
    children, found, todo = _children(), [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def stop_launcher(proc: subprocess.Popen, marker: str, grace: float = 15.0) -> None:
    """End a launcher started with ``start_new_session=True`` and all its workers.

    torchrun's agent starts each worker in a session of its own, so killing the
    launcher's process group would leave them running (and a SIGKILLed agent cannot
    stop them). First SIGTERM: the agent stops its workers itself; then SIGKILL for the
    launcher's group and for every process found below it beforehand whose command line
    still names ``marker`` (a pid may have been reused meanwhile)."""
    below = _descendants(proc.pid) if proc.poll() is None else []
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=grace)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    for pid in below:
        try:
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass


def launch_argv(launcher: str, nproc: int, max_restarts: int) -> list[str]:
    if launcher == "bagua":
        return ["-m", "bagua_algos.launch", "--nproc_per_node", str(nproc), "--max_restarts", str(max_restarts),
                "--master_port", str(free_port())]
    return ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
            "--max_restarts", str(max_restarts), "--monitor_interval", "0.5"]


class Job:
    """examples/fault_tolerance.py under a launcher, in its own session, output to files;
    ``stop()`` kills the session and every worker pid it wrote (always call it)."""

    def __init__(self, checkpoints: Path, algorithms, *, steps, save_every, nproc=2, launcher="bagua",
                 max_restarts=1, step_seconds=0.0):
        self.dir = Path(checkpoints)
        self.dir.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, *launch_argv(launcher, nproc, max_restarts), str(SCRIPT),
                "--checkpoints", str(self.dir), "--algorithms", ",".join(algorithms),
                "--steps", str(steps), "--save_every", str(save_every), "--step_seconds", str(step_seconds)]
        self.out, self.err = open(self.dir / "launcher.out", "w"), open(self.dir / "launcher.err", "w")
        self.proc = subprocess.Popen(argv, cwd=REPO, env=worker_env(), stdout=self.out, stderr=self.err,
                                     start_new_session=True)
        self.nproc = nproc

    def progress(self, rank: int) -> list[tuple[int, float, int]]:
        """(step, time, round) lines rank ``rank`` has logged."""
        try:
            lines = (self.dir / f"progress_rank{rank}.txt").read_text().splitlines()
        except FileNotFoundError:
            return []
        rows = []
        for line in lines:
            parts = line.split()
            if len(parts) == 3:
                rows.append((int(parts[0]), float(parts[1]), int(parts[2])))
        return rows

    def pid(self, rank: int) -> int | None:
        try:
            return int((self.dir / f"pid_rank{rank}.txt").read_text())
        except (FileNotFoundError, ValueError):
            return None

    def wait(self, timeout: float) -> int | None:
        """The launcher's exit code, or None if it ran past ``timeout`` (then stopped)."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            return None

    def stop(self) -> None:
        """Stop the launcher and every worker of this job (always call it)."""
        stop_launcher(self.proc, str(self.dir))
        self.out.close()
        self.err.close()

    def results(self) -> list[dict]:
        """Every rank's final result (examples/fault_tolerance.py writes one file each)."""
        return [json.loads(path.read_text()) for path in sorted(self.dir.glob("result_rank*.json"))]

    def tail(self) -> str:
        return ((self.dir / "launcher.out").read_text()[-2000:] + "\n--- stderr ---\n"
                + (self.dir / "launcher.err").read_text()[-4000:])


def copy_checkpoint(source: Path, target: Path, algorithms, iteration: int) -> None:
    """``target`` holding only ``source``'s checkpoint ``iteration`` of each algorithm."""
    for name in algorithms:
        (target / name).mkdir(parents=True)
        shutil.copytree(source / name / f"iter_{iteration:07d}", target / name / f"iter_{iteration:07d}")
        (target / name / TRACKER).write_text(str(iteration))


def final_states_equal(a: Path, b: Path, algorithms, nproc: int) -> list[str]:
    """The (algorithm, rank) whose final states differ in any bit (empty: all equal)."""
    differ = []
    for name in algorithms:
        for rank in range(nproc):
            x = torch.load(a / f"final_{name}_rank{rank}.pt")
            y = torch.load(b / f"final_{name}_rank{rank}.pt")
            if x.keys() != y.keys() or not all(torch.equal(x[k], y[k]) for k in x):
                differ.append(f"{name}/rank{rank}")
    return differ


def kill_and_restart(workdir: Path, algorithms, *, steps=40, save_every=5, nproc=2, launcher="bagua",
                     max_restarts=2, kill_step=None, victim=1, step_seconds=0.05, timeout=300.0,
                     rng=random) -> dict:
    """One run: kill, restart, finish, then the reference run; the figures of both."""
    if kill_step is None:  # between two checkpoints, never on one
        kill_step = rng.choice([s for s in range(save_every + 1, steps - save_every) if s % save_every])
    outcome = {"algorithms": list(algorithms), "launcher": launcher, "kill_step": kill_step, "failed": False,
               "hung": False}
    job = Job(workdir / "restarted", algorithms, steps=steps, save_every=save_every, nproc=nproc,
              launcher=launcher, max_restarts=max_restarts, step_seconds=step_seconds)
    deadline = time.monotonic() + timeout
    try:
        killed_at = None
        while time.monotonic() < deadline and job.proc.poll() is None:
            logged = job.progress(victim)
            if logged and logged[-1][0] >= kill_step:
                killed_at = time.time()
                os.kill(job.pid(victim), signal.SIGKILL)  # the victim's pid file is written before its first step
                outcome["killed_after_step"] = logged[-1][0]
                break
            time.sleep(0.01)
        code = job.wait(max(1.0, deadline - time.monotonic()))
    finally:
        job.stop()
    outcome["hung"] = code is None
    outcome["exit_code"] = code
    if killed_at is None or code != 0:
        outcome.update(failed=True, log=job.tail())
        return outcome
    rows = job.progress(victim)
    rounds = sorted({r for _, _, r in rows})
    outcome["restarts"] = len(rounds) - 1
    after = [(s, t) for s, t, r in rows if r > 0]
    resumed = after[0][0] - 1 if after else None
    outcome["resumed_from"] = resumed
    outcome["steps_lost"] = outcome["killed_after_step"] - resumed
    outcome["seconds_to_training"] = round(after[0][1] - killed_at, 2)
    outcome["accuracy"] = next(r["accuracy"] for r in job.results() if r["rank"] == 0)

    reference_dir = workdir / "reference"
    copy_checkpoint(job.dir, reference_dir, algorithms, resumed)
    reference = Job(reference_dir, algorithms, steps=steps, save_every=save_every, nproc=nproc,
                    launcher=launcher, max_restarts=0)
    try:
        ref_code = reference.wait(timeout)
    finally:
        reference.stop()
    if ref_code != 0:
        outcome.update(failed=True, reference_failed=True, log=reference.tail())
        return outcome
    outcome["reference_accuracy"] = next(r["accuracy"] for r in reference.results() if r["rank"] == 0)
    outcome["differ"] = final_states_equal(job.dir, reference_dir, algorithms, nproc)
    outcome["failed"] = bool(outcome["differ"])
    return outcome


# A plain-torch trial (the failure first reported), and the same through the plugin's init_process_group:
# an allreduce loop whose rank 1 kills itself at step 10 of round 0, under
# `torchrun --standalone --max_restarts 2` (c10d, the agent's store shared).
ALLREDUCE_LOOP = """
import os, time, torch
{join}
t = torch.ones(1)
for i in range(30):
    dist.all_reduce(t)
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["RANK"] == "1" and i == 10:
        os.kill(os.getpid(), 9)
    time.sleep(0.05)
print("round", os.environ["TORCHELASTIC_RESTART_COUNT"], "done", flush=True)
dist.destroy_process_group()
"""
JOINS = {
    "torch": "import torch.distributed as dist\n"
             "from datetime import timedelta\n"
             "dist.init_process_group('gloo', timeout=timedelta(seconds=30))",
    "plugin": "import torch.distributed as dist\n"
              "import bagua_algos\n"
              "bagua_algos.init_process_group(backend='gloo', timeout=30)",
}


def plain_against_plugin(runs: int, timeout: float = 100.0) -> dict:
    """{"torch": [...], "plugin": [...]}: per run, finished or hung, the rounds the agent
    ran and the "Connection refused" lines."""
    outcome = {name: [] for name in JOINS}
    with tempfile.TemporaryDirectory(prefix="elastic_plain_") as tmp:
        for index in range(runs):
            for name, join in JOINS.items():
                script = Path(tmp) / f"joined_by_{name}.py"  # not torch.py: it would shadow torch
                script.write_text(ALLREDUCE_LOOP.format(join=join))
                log = Path(tmp) / f"{name}_{index}.log"
                with open(log, "w") as out:
                    proc = subprocess.Popen([sys.executable, "-u", *launch_argv("torchrun", 2, 2), str(script)],
                                            cwd=tmp, env=worker_env(), stdout=out, stderr=subprocess.STDOUT,
                                            start_new_session=True)
                    started = time.monotonic()
                    try:
                        code = proc.wait(timeout=timeout)
                    except subprocess.TimeoutExpired:
                        code = None
                    finally:
                        stop_launcher(proc, str(script))
                text = log.read_text()
                rounds = sorted({int(line.split()[1]) for line in text.splitlines() if line.startswith("round ")})
                outcome[name].append({"finished": code == 0, "hung": code is None,
                                      "seconds": round(time.monotonic() - started, 1),
                                      "rounds_finished": rounds, "connection_refused": text.count("Connection refused")})
                print(f"{name} run {index + 1}: {outcome[name][-1]}", flush=True)
    return outcome


def summary(family: str, runs: list[dict]) -> dict:
    done = [r for r in runs if not r["failed"] and not r["hung"]]

    def spread(key):
        values = [r[key] for r in done]
        return None if not values else {"median": statistics.median(values), "max": max(values)}

    gaps = [abs(r["accuracy"][a] - r["reference_accuracy"][a]) for r in done for a in r["accuracy"]]
    return {"family": family, "runs": len(runs), "failed": sum(r["failed"] and not r["hung"] for r in runs),
            "hung": sum(r["hung"] for r in runs), "restarts": spread("restarts"), "steps_lost": spread("steps_lost"),
            "seconds_to_training": spread("seconds_to_training"),
            "accuracy": {a: round(statistics.mean(r["accuracy"][a] for r in done), 4) for a in FAMILIES[family]} if done else None,
            "max_accuracy_gap_to_reference": max(gaps) if gaps else None}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="kill-and-restart runs per family")
    parser.add_argument("--families", default=",".join(FAMILIES), help=f"comma-separated, of {list(FAMILIES)}")
    parser.add_argument("--launcher", choices=LAUNCHERS, default="bagua")
    parser.add_argument("--nproc_per_node", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--save_every", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before a run counts as hung")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write every run and the summaries as JSON here")
    parser.add_argument("--plain_against_plugin", type=int, default=0, metavar="N",
                        help="instead: N runs of a plain torch allreduce script and N of the same joined by the "
                             "plugin, one worker killed, under torchrun --standalone --max_restarts 2")
    args = parser.parse_args(argv)
    if not args.plain_against_plugin and not SCRIPT.is_file():
        parser.error(f"{SCRIPT} is not there: the kill-and-restart runs need the repository's checkout "
                     "(examples/ is not installed); install the package from it (pip install -e . from its root)")
    if args.plain_against_plugin:
        outcome = plain_against_plugin(args.plain_against_plugin)
        for name, runs in outcome.items():
            print(f"{name}: {sum(r['finished'] and r['rounds_finished'] == [1] for r in runs)} of {len(runs)} "
                  f"restarted once and finished; {sum(r['finished'] and len(r['rounds_finished']) and r['rounds_finished'] != [1] for r in runs)} "
                  f"needed more rounds; {sum(r['hung'] for r in runs)} hung; "
                  f"{sum(not r['finished'] and not r['hung'] for r in runs)} failed; "
                  f"{sum(r['connection_refused'] > 0 for r in runs)} with 'Connection refused'", flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(outcome, indent=1))
        return
    families = args.families.split(",")
    bad = [f for f in families if f not in FAMILIES]
    if bad:
        parser.error(f"argument --families: unknown {bad}; valid: {list(FAMILIES)}")
    rng = random.Random(args.seed)
    report = {"command": " ".join([os.path.basename(sys.executable), *sys.argv]), "runs": {}, "summary": []}
    for family in families:
        runs = []
        for index in range(args.runs):
            with tempfile.TemporaryDirectory(prefix=f"elastic_{family}_") as tmp:
                run = kill_and_restart(Path(tmp), FAMILIES[family], steps=args.steps, save_every=args.save_every,
                                       nproc=args.nproc_per_node, launcher=args.launcher, timeout=args.timeout,
                                       rng=rng)
            runs.append(run)
            state = "HUNG" if run["hung"] else "FAILED" if run["failed"] else "ok"
            print(f"{family} run {index + 1}/{args.runs}: {state} kill at step {run.get('killed_after_step')}, "
                  f"resumed from {run.get('resumed_from')}, {run.get('seconds_to_training')} s to training, "
                  f"restarts {run.get('restarts')}", flush=True)
            if run["failed"] or run["hung"]:
                print(run.get("log", "")[-3000:], flush=True)
            report["runs"][family] = runs
            if args.out:  # after every run, so that an interrupted sweep keeps what it measured
                Path(args.out).write_text(json.dumps(report, indent=1))
        report["summary"].append(summary(family, runs))
        print(json.dumps(report["summary"][-1]), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
