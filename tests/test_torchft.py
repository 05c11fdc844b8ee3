"""Fault tolerance at the step on torchft, by injected faults, CPU and gloo.

Three replicas under ``python -m bagua_algos.launch --torchft``: one SIGKILLed (or
SIGSTOPped) at a chosen step; the others go on; every committed step is committed
once and in order; the survivors hold equal parameters at every step they committed.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

os.environ.setdefault("RUST_LOG", "error")  # the lighthouse started here logs every quorum otherwise
pytest.importorskip("torchft")

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "launch_workers" / "torchft_worker.py"
PHASES_WORKER = ROOT / "tests" / "launch_workers" / "torchft_phases_worker.py"


def _env():
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("BAGUA_ALGOS_FAULT_TOLERANCE", None)
    env["RUST_LOG"] = "error"
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp_path, *worker_args, nproc=3, min_replicas=2):
    cmd = [sys.executable, "-m", "bagua_algos.launch", "--torchft", "--nproc_per_node", str(nproc),
           "--min_replicas", str(min_replicas), "--join_timeout", "20", "--backend", "gloo", str(WORKER),
           "--log_dir", str(tmp_path), *worker_args]
    return subprocess.Popen(cmd, env=_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _records(tmp_path, replica):
    path = tmp_path / (replica + ".jsonl" if isinstance(replica, str) else f"node0_replica{replica}.jsonl")
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _committed(records):
    return [r for r in records if "step" in r]


def _check_survivors(tmp_path, steps, fault_step, survivors=(0, 1), victim=2):
    logs = {r: _records(tmp_path, r) for r in (*survivors, victim)}
    for r in survivors:
        assert logs[r][-1].get("done") == steps, (r, logs[r][-3:])
        done = [c["step"] for c in _committed(logs[r])]
        assert done == list(range(steps)), f"replica {r} committed {done}: a committed step lost or repeated"
        worlds = {c["step"]: c["world"] for c in _committed(logs[r])}
        assert worlds[0] == 3 and worlds[steps - 1] == 2, worlds
    first, second = (_committed(logs[r]) for r in survivors)
    for a, b in zip(first, second):
        assert a["params"] == b["params"], f"survivors differ after step {a['step']}"
    victim_steps = _committed(logs[victim])
    assert [c["step"] for c in victim_steps] == list(range(fault_step))
    for c in victim_steps:  # what the victim committed is what the others committed
        assert c["params"] == first[c["step"]]["params"]
    return logs


def test_a_killed_replica_is_dropped_and_the_others_go_on(tmp_path):
    steps, die_at = 8, 3
    job = _launch(tmp_path, "--steps", str(steps), "--die_at", str(die_at), "--timeout", "15")
    try:
        out, _ = job.communicate(timeout=150)
    finally:
        job.kill()
    assert job.returncode == 0, out[-3000:]
    assert "replica 2" in out and "SIGKILL" in out, out[-2000:]
    logs = _check_survivors(tmp_path, steps, die_at)
    # the step the kill interrupted was discarded on both survivors, then done again at world 2
    for r in (0, 1):
        assert any(rec.get("discarded") == die_at for rec in logs[r]), logs[r]


def test_a_hung_replica_is_dropped_within_the_timeout(tmp_path):
    steps, hang_at, timeout = 7, 3, 8.0
    job = _launch(tmp_path, "--steps", str(steps), "--hang_at", str(hang_at), "--timeout", str(timeout))
    try:
        deadline = time.time() + 150
        while time.time() < deadline:
            if all(_records(tmp_path, r) and _records(tmp_path, r)[-1].get("done") for r in (0, 1)):
                break
            assert job.poll() is None, job.stdout.read()[-3000:]
            time.sleep(0.5)
        else:
            pytest.fail("the survivors did not finish within 150 s")
        pid = _records(tmp_path, 2)[0]["pid"]
        os.kill(pid, signal.SIGKILL)  # the stopped replica: the launcher waits for every worker
        out, _ = job.communicate(timeout=30)
    finally:
        job.kill()
    logs = _check_survivors(tmp_path, steps, hang_at)
    for r in (0, 1):
        before = next(c["t"] for c in _committed(logs[r]) if c["step"] == hang_at - 1)
        after = next(c["t"] for c in _committed(logs[r]) if c["step"] == hang_at)
        assert after - before < 2 * timeout + 10, f"replica {r}: {after - before:.1f} s from the hang to a commit"


def test_unreachable_lighthouse_is_one_clear_line(tmp_path):
    port = _free_port()
    out = subprocess.run([sys.executable, "-m", "bagua_algos.launch", "--torchft", "--lighthouse",
                          f"http://127.0.0.1:{port}", str(WORKER), "--log_dir", str(tmp_path)],
                         env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    lines = [line for line in out.stderr.splitlines() if "lighthouse" in line]
    assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0] and "cannot be reached" in lines[0], out.stderr


def test_torchft_missing_is_one_clear_line(tmp_path):
    block = ("import sys\n"
             "class Block:\n"
             "    def find_spec(self, name, path=None, target=None):\n"
             "        if name == 'torchft' or name.startswith('torchft.'):\n"
             "            raise ImportError('No module named ' + repr(name))\n"
             "sys.meta_path.insert(0, Block())\n")
    launcher = block + ("from bagua_algos.launcher.launch import main\n"
                        f"main(['--torchft', {str(WORKER)!r}])\n")
    out = subprocess.run([sys.executable, "-c", launcher], env=_env(), cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().count("\n") == 0 and "pip install 'bagua-algos[torchft]'" in out.stderr, out.stderr
    in_python = block + ("import bagua_algos\n"
                         "try:\n"
                         "    bagua_algos.init_process_group(fault_tolerance='torchft')\n"
                         "except RuntimeError as e:\n"
                         "    print(e)\n")
    out = subprocess.run([sys.executable, "-c", in_python], env=_env(), cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert "pip install 'bagua-algos[torchft]'" in out.stdout, out.stdout + out.stderr


def test_a_lost_peer_is_told_from_a_slow_one():
    """A step that lost a peer tears its group down before the next quorum (so that a
    survivor blocked on a live peer is released at once); a timeout does not."""
    from bagua_algos.runtime.comm.fault_tolerance import peer_lost

    gloo = "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:{}] {} [127.0.0.1]:10657."
    assert peer_lost(RuntimeError(gloo.format(561, "Connection closed by peer")))
    assert peer_lost(RuntimeError(gloo.format(545, "Read error") + " Connection reset by peer"))
    assert not peer_lost(RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 8000ms "
                                      "for recv operation to complete"))


def _quorum_timeout_worker(rank, world):
    """start_step with a manager whose first quorum times out (as torchft's Rust client
    raises it), then succeeds: the first step is errored, not raised, and the next asks again."""
    from datetime import timedelta

    import torch.distributed as dist

    from bagua_algos.runtime.comm import fault_tolerance as ft

    class Manager:
        def __init__(self):
            self.calls, self.error, self._quorum_future, self._quorum_id = 0, None, None, 0

        def start_quorum(self):
            assert self._quorum_future is None, "the failed future was not dropped"
            self.calls += 1
            self.error = None
            if self.calls == 1:
                self._quorum_future = "failed future"
                raise TimeoutError('status: Cancelled, message: "Timeout expired"')
            self._quorum_future = "done"

        def report_error(self, exc):
            self.error = exc

        def errored(self):
            return self.error

    manager = Manager()
    saved = dict(ft._ft)
    ft._ft.update(manager=manager, errored=None, quorum_id=3, timeout=timedelta(seconds=5))
    try:
        first = (ft.start_step(), ft.step_errored(), ft._ft.get("unformed"), dist.get_world_size())
        second = (ft.start_step(), ft.step_errored(), manager.calls)
    finally:
        ft._ft.clear()
        ft._ft.update(saved)
    return first, second


def test_a_quorum_that_times_out_discards_the_step_and_the_next_asks_again():
    from bagua_algos.experiments.gloo_workers import run_workers

    first, second = run_workers(_quorum_timeout_worker, 2, timeout=60)[0]
    assert first[1] and not first[2]  # errored, the group kept
    assert second[1:] == (False, 2)


def test_unsupported_algorithms_are_refused_by_name():
    import torch

    from bagua_algos.runtime.algorithm import Algorithm
    from bagua_algos.runtime.fault_tolerant_step import check_supported

    from bagua_algos.algorithms.table import ALGORITHM_TABLE

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(NotImplementedError, match="AsyncModelAverageAlgorithm is not supported under torchft.*"
                                                  "background thread"):
        check_supported(Algorithm.init("async"), [opt], None)
    for config in ALGORITHM_TABLE:  # every other row of the table runs
        if config.name != "async":
            own = config.optimizer_for(model.parameters(), lambda ps: opt)
            check_supported(config.build(own), [own], None)


# --- every algorithm family under a kill and a return ------------------------------------

def _survivors_went_on(log_dir, phase, phase_steps, world):
    """Whether replica r0 committed a step of ``phase`` without the victim."""
    return any(r.get("world", world) < world and r["step"] // phase_steps == phase
               for r in _records(log_dir, "r0") if "step" in r)


def run_phases(log_dir, labels, phase_steps=10, kill_at=2, world=3, min_replicas=2, timeout=20.0, deadline=600):
    """``world`` replicas (r0 … r{world-1}) over one lighthouse started here train the
    rows ``labels`` one after another (tests/launch_workers/torchft_phases_worker.py);
    the last replica SIGKILLs itself at local step ``kill_at`` of every phase, and a warm
    standby (started ahead, already past its imports) takes its place at once, with the
    same replica id, and heals from a live peer. Returns {replica: [records]}; every
    process started here is killed on the way out."""
    from torchft.coordination import LighthouseServer

    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=min_replicas, join_timeout_ms=2000,
                                  heartbeat_timeout_ms=2000)
    address = f"http://127.0.0.1:{lighthouse.address().rstrip('/').rpartition(':')[2]}"
    victim = f"r{world - 1}"
    procs = []

    def start(replica, start_phase=0, wait_file=""):
        env = _env()
        # the job's replicas, and a secret that signs the healing state (as the launcher sets them)
        env.update(BAGUA_ALGOS_FAULT_TOLERANCE="torchft", TORCHFT_LIGHTHOUSE=address,
                   BAGUA_ALGOS_MIN_REPLICAS=str(min_replicas), BAGUA_ALGOS_REPLICA_ID=replica,
                   BAGUA_ALGOS_JOB_REPLICAS=",".join(f"r{i}" for i in range(world)),
                   BAGUA_ALGOS_JOB_SECRET="phases-test-secret")
        cmd = [sys.executable, "-u", str(PHASES_WORKER), "--labels", ",".join(labels), "--phase_steps",
               str(phase_steps), "--kill_at", str(kill_at), "--victim", victim, "--world", str(world),
               "--start_phase", str(start_phase), "--log_dir", str(log_dir), "--timeout", str(timeout)]
        if wait_file:
            cmd += ["--wait_file", wait_file]
        out = open(log_dir / f"{replica}.{len(procs)}.out", "w")
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        procs.append(proc)
        return proc

    try:
        workers = [start(f"r{i}") for i in range(world)]
        current = workers[-1]
        standby, go = None, None
        end = time.time() + deadline
        phase = 0
        went_on_by = float("inf")
        while time.time() < end:
            if all(p.poll() is not None for p in workers[:-1]) and current.poll() is not None:
                break
            if standby is None and phase + 1 < len(labels) + 1 and kill_at >= 0:
                go = log_dir / f"go{phase}"
                standby = start(victim, phase, str(go))
            if kill_at >= 0 and current.poll() is not None and current.returncode == -signal.SIGKILL and (
                    _survivors_went_on(log_dir, phase, phase_steps, world) or time.time() > went_on_by):
                go.touch()  # the victim died and the others went on: its standby rejoins in that phase
                current, standby = standby, None
                phase += 1
                went_on_by = float("inf")
            elif kill_at >= 0 and current.poll() is not None and went_on_by == float("inf"):
                went_on_by = time.time() + 60
            time.sleep(0.1)
        else:
            pytest.fail(f"the run did not finish within {deadline} s")
        for p in workers[:-1]:
            assert p.returncode == 0, (p.args, p.returncode)
        return {f"r{i}": _records(log_dir, f"r{i}") for i in range(world)}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)
        lighthouse.shutdown()


FAMILIES = {  # one row per family; the keys each heals with (its algorithm state, in bagua_state_dict)
    "gradient_allreduce": ("all-reduce", set()),
    "decentralized_ring": ("gossip", {"decentralized_exchanges"}),
    "relay_binary_tree": ("relay", {"relay_received", "received_counts", "generator"}),
    "powersgd": ("compressor with error feedback", {"error", "q"}),
    "diloco": ("diloco-like", {"diloco_outer", "diloco_momentum"}),
}


def check_phases(logs, labels, phase_steps, world=3, survivors=("r0", "r1"), victim="r2", expect_keys=None):
    """Survivors go on and commit every step once, in order; the replicas that should
    agree do; each returning replica holds what a live peer served it (model, optimizer,
    algorithm state), in the phase it died in; gossip's and relay's graphs span each quorum."""
    from bagua_algos.algorithms.table import config_by_label

    total = len(labels) * phase_steps
    committed = {r: [c for c in logs[r] if "step" in c] for r in logs}
    for r in survivors:
        assert logs[r][-1].get("done") == total, (r, logs[r][-3:])
    for r in logs:  # each replica commits each step once, in order; it skips steps only by healing past them
        steps = [c["step"] for c in committed[r]]
        assert steps == sorted(set(steps)), f"{r} committed {steps}: a step repeated or out of order"
        healed_to = {h["healed"] for h in logs[r] if "healed" in h}
        for a, b in zip(steps, steps[1:]):
            assert b == a + 1 or b in healed_to or any(a < k for k in (x.get("killed", -1) for x in logs[r])), \
                f"{r} went from step {a} to {b} without healing"
    union = sorted({c["step"] for r in logs for c in committed[r]})
    assert union == list(range(total)), f"committed steps {union}: a committed step lost"
    served = {(s["served"], s["digest"]) for r in logs for s in logs[r] if "served" in s}
    heals = [h for h in logs[victim] if "healed" in h and h["healed"] > 0]
    kills = [k["killed"] for k in logs[victim] if "killed" in k]
    assert [k // phase_steps for k in kills] == list(range(len(labels))), kills
    by_step = {}
    for r in logs:
        for c in committed[r]:
            by_step.setdefault(c["step"], {})[r] = c
    for phase, label in enumerate(labels):
        config = config_by_label(label)
        in_phase = {s: by_step[s] for s in range(phase * phase_steps, (phase + 1) * phase_steps)}
        assert any(c["world"] == world - 1 for s in in_phase.values() for c in s.values()), \
            f"{label}: the survivors did not go on without the killed replica"
        heal = [h for h in heals if h["phase"] == phase]
        assert heal, f"{label}: the returning replica did not heal in phase {phase}"
        for h in heal:
            assert (h["healed"], h["digest"]) in served, f"{label}: healed state {h} is not one a peer served"
            if expect_keys and label in expect_keys:
                missing = expect_keys[label] - set(h["bagua_keys"])
                assert not missing, f"{label}: the healing state lacks the algorithm's {missing}"
        back = heal[-1]["healed"]
        assert any(len(s) == world and s[victim]["world"] == world for st, s in in_phase.items() if st >= back), \
            f"{label}: the returning replica did not commit a step in the full quorum"
        for step, s in in_phase.items():
            for c in s.values():
                if "topology" in c:
                    name, n, neighbours = c["topology"]
                    assert n == c["world"] and all(0 <= j < n for j in neighbours), (label, step, c["topology"])
            if config.replicas == "equal":  # one model everywhere, at every committed step
                digests = {c["params_digest"] for c in s.values()}
                assert len(digests) == 1, f"{label}: replicas differ after step {step}: {sorted(s)}"
        if label == "diloco":  # the outer step leaves every replica equal, the returned one too
            assert any(len(s) == world and len({c["params_digest"] for c in s.values()}) == 1
                       for st, s in in_phase.items() if st >= back), f"{label}: no outer step agreed after the return"


def test_every_family_survives_a_kill_and_the_returning_replica_heals(tmp_path):
    labels, phase_steps = list(FAMILIES), 8
    t0 = time.time()
    logs = run_phases(tmp_path, labels, phase_steps=phase_steps, kill_at=2, deadline=420)
    check_phases(logs, labels, phase_steps, expect_keys={k: v[1] for k, v in FAMILIES.items()})
    print(f"{len(labels)} families, a kill and a return each: {time.time() - t0:.1f} s")


# --- Bagua's programs under the flag, unchanged ------------------------------------------------

def _readme_script() -> str:
    """The README's training script (its "## Use" section), as it stands."""
    text = (ROOT / "README.md").read_text()
    start = text.index("```python", text.index("## Use")) + len("```python")
    return text[start:text.index("```", start)]


