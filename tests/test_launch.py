"""Tests of ``python -m bagua_algos.launch`` (Bagua's launcher flags on torchrun).

The job tests start real launchers as subprocesses; every one of them runs in
its own session with a hard timeout, and is killed with its workers if it
overruns.
"""

import json
import os
import time
from pathlib import Path

import pytest

from subprocesses import REPO, TIMEOUT, child_env, finish, free_port, start_python

from bagua_algos.launcher import launch

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
    (["--nproc_per_node", "two", "t.py"], "--nproc_per_node", "a number >= 1 or one of auto, cpu, gpu"),
    # Bagua's run flags
    (["--nnodes", "3:1", "t.py"], "--nnodes", "1 <= MIN <= MAX"),
    (["--nnodes", "1:2:3", "t.py"], "--nnodes", "MIN:MAX (such as 2 or 1:4)"),
    (["--nnodes", "1:2", "t.py"], "--nnodes", "needs --rdzv_backend c10d"),
    (["--rdzv_backend", "etcd", "t.py"], "--rdzv_backend", "choose from 'static', 'c10d'"),
    (["--rdzv_backend", "c10d", "--nnodes", "2", "t.py"], "--rdzv_endpoint", "required with --rdzv_backend c10d"),
    (["--rdzv_endpoint", "host:99999", "--rdzv_backend", "c10d", "t.py"], "--rdzv_endpoint", "[1, 65535]"),
    (["--rdzv_endpoint", "host", "t.py"], "--rdzv_endpoint", "the static rendezvous needs a port"),
    (["--rdzv_conf", "join_timeout", "t.py"], "--rdzv_conf", "is not KEY=VALUE"),
    (["--rdzv_backend", "c10d", "--rdzv_conf", "join_timout=5", "t.py"], "--rdzv_conf",
     "'join_timout' is not read by the c10d rendezvous (its keys: join_timeout"),
    (["--rdzv_backend", "c10d", "--rdzv_conf", "timeout=5", "t.py"], "--rdzv_conf", "join_timeout is the join timeout"),
    (["--rdzv_backend", "c10d", "--rdzv_conf", "read_timeout=-1", "t.py"], "--rdzv_conf",
     "read_timeout must be a whole number >= 1, got '-1'"),
    (["--rdzv_conf", "timeout=9", "--rdzv_timeout", "5", "t.py"], "--rdzv_timeout", "gives timeout already"),
    (["--standalone", "--nnodes", "2", "t.py"], "--standalone", "runs one node"),
    (["--monitor_interval", "0", "t.py"], "--monitor_interval", "positive number of seconds"),
    (["--start_method", "thread", "t.py"], "--start_method", "choose from 'spawn', 'fork', 'forkserver'"),
    (["--redirects", "4", "t.py"], "--redirects", "0 (none), 1 (stdout), 2 (stderr), 3 (both)"),
    (["--tee", "0:1,x", "t.py"], "--tee", "LOCAL_RANK:VALUE pairs"),
    (["--run_path", "-m", "t"], "--run_path", "not allowed with -m/--module"),
    (["--logdir", "a", "--log_dir", "b", "t.py"], "--logdir", "not allowed with argument --log_dir"),
    (["--default_bucket_size", "0", "t.py"], "--default_bucket_size", "positive number of bytes"),
    # --torchft: a quorum of at least one replica, at most the replicas launched; one lighthouse
    (["--torchft", "--min_replicas", "0", "t.py"], "--min_replicas", "must be in [1, 1] (nnodes x nproc_per_node"),
    (["--torchft", "--min_replicas", "-1", "t.py"], "--min_replicas", "got -1"),
    (["--torchft", "--min_replicas", "3", "--nproc_per_node", "2", "t.py"], "--min_replicas",
     "must be in [1, 2] (nnodes x nproc_per_node = 1 x 2), got 3"),
    (["--torchft", "--nnodes", "2", "--lighthouse", "http://h:1", "--min_replicas", "5", "--nproc_per_node", "2",
      "t.py"], "--min_replicas", "[1, 4]"),
    (["--torchft", "--nnodes", "2", "t.py"], "--lighthouse", "needs one lighthouse for all of them"),
])
def test_bad_flags_are_argparse_errors(argv, flag, detail, capsys):
    with pytest.raises(SystemExit) as exc:
        launch.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}:" in err or f"/{flag}:" in err, err  # -m/--module, -r/--redirects
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
    assert launch.ignored_flags_warning(args) == (
        "bagua_algos.launch: warning: ignoring --autotune_level=1: Bagua's autotune service, Bagua-Net, "
        "metrics and host lists are not part of bagua-algos")


