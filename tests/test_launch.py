"""Tests of ``python -m bagua_algos.launch`` (Bagua's launcher flags on torchrun).

The job tests start real launchers as subprocesses; every one of them runs in
its own session with a hard timeout, and is killed with its workers if it
overruns.
"""

import json
import time
from pathlib import Path

import pytest

from subprocesses import REPO, TIMEOUT, child_env, finish, free_port, start_python

from bagua_algos.runtime import launch

WORKERS = Path(__file__).resolve().parent / "launch_workers"


def start_launcher(args, env=None):
    return start_python(["-m", "bagua_algos.launch", *args], env)


def run_launcher(args, env=None, timeout=TIMEOUT):
    return finish(start_launcher(args, env), timeout)


# --------------------------------------------------------------------------
# flag handling, in process (no torch start-up)
# --------------------------------------------------------------------------

@pytest.mark.parametrize("argv, flag, detail", [
    (["--nproc_per_node", "0", "t.py"], "--nproc_per_node", ">= 1"),
    (["--nnodes", "2", "--node_rank", "2", "t.py"], "--node_rank", "[0, 2)"),
    (["--node_rank", "-1", "t.py"], "--node_rank", "[0, 1)"),
    (["--nnodes", "0", "t.py"], "--nnodes", ">= 1"),
    (["--master_port", "70000", "t.py"], "--master_port", "[1, 65535]"),
    (["--max_restarts", "-1", "t.py"], "--max_restarts", ">= 0"),
    (["-m", "--no_python", "t"], "--module", "--no_python"),
    (["--nproc_per_node", "2"], "training_script", "missing"),
    (["--nproc_per_node", "two", "t.py"], "--nproc_per_node", "invalid int"),
])
def test_bad_flags_are_argparse_errors(argv, flag, detail, capsys):
    with pytest.raises(SystemExit) as exc:
        launch.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err or f"argument -m/{flag}" in err, err
    assert detail in err, err


def test_bad_flag_from_command_line():
    code, _, err = run_launcher(["--nnodes", "2", "--node_rank", "5", "t.py"], timeout=60)
    assert code == 2
    assert "argument --node_rank" in err and "[0, 2)" in err


def test_translation_to_torchrun():
    from torch.distributed import run as torchrun

    args = launch.parse_args([
        "--nnodes", "2", "--node_rank", "1", "--nproc_per_node", "3",
        "--master_addr", "10.1.2.3", "--master_port", "1234", "-m",
        "--logdir", "logs", "--set_additional_flag", "--max_restarts", "2",
        "--rdzv_timeout", "45", "--autotune_level", "1",
        "pkg.train", "--lr", "0.1", "--nnodes", "7"])
    targs = torchrun.parse_args(launch.torchrun_argv(args))
    assert (targs.nnodes, targs.nproc_per_node) == ("2", "3")
    assert targs.rdzv_backend == "static" and targs.node_rank == 1
    assert (targs.master_addr, targs.master_port) == ("10.1.2.3", 1234)
    assert targs.module and not targs.no_python
    assert (targs.log_dir, targs.redirects) == ("logs", "3")
    assert targs.max_restarts == 2 and targs.rdzv_conf == "timeout=45"
    assert targs.training_script == "pkg.train"
    # the script's own flags (even ones named like ours) are left alone
    assert targs.training_script_args == [
        "--local_rank=${local_rank}", "--lr", "0.1", "--nnodes", "7"]
    assert launch.ignored_flag_notices(args) == [
        "bagua_algos.launch: ignoring Bagua-only flag --autotune_level=1"]


def test_all_bagua_only_flags_are_accepted():
    args = launch.parse_args([
        "--bagua_service_port", "29501", "--autotune_level", "0",
        "--autotune_log_file", "/tmp/x", "--is_output_autotune_log",
        "--report_metrics", "--autotune_max_samples", "60",
        "--autotune_sampling_confidence_time", "5.0",
        "--autotune_warmup_time", "30", "--default_bucket_size", "1024",
        "--enable_bagua_net", "--host_list", "a,b", "--ssh_port", "22", "t.py"])
    notices = launch.ignored_flag_notices(args)
    assert len(notices) == len(launch.BAGUA_ONLY_FLAGS)
    assert "bagua_algos.launch: ignoring Bagua-only flag --enable_bagua_net" in notices
    assert "bagua_algos.launch: ignoring Bagua-only flag --host_list=a,b" in notices
    assert launch.ignored_flag_notices(launch.parse_args(["t.py"])) == []


