"""Kill-and-restart runs: a worker SIGKILLed in the middle of training under
``--max_restarts``, the job resumed from its last checkpoint by the elastic agent, and
the outcome measured against an uninterrupted run resumed from the same checkpoint.

    nice -n 5 python benchmarks/elastic_faults.py --runs 20 --out elastic_faults.json
    bagua-algos elastic-faults --runs 20 --out elastic_faults.json     # the same

It runs the checkout's examples/fault_tolerance.py (examples/ is not installed), so it
needs the package installed from a checkout (``pip install -e '.[experiments]'``); elsewhere it says so.

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

``--step_faults MODES`` measures fault tolerance at the step (torchft) against the
restart from a checkpoint instead (:func:`step_faults`; docs/elastic.md has the figures)::

    nice -n 5 python benchmarks/elastic_faults.py --step_faults torchft_free,torchft_kill,restart_free,restart_kill \
        --nproc_per_node 4 --duration 300 --kill_every 30 --save_every 100 --out step_faults.json
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



# --- fault tolerance at the step (torchft) against the restart from a checkpoint ------------

STEP_MODES = ("torchft_free", "torchft_kill", "restart_free", "restart_kill")
STEP_WORKER = "bagua_algos.experiments.elastic_step_worker"


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a kill
            pass
    return out


def step_faults(workdir: Path, mode: str, *, nproc=4, duration=300.0, kill_every=30.0, label="gradient_allreduce",
                save_every=50, seed=0, min_replicas=2, heartbeat_ms=2000, join_ms=250, rng=None) -> dict:
    """One throughput run of ``mode`` (STEP_MODES): ``nproc`` CPU workers train the sweep's
    task (elastic_step_worker) for ``duration`` s; with ``*_kill`` a random worker is
    SIGKILLed every ``kill_every`` s. torchft: each worker a replica over one lighthouse
    started here, the killed one started again at once (the same replica id: it joins
    and heals). restart: the plugin's launcher (torchrun's agent, static rendezvous,
    ``--max_restarts`` 1000) restarts every worker, which resume from the newest
    checkpoint (one every ``save_every`` steps). Then every worker is told one step to
    stop at (the same for all), and the logs are measured (:func:`measure_step_faults`)."""
    rng = rng or random.Random(seed)
    os.environ.setdefault("RUST_LOG", "error")  # the lighthouse started here logs every quorum otherwise
    workdir.mkdir(parents=True, exist_ok=True)
    logs, stop_file = workdir / "logs", workdir / "stop"
    logs.mkdir(exist_ok=True)
    env = worker_env()
    until = time.time() + duration + 240  # the hard stop, past the agreed one
    common = ["-m", STEP_WORKER, "--log_dir", str(logs), "--stop_file", str(stop_file), "--until", str(until),
              "--label", label, "--seed", str(seed)]
    kills, procs, lighthouse, launcher = [], {}, None, None
    torchft_mode = mode.startswith("torchft")
    try:
        if torchft_mode:
            from torchft.coordination import LighthouseServer

            # join_ms: after a loss the survivors' quorum waits this long for the dead replica
            # while its heartbeats are fresh (heartbeat_ms), then forms without it
            lighthouse = LighthouseServer(bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=join_ms,
                                          heartbeat_timeout_ms=heartbeat_ms)
            env.update(BAGUA_ALGOS_FAULT_TOLERANCE="torchft", TORCHFT_LIGHTHOUSE=lighthouse.address(),
                       BAGUA_ALGOS_MIN_REPLICAS=str(min_replicas), RUST_LOG="error")

            def start(replica):
                out = open(workdir / f"{replica}.out", "a")
                procs[replica] = subprocess.Popen([sys.executable, *common, "--mode", "torchft"],
                                                  env=dict(env, BAGUA_ALGOS_REPLICA_ID=replica), cwd=REPO,
                                                  stdout=out, stderr=subprocess.STDOUT)

            for i in range(nproc):
                start(f"r{i}")
        else:
            out = open(workdir / "launcher.out", "w")
            launcher = subprocess.Popen(
                [sys.executable, *launch_argv("bagua", nproc, 1000), "--module", *common[1:2], "--mode", "restart",
                 "--checkpoints", str(workdir / "checkpoints"), "--save_every", str(save_every), *common[2:]],
                env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        # the clock starts at the first step logged (not at the imports)
        _wait_for_a_step(logs, mode, (workdir / "launcher.out") if launcher else None)
        t0 = time.time()
        next_kill = t0 + kill_every
        while time.time() < t0 + duration:
            time.sleep(0.05)
            if not mode.endswith("_kill") or time.time() < next_kill:
                continue
            if torchft_mode:
                next_kill += kill_every
                victim = rng.choice(sorted(procs))
                procs[victim].kill()
                kills.append({"t": time.time(), "victim": victim})
                procs[victim].wait()
                start(victim)  # a scheduler's restart: it joins the quorum and heals
            elif _kill_a_worker_of_the_round(logs, nproc, rng, kills):
                next_kill += kill_every
            else:  # the agent is still starting the round, or the worker had gone: again in a moment
                next_kill = time.time() + 0.5
        t_end = time.time()
        last = max((r["step"] for f in logs.glob("*.jsonl") for r in _read_jsonl(f) if "step" in r), default=0)
        stop_file.write_text(str(last + 20))
        deadline = time.time() + 180
        running = list(procs.values()) + ([launcher] if launcher else [])
        while any(p.poll() is None for p in running) and time.time() < deadline:
            time.sleep(0.2)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
            p.wait()
        if launcher is not None:
            stop_launcher(launcher, STEP_WORKER)
        if lighthouse is not None:
            lighthouse.shutdown()
    result = measure_step_faults(logs, kills, t0, t_end, torchft_mode)
    result.update(mode=mode, nproc=nproc, duration=round(t_end - t0, 1), kill_every=kill_every, label=label,
                  save_every=None if torchft_mode else save_every)
    return result


def _wait_for_a_step(logs: Path, mode: str, launcher_out: Path | None, limit: float = 300.0) -> None:
    """Wait until a worker has logged a step; past ``limit`` s, raise with the tail of
    the launcher's output (restart modes)."""
    t_start = time.time()
    while not any(r.get("step") is not None for f in logs.glob("*.jsonl") for r in _read_jsonl(f)):
        if time.time() - t_start > limit:
            tail = launcher_out.read_text()[-3000:] if launcher_out is not None else ""
            raise RuntimeError(f"{mode}: no step within {limit:.0f} s\n{tail}")
        time.sleep(0.2)