def test_baguas_run_flags_reach_torchrun():
    """bagua.distributed.run's flags, elastic c10d, as torchrun reads them; and that
    entry point's defaults are Bagua 0.9's run.py's."""
    from torch.distributed import run as torchrun

    args = launch.parse_args([
        "--nnodes", "1:4", "--nproc_per_node", "2", "--rdzv_backend", "c10d",
        "--rdzv_endpoint", "10.1.2.3:29400", "--rdzv_id", "job7", "--rdzv_conf", "read_timeout=5,is_host=false",
        "--rdzv_timeout", "30", "--max_restarts", "1", "--monitor_interval", "0.5", "--start_method", "fork",
        "--role", "trainer", "--run_path", "--log_dir", "logs", "--redirects", "0:3,1:2", "--tee", "1",
        "--node_rank", "3", "--use_env", "--local_addr", "10.1.2.4", "train.py", "--lr", "0.1"])
    targs = torchrun.parse_args(launch.torchrun_argv(args))
    assert (targs.nnodes, targs.nproc_per_node, targs.rdzv_backend) == ("1:4", "2", "c10d")
    assert (targs.rdzv_endpoint, targs.rdzv_id, targs.role) == ("10.1.2.3:29400", "job7", "trainer")
    assert targs.rdzv_conf == "read_timeout=5,is_host=false,join_timeout=30"
    assert (targs.max_restarts, targs.monitor_interval, targs.start_method) == (1, 0.5, "fork")
    assert targs.run_path and not targs.module and not targs.no_python
    assert (targs.log_dir, targs.redirects, targs.tee) == ("logs", "0:3,1:2", "1")
    assert targs.node_rank == 0  # c10d numbers the nodes itself
    assert targs.local_addr == "10.1.2.4"
    assert targs.training_script == "train.py" and targs.training_script_args == ["--lr", "0.1"]
    standalone = torchrun.parse_args(launch.torchrun_argv(launch.parse_args(["--standalone", "t.py"])))
    assert standalone.standalone

    run = launch.parse_args(["t.py"], launch.build_parser(launch.RUN_PROG))
    assert (run.nnodes, run.nproc_per_node, run.max_restarts, run.monitor_interval) == ((1, 1), "auto", 3, 5.0)
    assert (run.rdzv_backend, run.rdzv_id, run.start_method, run.redirects) == ("static", "none", "spawn", "0")
    plain = launch.parse_args(["t.py"])
    assert (plain.nproc_per_node, plain.max_restarts, plain.monitor_interval) == (1, 0, None)


def test_bagua_service_flags_are_accepted_with_one_warning():
    args = launch.parse_args([
        "--bagua_service_port", "29501", "--autotune_level", "0",
        "--autotune_log_file", "/tmp/x", "--is_output_autotune_log",
        "--report_metrics", "--autotune_max_samples", "60",
        "--autotune_sampling_confidence_time", "5.0",
        "--autotune_warmup_time", "30", "--default_bucket_size", "1024",
        "--enable_bagua_net", "--bagua-net_switch_on", "--host_list", "a,b", "--ssh_port", "22", "t.py"])
    warning = launch.ignored_flags_warning(args)
    assert warning.startswith("bagua_algos.launch: warning: ignoring --bagua_service_port=29501, --autotune_level=0")
    for shown in ("--enable_bagua_net", "--bagua-net_switch_on", "--host_list=a,b", "--ssh_port=22"):
        assert shown in warning
    assert "--default_bucket_size" not in warning  # honoured: with_bagua's default bucket size
    assert args.default_bucket_size == 1024
    assert launch.ignored_flags_warning(launch.parse_args(["t.py"])) is None


def _usage_error(argv, capsys) -> str:
    """The one error line of ``launch.main(argv)``, which must exit with status 2."""
    with pytest.raises(SystemExit) as exc:
        launch.main([str(a) for a in argv])
    assert exc.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2 and lines[0].startswith("usage: "), lines
    return lines[1]


# Every flag in Bagua's spelling with a value, and the script: the spellings must agree.
# Two command lines, as some flags exclude others (--logdir/--log_dir, --no_python/--run_path).
BAGUA_RUN_SPELLED = [
    "--nnodes", "1:2", "--nproc_per_node", "2", "--rdzv_backend", "c10d", "--rdzv_endpoint", "h:29400",
    "--rdzv_id", "j", "--rdzv_conf", "read_timeout=5", "--local_addr", "h1", "--monitor_interval", "1",
    "--start_method", "fork", "--run_path", "--log_dir", "logs", "--use_env", "--bagua-net_switch_on",
    "train.py", "--script_flag", "1"]
