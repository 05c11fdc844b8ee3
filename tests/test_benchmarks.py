"""benchmarks/synthetic_benchmark.py, run tiny: the table's fields, not its timings.

Every run is a subprocess in its own session with a hard timeout; on overrun the
whole session (launcher and workers) is killed and the test fails.
"""

import json

import pytest

from subprocesses import REPO, TIMEOUT, free_port, run_commands_in_one_python, run_python

SCRIPT = REPO / "benchmarks" / "synthetic_benchmark.py"

TINY = ["--model", "mlp", "--mlp-hidden", "16", "--batch-size", "4", "--steps", "2",
        "--warmup", "1", "--rounds", "1"]


def run(argv, timeout=TIMEOUT):
    return run_python(argv, timeout=timeout)


def launcher(nproc, *script_args):
    return ["-m", "bagua_algos.launch", "--nproc_per_node", nproc, "--master_port", free_port(),
            SCRIPT, *script_args]


def test_tiny_run_under_the_launcher(tmp_path):
    out_path = tmp_path / "results.json"
    code, out, err = run(launcher(2, *TINY, "--configs", "ddp;gradient_allreduce;qadam:hierarchical=false",
                                  "--out", out_path))
    assert code == 0, f"stdout:\n{out}\nstderr:\n{err}"
    report = json.loads(out_path.read_text())
    assert report["baseline"] == "ddp"
    assert report["host"]["world_size"] == 2
    assert report["settings"]["batch_size"] == 4 and report["settings"]["steps"] == 2
    rows = {row["config"]: row for row in report["results"]}
    assert list(rows) == ["ddp", "gradient_allreduce", "qadam:hierarchical=false"]
    for row in rows.values():
        assert row["images_per_s"] > 0 and row["ms_per_step"] > 0
        assert len(row["round_ms_per_step"]) == 1
        assert row["cpu_ms_per_step"] > 0
        for key in ("step_time_ratio", "images_per_s_ratio", "step_time_ratio_paired", "cpu_time_ratio"):
            assert row[key] > 0, key
    # the seed's Table 5.1 ratios: against gradient_allreduce (timed here), not against
    # allreduce_average (not timed)
    assert rows["gradient_allreduce"]["images_per_s_vs_gradient_allreduce"] == pytest.approx(1.0)
    assert rows["ddp"]["images_per_s_vs_gradient_allreduce"] == pytest.approx(
        rows["ddp"]["images_per_s"] / rows["gradient_allreduce"]["images_per_s"])
    assert rows["ddp"]["bytes_vs_gradient_allreduce"] is None  # DDP's bytes are not seen
    assert "images_per_s_vs_allreduce_average" not in rows["ddp"]
    assert "images/s vs GA" in out and "images/s vs AA" not in out
    assert rows["ddp"]["step_time_ratio"] == pytest.approx(1.0)
    assert rows["ddp"]["images_per_s_ratio"] == pytest.approx(1.0)
    # both configs train the same model on the same data
    assert rows["ddp"]["final_loss"] == pytest.approx(rows["gradient_allreduce"]["final_loss"], rel=1e-4)
    # header and table on rank 0's stdout
    assert "world size 2" in out and "torch " in out and "CPUs" in out
    assert "step-time ratio" in out and "images/s ratio" in out
    assert sum(line.startswith("gradient_allreduce ") for line in out.splitlines()) == 1


def _assert_unknown_name_message(code, err):
    assert code != 0
    assert "unknown algorithm 'no_such_algo'" in err, err
    assert "gradient_allreduce" in err, err  # the valid names are listed


def test_unknown_algorithm_fails_before_spawning():
    code, out, err = run([SCRIPT, "--spawn", 2, *TINY, "--configs", "ddp;no_such_algo"], timeout=60)
    _assert_unknown_name_message(code, err)
    assert "round 1/1" not in out  # no worker was started, nothing trained


def test_unknown_algorithm_fails_in_the_workers():
    code, out, err = run(launcher(2, *TINY, "--configs", "ddp;no_such_algo"), timeout=TIMEOUT)
    _assert_unknown_name_message(code, err)
    assert "round 1/1" not in out
    assert err.count("unknown algorithm 'no_such_algo'") == 1, err  # one worker of the node says it
    assert "Traceback" not in err, err


