"""Restarts under torchrun's elastic agent (docs/elastic.md, "Restarts and state").

- A worker SIGKILLed in the middle of training under ``--max_restarts 2``: the agent
  restarts the workers, examples/fault_tolerance.py resumes from its last checkpoint
  and finishes, and for every family the final state equals, bit for bit, that of a
  run never killed and resumed from the same checkpoint (one launch for all families,
  torchrun's c10d rendezvous; bagua-algos elastic-faults repeats it 20 times a family).
  The same for DiLoCo, plain and streaming with overlap (in the same launch, a test of
  their own): the outer model and momentum, and a fragment's averaged pseudo-gradient in
  flight at the checkpoint, survive the restart.
- A round that cannot form its group fails within init_timeout and the agent's next
  round trains: no wait of the job's whole timeout.
- A job stopped at 4 workers resumes at 2, and one stopped at 2 resumes at 4.
- Workers whose agent is SIGKILLed stop by themselves (runtime/comm/agent_watch.py).
Every launch runs in its own session, killed in ``finally``; timeouts are short.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bagua_algos.experiments.elastic_faults import FAMILIES, Job, kill_and_restart, stop_launcher
from subprocesses import REPO, child_env, free_port

ALL = [name for names in FAMILIES.values() for name in names]


def processes_naming(text: str) -> list[int]:
    """Processes whose command line contains ``text`` (what a test must not leave behind)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            pass
    return found


# DiLoCo, plain and streaming: trained in the same launch as the families (one model per
# algorithm, all in the same steps: examples/fault_tolerance.py), checked by a test of its own
DILOCO = ["diloco", "diloco_streaming"]


@pytest.fixture(scope="module")
def killed_and_restarted(tmp_path_factory):
    """One launch for every family and DiLoCo's two forms: killed at step 12, restarted
    from the checkpoint of step 10, then the reference run from that checkpoint. The
    algorithms do not interact (a model, an optimizer and an algorithm each), so one
    launch checks each as its own launch would, for one launcher's and one reference's
    start-up (seconds of interpreters and torch imports) instead of one per test."""
    workdir = tmp_path_factory.mktemp("elastic")
    run = kill_and_restart(workdir, ALL + DILOCO, steps=14, save_every=5, kill_step=12,
                           launcher="torchrun", max_restarts=2, step_seconds=0.05, timeout=240)
    run["left_behind"] = processes_naming(str(workdir))
    return run


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_killed_worker_restarts_and_resumes_bit_for_bit(killed_and_restarted, family):
    run = killed_and_restarted
    assert not run["hung"] and run["exit_code"] == 0, run.get("log")
    assert run["restarts"] >= 1 and run["resumed_from"] == 10 and run["steps_lost"] >= 2
    differ = [d for d in run["differ"] if d.split("/")[0] in FAMILIES[family]]
    assert differ == [], f"{family}: the restarted run's final state differs from the reference on {differ}"
    assert {n: run["accuracy"][n] for n in ALL} == {n: run["reference_accuracy"][n] for n in ALL}  # DiLoCo's: its test
    assert run["left_behind"] == []


def test_diloco_s_outer_state_survives_a_restart(killed_and_restarted):
    # diloco_streaming (H = 4, two fragments, τ = 1): fragment 1 synchronises after step
    # 10, the checkpoint's step, and lands after step 11, in the restarted round
    run = killed_and_restarted
    assert run["algorithms"][-len(DILOCO):] == DILOCO
    assert not run["hung"] and run["exit_code"] == 0, run.get("log")
    assert run["restarts"] >= 1 and run["resumed_from"] == 10
    differ = [d for d in run["differ"] if d.split("/")[0] in DILOCO]
    assert differ == [], f"the restarted run's final state differs from the reference on {differ}"
    assert all(run["accuracy"][name] == run["reference_accuracy"][name] for name in DILOCO), run["accuracy"]
    assert run["left_behind"] == []


STUCK_ROUND = """
import os, time
import bagua_algos as bagua
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["RANK"] == "1":
    time.sleep(120)  # this round cannot form its group
start = time.monotonic()
try:
    bagua.init_process_group()
except TimeoutError as error:
    print(f"round failed after {time.monotonic() - start:.1f} s: {error}", flush=True)
    raise
print(f"round {os.environ['TORCHELASTIC_RESTART_COUNT']} rank {bagua.get_rank()} joined", flush=True)
bagua.barrier()
"""