def _kill_a_worker_of_the_round(logs: Path, nproc: int, rng: random.Random, kills: list[dict]) -> bool:
    """SIGKILL a random worker of the agent's newest round (its pids from the workers'
    start records), recorded in ``kills``. False, killing nothing, while fewer than
    ``nproc`` workers of that round have started, or when the victim had exited."""
    starts = {f.stem: [r for r in _read_jsonl(f) if "pid" in r] for f in logs.glob("rank*.jsonl")}
    newest = max((r["restart"] for rs in starts.values() for r in rs), default=0)
    pids = {who: rs[-1]["pid"] for who, rs in starts.items() if rs and rs[-1]["restart"] == newest}
    if len(pids) < nproc:
        return False
    victim = rng.choice(sorted(pids))
    try:
        os.kill(pids[victim], signal.SIGKILL)
    except ProcessLookupError:
        return False
    kills.append({"t": time.time(), "victim": victim})
    return True


def measure_step_faults(logs: Path, kills: list[dict], t0: float, t_end: float, torchft_mode: bool) -> dict:
    """From the workers' logs: committed (torchft) or net (restart) steps in [t0, t_end],
    for each kill the seconds to the next step committed (torchft) or taken by the new
    round (restart) and the steps lost, and the final test accuracy (mean over workers)."""
    records = {f.stem: _read_jsonl(f) for f in logs.glob("*.jsonl")}
    steps = sorted((r["t"], r["step"], who) for who, rs in records.items() for r in rs if "step" in r)
    finals = [r for rs in records.values() for r in rs if "final" in r]
    in_window = [s for t, s, _ in steps if t0 <= t <= t_end]
    per_kill = []
    starts = sorted(r["t"] for rs in records.values() for r in rs if "start" in r)
    for kill in kills:
        tk = kill["t"]
        before = [s for t, s, _ in steps if t <= tk]
        if torchft_mode:
            # the first step committed by the quorum without the victim (a step already in
            # flight at the kill may still commit at the old size: it is not the recovery)
            last = max(((r["t"], r["world"]) for rs in records.values() for r in rs
                        if "step" in r and r["t"] <= tk), default=(0, 0))
            world_then = last[1]  # the quorum's size at the kill
            after = [(r["t"], r["step"]) for who, rs in records.items() if who != kill["victim"] for r in rs
                     if "step" in r and r["t"] > tk and r["world"] < world_then]
        else:
            # the first step of the new round (the old round's workers may log a step or two first)
            new_round = [t for t in starts if t > tk]
            after = [(t, s) for t, s, _ in steps if new_round and t > new_round[0]]
        after.sort()
        entry = {"victim": kill["victim"], "at": round(tk - t0, 2),
                 "seconds_to_next_step": round(after[0][0] - tk, 2) if after else None}
        if torchft_mode:
            # committed steps are never taken back; the steps in flight at the kill are discarded and done again
            survivors = [who for who in records if who != kill["victim"]]
            nxt = [t for t, _ in after]
            horizon = nxt[0] if nxt else t_end
            entry["discarded"] = max((sum(1 for r in records[w] if "discarded" in r and tk <= r["t"] <= horizon)
                                      for w in survivors), default=0)
            entry["steps_lost"] = 0
        else:
            resumed = [r["start"] for rs in records.values() for r in rs if "start" in r and r["t"] > tk]
            if before and resumed:
                entry["steps_lost"] = max(before) - min(resumed)
        per_kill.append(entry)
    if torchft_mode:  # every committed step once per replica, in order
        for who, rs in records.items():
            mine = [r["step"] for r in rs if "step" in r]
            assert mine == sorted(set(mine)), f"{who}: a committed step repeated or out of order"
        progress = (max(in_window) + 1 - min(in_window)) if in_window else 0
    else:
        progress = (max(in_window) - min(in_window) + 1) if in_window else 0
        last_in_window = [s for t, s, _ in steps if t <= t_end]
        progress = (last_in_window[-1] - in_window[0] + 1) if in_window else 0  # net: the step reached at t_end
    secs = [k["seconds_to_next_step"] for k in per_kill if k["seconds_to_next_step"] is not None]
    lost = [k["steps_lost"] for k in per_kill if "steps_lost" in k]
    return {
        "steps": progress, "steps_per_second": round(progress / max(t_end - t0, 1e-9), 2),
        "kills": len(kills), "per_kill": per_kill,
        "seconds_to_next_step_median": round(statistics.median(secs), 2) if secs else None,
        "seconds_to_next_step_max": round(max(secs), 2) if secs else None,
        "steps_lost_median": statistics.median(lost) if lost else None, "steps_lost_max": max(lost) if lost else None,
        "discarded_per_kill_median": (statistics.median([k["discarded"] for k in per_kill])
                                      if torchft_mode and per_kill else None),
        "accuracy": round(statistics.mean(f["accuracy"] for f in finals), 4) if finals else None,
        "workers_finished": len(finals),
    }