def test_a_usage_error_is_printed_by_the_first_worker_of_a_node_only(monkeypatch, capsys):
    from bagua_algos.experiments import common

    waits = []
    monkeypatch.setattr(common.time, "sleep", waits.append)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(SystemExit) as quiet:
        common.usage_error("prog", "bad --x")
    assert quiet.value.code == 2 and capsys.readouterr().err == ""
    assert waits == [common.USAGE_ERROR_GRACE_S]  # it waits for the launcher to stop it
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(SystemExit) as first:
        common.usage_error("prog", "bad --x", "usage: prog\n")
    assert first.value.code == 2 and capsys.readouterr().err == "usage: prog\nprog: error: bad --x\n"
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    monkeypatch.setenv("LOCAL_RANK", "3")  # not a launched worker: LOCAL_RANK alone proves nothing
    with pytest.raises(SystemExit):
        common.usage_error("prog", "bad --x")
    assert capsys.readouterr().err == "prog: error: bad --x\n" and len(waits) == 1


def _parse_error(parse, argv, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        parse(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err.splitlines()[-1]


def test_device_cuda_with_too_few_gpus_is_refused_before_the_workers_start(monkeypatch, capsys):
    import torch

    from bagua_algos.experiments.synthetic_benchmark import parse_args

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _parse_error(parse_args, ["--device", "cuda"], capsys) == (
        "synthetic_benchmark: error: argument --device: cuda puts each worker on its own GPU (device cuda:LOCAL_RANK), "
        "but this node has no visible GPU; run on the CPU instead: --device cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert _parse_error(parse_args, ["--device", "cuda", "--spawn", "2"], capsys) == (
        "synthetic_benchmark: error: argument --device: cuda puts each worker on its own GPU (device cuda:LOCAL_RANK), "
        "but this node runs 2 workers and has 1 visible GPU; start at most 1 per node (--spawn 1), or run on the CPU: "
        "--device cpu")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")  # in a worker of a launched job: its node's worker count
    assert _parse_error(parse_args, ["--device", "cuda"], capsys).endswith(
        "but this node runs 3 workers and has 1 visible GPU; start at most 1 per node (--nproc_per_node 1), "
        "or run on the CPU: --device cpu")
    assert parse_args(["--device", "cuda", "--spawn", "1"]).device == "cuda"
    assert parse_args(["--device", "auto", "--spawn", "4"]).device == "auto"  # auto falls back to the CPU


def test_device_cuda_without_a_gpu_from_the_command_line_is_one_line():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    code, out, err = run([SCRIPT, "--spawn", 2, "--device", "cuda", *TINY], timeout=60)
    assert code == 2 and out == ""
    assert err.splitlines()[-1] == (
        "synthetic_benchmark: error: argument --device: cuda puts each worker on its own GPU (device cuda:LOCAL_RANK), "
        "but this node has no visible GPU; run on the CPU instead: --device cpu")
    assert "Traceback" not in err


def test_help_shows_the_flags_of_both_modes_grouped():
    from bagua_algos.experiments import bagua_synthetic, synthetic_benchmark

    code, out, err = run([SCRIPT, "--help"], timeout=60)
    assert code == 0, err
    flags = [flag for parser in (synthetic_benchmark.build_parser(), bagua_synthetic.build_parser())
             for action in parser._actions for flag in action.option_strings]
    assert {"--algorithm", "--image-size", "--topology", "--configs", "--num-iters"} <= set(flags)
    for flag in flags:
        assert flag in out, flag
    headings = ["what is timed (side-by-side mode):", "timing:", "workers:", "output:",
                "what is timed (Bagua's mode: --algorithm NAME):", "timing (Bagua's mode):",
                "workers (Bagua's mode):"]
    positions = [out.index(f"\n{heading}\n") for heading in headings]
    assert positions == sorted(positions), out
    assert out.index("--configs CONFIGS") < positions[1] and out.index("--image-size") > positions[4]


def test_config_parsing():
    from bagua_algos.experiments.common import ConfigError, parse_configs, parse_value

    assert [parse_value(v) for v in ("3", "0.5", "True", "false", "none", "chain")] == [3, 0.5, True, False, None, "chain"]
    ddp, ga = parse_configs(" ddp:bucket_cap_mb=10 ; gradient_allreduce:average=false,do_flatten=false,bucket_size=4096")
    assert ddp.is_ddp and ddp.kwargs == {"bucket_cap_mb": 10}
    assert ga.name == "gradient_allreduce" and ga.kwargs == {"average": False}
    assert ga.wrap_kwargs == {"do_flatten": False, "bucket_size": 4096}
    assert ga.build_algorithm().average is False
    for bad in ("", "ddp;ddp", "gradient_allreduce:average", "gradient_allreduce:nope=1", ":x=1"):
        with pytest.raises(ConfigError):
            parse_configs(bad)


def test_qadam_config_builds_its_own_optimizer():
    import torch
    from bagua_algos.experiments.common import ConfigError, parse_configs
    from bagua_algos.algorithms import QAdamOptimizer

    (qadam,) = parse_configs("qadam:warmup_steps=7,lr=0.5,hierarchical=false")
    params = [torch.nn.Parameter(torch.zeros(3))]
    optimizer = qadam.build_qadam_optimizer(params, lr=0.1, default_warmup_steps=2)
    assert isinstance(optimizer, QAdamOptimizer)
    assert optimizer.warmup_steps == 7 and optimizer.param_groups[0]["lr"] == 0.5  # the config's keys win
    algorithm = qadam.build_algorithm(optimizer)
    assert algorithm.optimizer is optimizer and algorithm.hierarchical is False
    (default,) = parse_configs("qadam")
    assert default.build_qadam_optimizer(params, lr=0.1, default_warmup_steps=4).warmup_steps == 4
    for bad in ("qadam:warmup_steps=1", "qadam:lr=-1", "qadam:hierarchical=maybe"):
        with pytest.raises(ConfigError, match="qadam"):
            parse_configs(bad)


def test_cifar_resnet18_is_the_papers_model():
    import torch
    from bagua_algos.experiments.synthetic_benchmark import build_model

    model = build_model("cifar_resnet18", 10, 0, 0)
    assert model.conv1.kernel_size == (3, 3)  # CIFAR stem: no 7x7 convolution, no max-pool
    assert sum(p.numel() for p in model.parameters()) == 11_173_962
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 10)


# ------------------------------------------------------- Bagua's interface (--algorithm)

BAGUA_TINY = ["--model", "mlp", "--image-size", "8", "--num-classes", "3", "--batch-size", "4",
              "--num-warmup-batches", "1", "--num-batches-per-iter", "2", "--num-iters", "3"]


def test_bagua_interface_prints_bagua_lines_and_bytes():
    code, out, err = run([SCRIPT, "--spawn", 2, "--algorithm", "terngrad", "--bits", "2", *BAGUA_TINY])
    assert code == 0, f"stdout:\n{out}\nstderr:\n{err}"
    for line in ("Model: mlp", "Batch size: 4", "Number of CPUs: 2", "Running warmup...", "Running benchmark..."):
        assert line in out, out
    assert out.count(" img/sec CPU") == 3
    assert "Img/sec per CPU: " in out and " +-" in out and "Total img/sec on 2 CPU(s): " in out
    sent = float(out.split("Bytes sent per worker per step: ")[1].split()[0])
    assert sent > 0


BAD_FLAGS = [
    (["--algorithm", "no_such_algo"], "unknown algorithm 'no_such_algo'"),
    (["--algorithm", "gradient_allreduce", "--rank", "2"], "--rank: algorithm 'gradient_allreduce' takes no 'rank'"),
    (["--algorithm", "gradient_allreduce", "--model", "no_such_net"], "--model: 'no_such_net' is neither"),
    (["--algorithm", "gradient_allreduce", "--num-iters", "0"], "--num-iters: must be >= 1"),
    (["--algorithm", "relay", "--topology", "rign"],
     "argument --topology: unknown topology 'rign'; valid names: ['chain', 'binary_tree', 'double_binary_tree']"),
    (["--algorithm", "powersgd", "--rank", "0"], "argument --rank: rank must be an int >= 1, got 0"),
    (["--algorithm", "terngrad", "--bits", "3"], "argument --bits: bits must be one of [1, 2, 4, 8], got 3"),
]


@pytest.fixture(scope="module")
def bad_flag_runs():
    """Every BAD_FLAGS command line's (exit code, stdout, stderr), all run in one child
    Python (subprocesses.run_commands_in_one_python): each ends at its usage error, so a
    child of its own would cost an interpreter and torch's import apiece. All of them
    within the 60 s that bounded each one alone."""
    runs = run_commands_in_one_python([[SCRIPT, *argv] for argv, _ in BAD_FLAGS], timeout=60)
    return {tuple(argv): run for (argv, _), run in zip(BAD_FLAGS, runs)}


@pytest.mark.parametrize("argv, match", BAD_FLAGS)
def test_bagua_interface_bad_flags(bad_flag_runs, argv, match):
    code, out, err = bad_flag_runs[tuple(argv)]
    assert code == 2 and match in err, err
    assert "Traceback" not in err


def test_bagua_interface_checks_the_topology_in_the_parent():
    code, out, err = run([SCRIPT, "--spawn", 2, "--algorithm", "relay", "--topology", "rign", *BAGUA_TINY], timeout=60)
    assert code == 2 and out == "", out  # no worker started: nothing printed "Model: ..."
    assert err.splitlines() == [
        "usage: synthetic_benchmark --algorithm NAME [flags below]",
        "synthetic_benchmark --algorithm: error: argument --topology: unknown topology 'rign'; valid names: "
        "['chain', 'binary_tree', 'double_binary_tree']"]


def test_bagua_interface_bad_topology_under_the_launcher_is_said_once():
    code, out, err = run(launcher(2, "--algorithm", "relay", "--topology", "rign", *BAGUA_TINY), timeout=TIMEOUT)
    assert code == 2 and "Model: " not in out
    assert err.count("argument --topology: unknown topology 'rign'") == 1, err
    assert "Traceback" not in err, err


def test_exchange_order_benchmark_runs_tiny():
    script = REPO / "benchmarks" / "exchange_order_benchmark.py"
    code, out, err = run(["-m", "torch.distributed.run", "--nproc_per_node", 3, "--master_port", free_port(),
                          script, "--megabytes", "0.01", "--repeats", 1])
    assert code == 0, err[-3000:]
    for pattern in ("ring allreduce", "isend to both, then irecv", "irecv from both, then isend", "batch_isend_irecv"):
        assert pattern in out, out


def test_pace_runs_every_section_at_its_smallest_size(tmp_path):
    """benchmarks/pace.py --quick on the CPU: every section prints its ratios, the device
    is named, and the JSON holds the rows (no timing is asserted)."""
    out_path = tmp_path / "pace.json"
    code, out, err = run([REPO / "benchmarks" / "pace.py", "--quick", "--device", "cpu", "--ws1-steps", "1",
                          "--ws1-rounds", "1", "--json", out_path], timeout=600)
    assert code == 0, f"stdout:\n{out}\nstderr:\n{err}"
    assert "pace: device CPU" in out
    for line in ("powersgd cifar_resnet18  rank 1:", "orth resnet50 P set rank 1 (54 matrices)",
                 "orth grid  256×2  :", "codec 8-bit nearest:", "ws1 gradient_allreduce", "vs ddp:",
                 "ws1 qadam"):
        assert line in out, line
    rows = json.loads(out_path.read_text())["rows"]
    ws1 = {row["config"]: row for row in rows if row["what"] == "ws1"}
    assert set(ws1) == {"ddp", "gradient_allreduce", "bytegrad", "async", "decentralized",
                        "low_precision_decentralized", "qadam"}
    assert all(row["ratio"] > 0 for name, row in ws1.items() if name != "ddp")