# --------------------------------------------------------------------------
# real jobs
# --------------------------------------------------------------------------

def test_two_nodes_by_two_processes(tmp_path):
    port = free_port()
    common = ["--nnodes", "2", "--nproc_per_node", "2",
              "--master_addr", "127.0.0.1", "--master_port", port,
              str(WORKERS / "allreduce_env.py"), tmp_path]
    procs = [start_launcher(["--node_rank", r, *common]) for r in (0, 1)]
    results = [finish(p) for p in procs]
    for node, (code, out, err) in enumerate(results):
        assert code == 0, f"node {node} launcher exited {code}\n{out}\n{err}"

    records = [json.loads((tmp_path / f"rank_{r}.json").read_text()) for r in range(4)]
    assert [rec["RANK"] for rec in records] == ["0", "1", "2", "3"]
    assert [rec["NODE_RANK"] for rec in records] == ["0", "0", "1", "1"]
    assert [rec["GROUP_RANK"] for rec in records] == ["0", "0", "1", "1"]
    assert [rec["LOCAL_RANK"] for rec in records] == ["0", "1", "0", "1"]
    assert {rec["WORLD_SIZE"] for rec in records} == {"4"}
    assert {rec["LOCAL_WORLD_SIZE"] for rec in records} == {"2"}
    assert {rec["MASTER_ADDR"] for rec in records} == {"127.0.0.1"}
    assert {rec["MASTER_PORT"] for rec in records} == {str(port)}
    assert {rec["allreduce_sum"] for rec in records} == {6.0}
    assert [rec["comm"] for rec in records] == [[0, 2, 0], [1, 2, 0], [0, 2, 1], [1, 2, 1]]


def test_worker_failure_stops_the_job_fast():
    start = time.monotonic()
    code, out, err = run_launcher([
        "--nproc_per_node", "2", "--master_port", free_port(),
        WORKERS / "fail_rank1.py"], timeout=90)
    elapsed = time.monotonic() - start
    assert code == 3, f"exit {code}\n{out}\n{err}"
    # rank 0 would sit in its barrier for 30 s (and then sleep); the launcher
    # must have stopped it long before that
    assert elapsed < 25, f"took {elapsed:.1f}s"
    summary = [line for line in err.splitlines()
               if line.startswith("bagua_algos.launch: job failed:")]
    assert len(summary) == 1, err
    assert "worker rank 1" in summary[0] and "exited with code 3" in summary[0]


def test_bagua_only_flag_notice_and_job_runs(tmp_path):
    code, out, err = run_launcher([
        "--master_port", free_port(), "--autotune_level", "1", "--enable_bagua_net",
        WORKERS / "allreduce_env.py", tmp_path])
    assert code == 0, f"{out}\n{err}"
    lines = err.splitlines()
    assert "bagua_algos.launch: ignoring Bagua-only flag --autotune_level=1" in lines
    assert "bagua_algos.launch: ignoring Bagua-only flag --enable_bagua_net" in lines
    record = json.loads((tmp_path / "rank_0.json").read_text())
    assert record["WORLD_SIZE"] == "1" and record["NODE_RANK"] == "0"


def test_module_with_logdir_and_local_rank_flag(tmp_path):
    out_file = tmp_path / "module.json"
    logdir = tmp_path / "logs"
    code, out, err = run_launcher([
        "--master_port", free_port(), "-m", "--set_additional_flag",
        "--logdir", logdir, "echo_module", out_file, "--foo", "bar"],
        env=child_env(extra_path=[WORKERS]))
    assert code == 0, f"{out}\n{err}"
    record = json.loads(out_file.read_text())
    assert record["name"] == "__main__"
    assert record["argv"] == ["--local_rank=0", str(out_file), "--foo", "bar"]
    assert record["RANK"] == "0" and record["NODE_RANK"] == "0"
    # the worker's stdout went to a file under --logdir, not to the console
    logs = list(logdir.rglob("stdout.log"))
    assert len(logs) == 1, list(logdir.rglob("*"))
    assert "echo_module running as __main__ rank=0" in logs[0].read_text()
    assert "echo_module running" not in out
