"""Fault tolerance at the step on torchft (issue 44), by injected faults, CPU and gloo.

Three replicas under ``python -m bagua_algos.launch --torchft``: one SIGKILLed (or
SIGSTOPped) at a chosen step; the others go on; every committed step is committed
once and in order; the survivors hold equal parameters at every step they committed.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torchft")

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "launch_workers" / "torchft_worker.py"


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
    path = tmp_path / f"node0_replica{replica}.jsonl"
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


def test_unsupported_algorithms_are_refused_by_name():
    import torch

    from bagua_algos.runtime.algorithm import Algorithm
    from bagua_algos.runtime.fault_tolerant_step import check_supported

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(NotImplementedError, match="DecentralizedAlgorithm is not supported under torchft"):
        check_supported(Algorithm.init("decentralized"), [opt], None)
    check_supported(Algorithm.init("gradient_allreduce"), [opt], None)
