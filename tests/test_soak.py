"""``bagua-algos soak``: a short soak under ``--torchft`` (one replica killed and started
again) loses no committed step and its survivors agree; Ctrl-C in the middle of one
leaves no process behind; what it measures, on logs made here; bad flags are one line each."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchft")

from bagua_algos.experiments import soak  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _env():
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), RUST_LOG="error")
    env.pop("BAGUA_ALGOS_FAULT_TOLERANCE", None)
    return env


def _workers_under(path: Path) -> list[int]:
    """Processes still running whose command line names ``path`` (the soak's replicas log there)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if str(path).encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    found.append(int(entry))
            except OSError:
                pass
    return found


def test_a_short_soak_with_one_kill_loses_nothing_and_the_survivors_agree(tmp_path):
    out_dir = tmp_path / "soak"
    # 15 s of faults, the first at 8-14 s, the next at least 8 s later, past the end: exactly
    # one kill, with committed steps before it. The window's length is not what is checked
    # (no step lost, the killed replica back, the replicas agree): what comes after the
    # window (the rejoin, the common stop) is waited for by the soak itself, within bounds
    cmd = [sys.executable, "-m", "bagua_algos.experiments.cli", "soak", "--minutes", "0.25", "--replicas", "3",
           "--algorithms", "gradient_allreduce", "--kill-every", "8:14", "--baseline-fraction", "0",
           "--out-dir", str(out_dir)]
    proc = subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    row = json.loads((out_dir / "soak.json").read_text())["rows"][0]["soak"]
    assert row["kills"] == 1 and row["hangs"] == 0 and row["died"] == 0, row["faults"]
    assert row["starts"] == 4  # three replicas, the killed one started again by the soak
    assert row["steps_lost"] == 0 and row["went_backwards"] == {}, row
    assert row["final_is_max"] and row["unfinished"] == [] and row["not_rejoined"] == [], row
    final = row["last_committed_step"] + 1  # every replica ends at the last committed step, at or past stop_at
    assert final >= row["stop_at"] and row["finals"] == {f"node0_replica{i}": final for i in range(3)}
    assert row["agreement"]["replicas_compared"] == 3 and row["agreement"]["agree"] is True, row["agreement"]
    assert row["committed_in_window"] > 0 and row["steps_per_second"] > 0
    assert "gradient_allreduce" in proc.stdout and "equal (3)" in proc.stdout, proc.stdout[-2000:]
    assert _workers_under(out_dir) == [], "a replica of the soak is still running"


def _write_logs(logs: Path, per_replica: dict):
    logs.mkdir(parents=True)
    for who, records in per_replica.items():
        (logs / f"{who}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_measure_finds_a_lost_step_a_step_back_and_a_stall(tmp_path):
    ok = [{"start": True, "t": 0.0}] + [{"step": s, "t": 1.0 + 0.1 * s, "world": 2} for s in range(10)]
    ok.append({"final": 10, "accuracy": 0.5, "t": 3.0})
    _write_logs(tmp_path / "good", {"a": ok, "b": ok})
    good = soak.measure(tmp_path / "good", 0.0, 5.0, 0.5, stop_at=10, must_agree=False)
    assert (good["steps_lost"], good["went_backwards"], good["stalls"], good["final_is_max"]) == (0, {}, 0, True)
    assert good["committed_in_window"] == 10 and good["steps_per_second"] == 2.0

    # step 4 committed by no one; b goes back from 6 to 5; a gap of 2 s between steps 7 and 8
    a = [{"step": s, "t": 1.0 + 0.1 * s + (2.0 if s >= 8 else 0.0)} for s in range(10) if s != 4]
    b = [{"step": s, "t": 1.0 + 0.1 * s} for s in (0, 1, 6, 5)]
    _write_logs(tmp_path / "bad", {"a": a + [{"final": 10, "accuracy": 0.5, "t": 9.0}],
                                   "b": b + [{"final": 7, "accuracy": 0.5, "t": 9.0}]})
    bad = soak.measure(tmp_path / "bad", 0.0, 5.0, 0.5, stop_at=10, must_agree=False)
    assert bad["lost"] == [4] and bad["went_backwards"] == {"b": 1}
    assert bad["stalls"] == 1 and bad["stall_seconds_max"] == pytest.approx(2.1, abs=0.01)
    assert not bad["final_is_max"]  # b ended below the last committed step


@pytest.mark.parametrize("flags, named", [
    (["--minutes", "0"], "--minutes"),
    (["--minutes", "x"], "--minutes"),
    (["--replicas", "1"], "--replicas"),
    (["--replicas", "3", "--min-replicas", "3"], "--min-replicas"),
    (["--algorithms", "gradient_allreduce,nope"], "--algorithms"),
    (["--algorithms", "async"], "--algorithms"),
    (["--kill-every", "40:20"], "--kill-every"),
    (["--kill-every", "20"], "--kill-every"),
    (["--baseline-fraction", "1"], "--baseline-fraction"),
])
def test_bad_flags_are_one_line_naming_the_flag(flags, named, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_:
        soak.main([*flags, "--out-dir", str(tmp_path / "never")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.count("\n") == 1 and named in err and err.startswith("bagua-algos soak: "), err
    assert not (tmp_path / "never").exists()


def test_ctrl_c_stops_every_process_the_soak_started(tmp_path):
    import signal
    import time

    out_dir = tmp_path / "soak"
    cmd = [sys.executable, "-m", "bagua_algos.experiments.cli", "soak", "--minutes", "2", "--replicas", "3",
           "--algorithms", "decentralized_ring", "--kill-every", "2:4", "--hang", "--baseline-fraction", "0",
           "--out-dir", str(out_dir)]
    proc = subprocess.Popen(cmd, env=_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 150
        line = ""
        while not line.startswith(("  SIGKILL", "  SIGSTOP")):  # faults under way, replicas started again
            assert time.time() < deadline and proc.poll() is None, f"no fault within 150 s (status {proc.poll()})"
            line = proc.stdout.readline()
        time.sleep(3)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "interrupted" in err, err[-2000:]
    assert (out_dir / "soak.json").exists() and (out_dir / "decentralized_ring" / "soak" / "logs").exists()
    assert _workers_under(out_dir) == [], "a replica of the soak is still running"