BAGUA_SPELLED = [
    "--nnodes", "2", "--node_rank", "1", "--nproc_per_node", "3", "--master_addr", "10.1.2.3",
    "--master_port", "1234", "--no_python", "--logdir", "logs", "--set_additional_flag",
    "--max_restarts", "2", "--rdzv_timeout", "45", "--backend", "gloo", "--no_bagua_compat",
    "--bagua_service_port", "29501", "--autotune_level", "0", "--autotune_log_file", "/tmp/x",
    "--is_output_autotune_log", "--report_metrics", "--autotune_max_samples", "60",
    "--autotune_sampling_confidence_time", "5.0", "--autotune_warmup_time", "30",
    "--default_bucket_size", "1024", "--enable_bagua_net", "--host_list", "a,b", "--ssh_port", "22",
    "--torchft", "--lighthouse", "http://h1:29510", "--min_replicas", "2", "--join_timeout", "5",
    "--heartbeat_timeout", "3",
    "train.py", "--script_flag", "1"]


def test_every_flag_is_accepted_in_torchruns_spelling_too():
    given = set()
    for argv in (BAGUA_SPELLED, BAGUA_RUN_SPELLED):
        script = argv.index("train.py")
        given |= {token for token in argv[:script] if token.startswith("--")}
        dashed = [launch.torchrun_spelling(t) for t in argv[:script]] + argv[script:]
        assert "--nproc-per-node" in dashed and "--script_flag" in dashed  # the script's own flags are left alone
        assert vars(launch.parse_args(dashed)) == vars(launch.parse_args(argv))
    underscored = {flag for flag in launch.build_parser()._option_string_actions if "_" in flag}
    assert {flag for flag in given if "_" in flag} == underscored  # every flag that has two spellings
    mixed = launch.parse_args(["--nproc-per-node=4", "--node_rank", "0", "--master-port", "2000", "t.py"])
    assert (mixed.nproc_per_node, mixed.node_rank, mixed.master_port) == (4, 0, 2000)
    assert launch.parse_args(["t.py"]).no_python is False  # a twin leaves the default alone


def test_help_shows_baguas_spelling_and_says_both_are_accepted(capsys):
    with pytest.raises(SystemExit):
        launch.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--nproc_per_node NPROC_PER_NODE" in text and "--no_bagua_compat" in text
    assert "Every flag is also accepted in torchrun's spelling, with dashes (--nproc-per-node for --nproc_per_node)." in text
    assert text.count("--nproc-per-node") == 1 and "--node-rank" not in text and "--no-bagua-compat" not in text


def test_an_error_names_the_spelling_that_was_typed(capsys):
    line = _usage_error(["--nproc-per-node", "two", "t.py"], capsys)
    assert line == ("python -m bagua_algos.launch: error: argument --nproc-per-node: invalid value 'two': "
                    "give a number >= 1 or one of auto, cpu, gpu")