def test_a_round_that_cannot_form_fails_within_init_timeout_and_the_next_one_trains(tmp_path):
    script = tmp_path / "stuck.py"
    script.write_text(STUCK_ROUND)
    env = {**child_env(), "BAGUA_ALGOS_INIT_TIMEOUT": "10"}
    proc = subprocess.Popen([sys.executable, "-m", "bagua_algos.launch", "--nproc_per_node", "2", "--max_restarts", "1",
                             "--master_port", str(free_port()), str(script)], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    started = time.monotonic()
    try:
        out, err = proc.communicate(timeout=100)
    finally:
        stop_launcher(proc, str(script))
    assert proc.returncode == 0, out + err[-3000:]
    assert "round 1 rank 0 joined" in out and "round 1 rank 1 joined" in out
    failed = re.search(r"round failed after ([\d.]+) s: rank 0: ranks \[1\] did not join within init_timeout=10 s",
                       out + err)
    assert failed and float(failed.group(1)) < 20, out + err[-3000:]
    assert time.monotonic() - started < 100
    assert processes_naming(str(script)) == []


def _stop_and_resume(directory: Path, nproc: int, steps: int):
    for old in directory.glob("result_rank*.json"):  # the previous launch's
        old.unlink()
    job = Job(directory, ["relay", "powersgd"], steps=steps, save_every=3, nproc=nproc, max_restarts=0)
    try:
        code = job.wait(150)
    finally:
        job.stop()
    assert code == 0, job.tail()
    return job.results(), (directory / "launcher.err").read_text()


def test_a_job_stopped_at_one_world_size_resumes_at_another(tmp_path):
    runs = [(4, 6), (2, 12), (4, 18)]
    for index, (nproc, steps) in enumerate(runs):
        results, err = _stop_and_resume(tmp_path, nproc, steps)
        assert sorted(r["rank"] for r in results) == list(range(nproc))
        assert {r["resumed_from"] for r in results} == {runs[index - 1][1] if index else 0}
        resized = re.findall(r"(\w+)Algorithm: state saved at world size (\d) is loaded at world size (\d)", err)
        if index:
            before = runs[index - 1][0]
            # one warning per algorithm and process (warnings print a line each)
            assert sorted(resized) == sorted([("PowerSGD", str(before), str(nproc)),
                                              ("Relay", str(before), str(nproc))] * nproc), err[-3000:]
        else:
            assert resized == []
    assert processes_naming(str(tmp_path)) == []


ORPHAN = """
import os, sys, time
import bagua_algos as bagua
bagua.init_process_group()
with open(os.path.join(sys.argv[1], f"pid{bagua.get_rank()}"), "w") as f:
    f.write(str(os.getpid()))
time.sleep(60)  # the agent is killed meanwhile
print("still running after 60 s", flush=True)
"""


def test_workers_stop_when_their_agent_is_killed(tmp_path):
    """An agent SIGKILLed (it starts its workers in sessions of their own, so they do not
    get its signals) leaves no orphan training on: each worker sees it gone and stops."""
    script = tmp_path / "orphan.py"
    script.write_text(ORPHAN)
    proc = subprocess.Popen([sys.executable, "-m", "bagua_algos.launch", "--nproc_per_node", "2",
                             "--master_port", str(free_port()), str(script), str(tmp_path)], cwd=REPO,
                            env=child_env(), text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    pids = []
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"pid{r}").exists() for r in range(2)) and time.monotonic() < deadline:
            time.sleep(0.2)
        pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
        proc.kill()  # the agent (the launcher runs it in-process)
        killed = time.monotonic()
        out, err = proc.communicate(timeout=30)  # EOF once the workers, which hold the pipes, are gone
        # A worker that has closed its pipes may still be ending (its exit hooks): each has
        # until 10 s after the kill to be gone.
        while any(_running(pid) for pid in pids) and time.monotonic() - killed < 10:
            time.sleep(0.1)
        stopped_after = time.monotonic() - killed
    finally:
        stop_launcher(proc, str(script))
        for pid in pids:  # the orphans, if the watch failed
            if _running(pid) and str(script).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)
    assert "still running" not in out
    assert err.count("that started this worker is gone; stopping this worker") == 2, err[-3000:]
    assert stopped_after < 10
    assert [pid for pid in pids if _running(pid)] == []


def _running(pid: int) -> bool:
    """Alive, and not a zombie waiting for whoever adopted it to reap it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