def test_baguas_programs_run_unchanged_under_the_flag(tmp_path):
    """The README's script and Bagua's elastic example (tests/launch_workers/bagua_elastic_mnist.py,
    examples/elastic_training/main.py retold) under ``--torchft``, two replicas, no code changed."""
    from mnist_files import write_mnist

    from bagua_algos.compat import compat_path

    (tmp_path / "train.py").write_text(_readme_script())
    write_mnist(tmp_path / "data", train=128, test=64)
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join([compat_path(), str(ROOT), env["PYTHONPATH"]])
    jobs = {
        "readme": [sys.executable, "-m", "bagua_algos.launch", "--torchft", "--nproc_per_node", "2",
                   "--min_replicas", "2", "--backend", "gloo", str(tmp_path / "train.py")],
        "elastic_example": [sys.executable, "-m", "bagua.distributed.launch", "--torchft", "--nproc_per_node", "2",
                            "--min_replicas", "2", "--backend", "gloo",
                            str(ROOT / "tests" / "launch_workers" / "bagua_elastic_mnist.py"), "--epochs", "2",
                            "--data_dir", str(tmp_path / "data"), "--checkpoint_path", str(tmp_path / "mnist.ckpt"),
                            "--events", str(tmp_path / "events.jsonl")],
    }
    procs = {name: subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True) for name, cmd in jobs.items()}
    outs = {}
    try:
        for name, proc in procs.items():
            outs[name], _ = proc.communicate(timeout=240)
    finally:
        for proc in procs.values():
            proc.kill()
    assert procs["readme"].returncode == 0, outs["readme"][-3000:]
    # (the workers share the launcher's stdout, so two lines may arrive run together)
    assert sorted(re.findall(r"(worker \d+): last loss", outs["readme"])) == \
        ["worker 0", "worker 1"], outs["readme"][-3000:]
    assert procs["elastic_example"].returncode == 0, outs["elastic_example"][-3000:]
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    done = [e for e in events if e["event"] == "done"]
    assert len(done) == 2 and all(e["world"] == 2 for e in done), events[-4:]
    assert (tmp_path / "mnist.ckpt").exists()


def test_shift_one_gossips_with_all_over_an_odd_quorum(tmp_path):
    """shift_one pairs the workers up: with 4 replicas, one killed, the 3 survivors gossip
    with every peer ("all") until the returning replica makes the quorum even again."""
    labels = ["decentralized_shift_one"]
    logs = run_phases(tmp_path, labels, phase_steps=8, kill_at=2, world=4, deadline=420)
    check_phases(logs, labels, 8, world=4, survivors=("r0", "r1", "r2"), victim="r3")