def test_a_missing_script_is_refused_before_any_worker_starts(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _usage_error(["--nproc_per_node", "2", "nosuch.py"], capsys) == (
        "python -m bagua_algos.launch: error: argument training_script: no file 'nosuch.py' "
        f"(relative to {tmp_path}); give the path of the script, or a module name with -m")
    assert _usage_error(["--no_python", "no-such-program-x"], capsys) == (
        "python -m bagua_algos.launch: error: argument training_script: 'no-such-program-x' is neither a program "
        "on PATH nor an executable file (--no_python runs it directly)")


def test_a_missing_script_from_the_command_line_is_one_line():
    code, out, err = run_launcher(["--nproc_per_node", "2", "--master_port", free_port(), "nosuch.py"], timeout=60)
    assert code == 2 and out == ""
    assert err.splitlines() == [
        "usage: python -m bagua_algos.launch [launcher flags] training_script [script args ...]",
        f"python -m bagua_algos.launch: error: argument training_script: no file 'nosuch.py' (relative to {REPO}); "
        "give the path of the script, or a module name with -m"]


def test_nccl_with_too_few_gpus_is_refused_by_the_launcher(capsys, monkeypatch):
    import torch

    script = WORKERS / "allreduce_env.py"
    monkeypatch.delenv("BAGUA_ALGOS_BACKEND", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _usage_error(["--backend", "nccl", "--nproc_per_node", "2", script], capsys) == (
        "python -m bagua_algos.launch: error: argument --backend: nccl puts each worker on its own GPU "
        "(device cuda:LOCAL_RANK), but this node has no visible GPU; run on the CPU instead: --backend gloo")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert _usage_error(["--backend", "nccl", "--nproc-per-node", "2", script], capsys) == (
        "python -m bagua_algos.launch: error: argument --backend: nccl puts each worker on its own GPU "
        "(device cuda:LOCAL_RANK), but this node runs 2 workers and has 1 visible GPU; start at most 1 per node "
        "(--nproc_per_node 1), or run on the CPU: --backend gloo")
    monkeypatch.setenv("BAGUA_ALGOS_BACKEND", "nccl")
    assert _usage_error(["--nproc_per_node", "3", script], capsys) == (
        "python -m bagua_algos.launch: error: BAGUA_ALGOS_BACKEND=nccl (set in this environment) puts each worker "
        "on its own GPU (device cuda:LOCAL_RANK), but this node runs 3 workers and has 1 visible GPU; start at most "
        "1 per node (--nproc_per_node 1), or run on the CPU: --backend gloo")
    launch.check_before_start(launch.build_parser(), launch.parse_args(["--nproc_per_node", "1", str(script)]))
    launch.check_before_start(launch.build_parser(), launch.parse_args(["--backend", "auto", "--nproc_per_node", "4",
                                                                        str(script)]))  # auto: the script decides


def test_two_workers_started_with_torchruns_spelling(tmp_path):
    code, out, err = run_launcher(["--nproc-per-node", "2", "--master-port", free_port(),
                                   WORKERS / "allreduce_env.py", tmp_path])
    assert code == 0, f"{out}\n{err}"
    records = [json.loads((tmp_path / f"rank_{r}.json").read_text()) for r in range(2)]
    assert [rec["WORLD_SIZE"] for rec in records] == ["2", "2"]


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
    warnings = [line for line in err.splitlines() if line.startswith("bagua_algos.launch: warning: ignoring")]
    assert warnings == ["bagua_algos.launch: warning: ignoring --autotune_level=1, --enable_bagua_net: Bagua's "
                        "autotune service, Bagua-Net, metrics and host lists are not part of bagua-algos"], err
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


def _bucket_sizes(rank, world):
    """The bytes of each bucket ``with_bagua`` builds when the script gives no bucket_size."""
    import torch

    import bagua_algos
    from bagua_algos.algorithms import GradientAllReduceAlgorithm

    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)])  # 4 x (4096 + 128) bytes
    model.with_bagua([torch.optim.SGD(model.parameters(), lr=0.1)], GradientAllReduceAlgorithm())
    return [sum(t.numel() * t.element_size() for t in bucket.tensors) for bucket in model.bagua_buckets], \
        bagua_algos.runtime.bucket.default_bucket_size()


def test_the_workers_environment_follows_the_flags(monkeypatch):
    """--default_bucket_size reaches with_bagua through BAGUA_DEFAULT_BUCKET_SIZE; c10d
    leaves NODE_RANK to the rendezvous and opts out of torch's shared store
    (pytorch/pytorch#147064); static sets NODE_RANK and the master."""
    from bagua_algos.experiments.gloo_workers import run_workers

    from bagua_algos.runtime.bucket import default_bucket_size

    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items()
                                        if k not in ("NODE_RANK", launch.SHARE_STORE_ENV, launch.BUCKET_SIZE_ENV)})
    launch.set_worker_environment(launch.parse_args([
        "--rdzv_backend", "c10d", "--default_bucket_size", "5000", "t.py"]))
    assert os.environ[launch.BUCKET_SIZE_ENV] == "5000" and os.environ[launch.SHARE_STORE_ENV] == "1"
    assert "NODE_RANK" not in os.environ and default_bucket_size() == 5000
    launch.set_worker_environment(launch.parse_args(["--nnodes", "2", "--node_rank", "1", "t.py"]))
    assert (os.environ["NODE_RANK"], os.environ["MASTER_PORT"]) == ("1", "29500")
    os.environ[launch.BUCKET_SIZE_ENV] = "ten"
    with pytest.raises(ValueError, match="BAGUA_DEFAULT_BUCKET_SIZE must be a positive number of bytes, got 'ten'"):
        default_bucket_size()
    monkeypatch.undo()

    # 4 layers of 4096 + 128 bytes: a bucket closes once it holds 5000 bytes or more, so
    # two layers each; at Bagua's 10 MiB (and the first bucket's 1 MiB) all in one
    small = run_workers(_bucket_sizes, 1, env={launch.BUCKET_SIZE_ENV: "5000"})[0]
    default = run_workers(_bucket_sizes, 1)[0]
    assert small == ([8448, 8448], 5000)
    assert default == ([16896], 10 * 2**20)