def run_step_faults(modes, out=None, **kwargs) -> dict:
    """Every mode of ``modes`` once, one after another; each row with the machine's load."""
    report = {"command": " ".join([os.path.basename(sys.executable), *sys.argv]), "runs": []}
    for mode in modes:
        load_before = os.getloadavg()
        with tempfile.TemporaryDirectory(prefix=f"step_faults_{mode}_") as tmp:
            row = step_faults(Path(tmp), mode, **kwargs)
        row["loadavg_before"], row["loadavg_after"] = [round(x, 2) for x in load_before], \
            [round(x, 2) for x in os.getloadavg()]
        report["runs"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "per_kill"}), flush=True)
        if out:
            Path(out).write_text(json.dumps(report, indent=1))
    free = {r["mode"].split("_")[0]: r for r in report["runs"] if r["mode"].endswith("_free")}
    for row in report["runs"]:
        base = free.get("torchft") or free.get(row["mode"].split("_")[0])
        if base and base["steps"]:
            row["throughput_kept_vs_torchft_free"] = round(row["steps"] / base["steps"], 3)
        own = free.get(row["mode"].split("_")[0])
        if own and own["steps"]:
            row["throughput_kept_vs_own_free"] = round(row["steps"] / own["steps"], 3)
    if out:
        Path(out).write_text(json.dumps(report, indent=1))
    return report

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
    parser.add_argument("--step_faults", default="", metavar="MODES",
                        help=f"instead: throughput runs, comma-separated of {list(STEP_MODES)} (torchft at the step "
                             "against the restart from a checkpoint; --nproc_per_node workers)")
    parser.add_argument("--duration", type=float, default=300.0, help="--step_faults: seconds of each run")
    parser.add_argument("--kill_every", type=float, default=30.0, help="--step_faults: seconds between kills")
    parser.add_argument("--label", default="gradient_allreduce", help="--step_faults: the ALGORITHM_TABLE row")
    parser.add_argument("--join_timeout", type=float, default=0.25,
                        help="--step_faults: the lighthouse's join timeout, seconds (torchft modes)")
    parser.add_argument("--heartbeat_timeout", type=float, default=2.0,
                        help="--step_faults: the lighthouse's heartbeat timeout, seconds (torchft modes)")
    args = parser.parse_args(argv)
    if args.step_faults:
        modes = args.step_faults.split(",")
        bad = [m for m in modes if m not in STEP_MODES]
        if bad:
            parser.error(f"argument --step_faults: unknown {bad}; valid: {list(STEP_MODES)}")
        run_step_faults(modes, out=args.out, nproc=args.nproc_per_node, duration=args.duration,
                        kill_every=args.kill_every, label=args.label, save_every=args.save_every, seed=args.seed,
                        join_ms=int(args.join_timeout * 1000), heartbeat_ms=int(args.heartbeat_timeout * 1000),
                        rng=random.Random(args.seed))
        return
    if not args.plain_against_plugin and not SCRIPT.is_file():
        parser.error(f"{SCRIPT} is not there: the kill-and-restart runs need the repository's checkout "
                     "(examples/ is not installed); install the package from it (pip install -e '.[experiments]' from its root)")
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
