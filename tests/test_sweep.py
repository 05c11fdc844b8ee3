"""The heterogeneity sweep end to end, in miniature (a subprocess with a hard timeout)."""

from __future__ import annotations

import csv
import json
from types import SimpleNamespace

import pytest

from subprocesses import REPO, run_commands_in_one_python, run_python

SCRIPT = REPO / "benchmarks" / "heterogeneity_sweep.py"


def run_sweep(*args, timeout=240):
    code, out, err = run_python([SCRIPT, *args], timeout=timeout)
    return SimpleNamespace(returncode=code, stdout=out, stderr=err)


def test_miniature_sweep_writes_table_json_and_plots(tmp_path):
    out = tmp_path / "sweep"
    result = run_sweep(
        "--workers", "4", "--configs", "allreduce_average;relay:topology=double_binary_tree",
        "--alphas", "0.1", "--epochs", "2", "--max-steps-per-epoch", "3", "--out-dir", str(out), "--no-progress",
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "averaged model acc" in result.stdout and "relay (double_binary_tree)" in result.stdout
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["label"] for r in rows] == ["allreduce_average", "relay (double_binary_tree)"]
    report = json.loads((out / "results.json").read_text())
    assert report["world_size"] == 4
    for row in report["results"]:
        assert len(row["curve_averaged_model_accuracy"]) == 2
        assert len(row["worker_accuracies"]) == 4
        assert 0.0 <= row["final_min_worker_accuracy"] <= row["final_mean_worker_accuracy"] <= 1.0
        histogram = row["class_histogram"]
        assert len(histogram) == 4 and len(histogram[0]) == 10
    # Model averaging after every step: all four allreduce_average models are the same.
    baseline = report["results"][0]
    assert len(set(baseline["worker_accuracies"])) == 1
    for name in ("accuracy_vs_epoch.png", "class_histograms.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


BAD_ARGUMENTS = [
    (["--configs", "allreduce_average;warp_drive"], "unknown algorithm 'warp_drive'"),
    (["--configs", "ddp"], "'ddp' trains gradients"),
    (["--dataset", "cifar10"], "--data-dir"),
    (["--alphas", "0.1,-1"], "positive"),
    (["--workers", "0"], "positive integer"),
    (["--dataset", "cifar10", "--data-dir", "/nonexistent/cifar"], "--data-dir /nonexistent/cifar is not a directory"),
    (["--model", "vgg11"], "argument --model: --model vgg11 takes 3x32x32 colour images"),
    (["--engine", "sim", "--configs", "async"], "argument --engine: sim cannot run config 'async'"),
    (["--engine", "sim", "--configs", "allreduce_average", "--workers", "100000"], "argument --workers: 100000 workers of mlp with --engine sim need about"),
    (["--engine", "processes", "--workers", "100000"], "use fewer workers or --engine sim"),
    (["--engine", "processes", "--jobs", "2"], "argument --jobs: 2 runs at a time is for --engine sim"),
]


@pytest.fixture(scope="module")
def bad_argument_runs():
    """Every BAD_ARGUMENTS command line's (exit code, stdout, stderr), all run in one
    child Python (subprocesses.run_commands_in_one_python): each ends at its usage
    error, so a child of its own would cost an interpreter and torch's import apiece.
    All of them within the 60 s that bounded each one alone: failing fast still."""
    runs = run_commands_in_one_python([[SCRIPT, *args] for args, _ in BAD_ARGUMENTS], timeout=60)
    return {tuple(args): run for (args, _), run in zip(BAD_ARGUMENTS, runs)}


@pytest.mark.parametrize("args,message", BAD_ARGUMENTS)
def test_bad_arguments_fail_fast_with_a_clear_message(bad_argument_runs, args, message):
    code, _, stderr = bad_argument_runs[tuple(args)]
    assert code == 2
    assert message in stderr
    assert "Traceback" not in stderr and stderr.count("error:") == 1


def test_both_engines_give_the_same_table(tmp_path):
    """The sweep on the stacked engine and as processes, under a paper's protocol (Nesterov,
    warm-up, step decay, no weight decay on norm layers): the same accuracies per worker."""
    reports = {}
    for engine in ("sim", "processes"):
        result = run_sweep(
            "--workers", "4", "--engine", engine, "--configs", "decentralized:hierarchical=false,topology=ring",
            "--alphas", "0.1", "--epochs", "2", "--max-steps-per-epoch", "5", "--out-dir", str(tmp_path / engine),
            "--no-progress", "--protocol", "relaysum",
        )
        assert result.returncode == 0, result.stderr[-3000:]
        assert f"4 workers on the {engine} engine" in result.stderr
        reports[engine] = json.loads((tmp_path / engine / "results.json").read_text())
    sim, processes = (reports[e]["results"][0] for e in ("sim", "processes"))
    assert reports["sim"]["engine"] == "sim" and reports["processes"]["engine"] == "processes"
    # the worker processes write the report: their settings are the parent's --workers, not its default
    assert [(r["world_size"], r["settings"]["workers"]) for r in reports.values()] == [(4, 4), (4, 4)]
    assert reports["sim"]["settings"]["protocol"] == reports["processes"]["settings"]["protocol"]
    assert reports["sim"]["settings"]["protocol"]["nesterov"] is True
    # float32 sums in another order may flip at most a prediction or two of the 360 test images
    for a, b in zip(sim["worker_accuracies"], processes["worker_accuracies"]):
        assert abs(a - b) <= 2 / 360
    assert sim["class_histogram"] == processes["class_histogram"]
    assert sim["curve_train_loss"] == pytest.approx(processes["curve_train_loss"], rel=1e-4)


def test_a_nan_loss_stops_its_run_names_the_worker_and_keeps_the_others(tmp_path):
    result = run_sweep(
        "--workers", "4", "--configs", "allreduce_average", "--lr-grid", "0.05,1e30", "--lr-extend", "0", "--alphas", "0.1",
        "--epochs", "2", "--max-steps-per-epoch", "3", "--out-dir", str(tmp_path), "--no-progress",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "stopped 'allreduce_average' alpha=0.1 lr=1e+30: worker 0's training loss is nan" in result.stderr
    report = json.loads((tmp_path / "results.json").read_text())
    assert [r["lr"] for r in report["all_runs"]] == [0.05]
    assert [r["lr"] for r in report["failed_runs"]] == [1e30]


def test_same_seed_gives_the_same_sweep_one_run_or_two_at_a_time(tmp_path):
    """The same seed gives the same runs, in the same order, whether the engine trains
    them one at a time in this process or two at a time in forked processes (--jobs)."""
    curves = []
    for name, jobs in (("a", "1"), ("b", "2")):
        result = run_sweep(
            "--workers", "2", "--configs", "decentralized:hierarchical=false,topology=ring", "--alphas", "0.01",
            "--lr-grid", "0.05,0.1", "--lr-extend", "0", "--epochs", "2", "--max-steps-per-epoch", "4", "--out-dir", str(tmp_path / name),
            "--no-progress", "--jobs", jobs,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        assert ("2 runs at a time" in result.stderr) == (jobs == "2")
        report = json.loads((tmp_path / name / "results.json").read_text())
        curves.append([(run["lr"], run["curve_train_loss"], run["worker_accuracies"], run["class_histogram"])
                       for run in report["all_runs"]])
    assert [c[0] for c in curves[0]] == [0.05, 0.1]
    assert curves[0] == curves[1]


def test_cifar10_batches_load_and_vgg11_classifies_them(tmp_path):
    import pickle

    import numpy as np
    import torch

    from bagua_algos.experiments.data import build_model, load_data

    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {b"data": rng.integers(0, 256, (6, 3072), dtype=np.uint8), b"labels": list(rng.integers(0, 10, 6))}
        with open(tmp_path / name, "wb") as f:
            pickle.dump(batch, f)
    data = load_data("cifar10", str(tmp_path), seed=0)
    assert data.train_x.shape == (30, 3, 32, 32) and data.test_x.shape == (6, 3, 32, 32)
    assert abs(float(data.train_x.mean())) < 1.0  # normalized
    model = build_model(data)
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())
    assert model(data.test_x).shape == (6, 10)
    (tmp_path / "test_batch").unlink()
    with pytest.raises(FileNotFoundError, match="test_batch"):
        load_data("cifar10", str(tmp_path), seed=0)


def test_terngrad_rows_name_bits_and_clip():
    from bagua_algos.experiments.common import parse_configs
    from bagua_algos.experiments.sweep.report import config_label

    clipped, plain = parse_configs("terngrad:bits=2,clip=2.5;terngrad:bits=4")
    assert config_label(clipped) == "terngrad (2 bits, clip 2.5)"
    assert config_label(plain) == "terngrad (4 bits)"


def test_resume_trains_only_the_runs_not_yet_in_the_log(tmp_path):
    """A sweep stopped halfway goes on with --resume: the runs in runs.jsonl are kept,
    the rest are trained, and the tables cover all of them; other settings are refused."""
    common = ["--workers", "4", "--alphas", "0.1", "--epochs", "1", "--max-steps-per-epoch", "2",
              "--out-dir", str(tmp_path), "--no-progress", "--lr-extend", "0"]
    first = run_sweep("--configs", "allreduce_average", "--lr-grid", "0.05,1e30", *common)
    assert first.returncode == 0, first.stderr[-3000:]
    log = (tmp_path / "runs.jsonl").read_text().splitlines()
    assert json.loads(log[0])["sweep_settings"]["workers"] == 4 and len(log) == 3  # settings, a run, a failed run
    # the runs are logged as they end: in either order when they train at a time (--jobs)
    finished = next(record for record in map(json.loads, log[1:]) if "error" not in record)
    # a kill while a line was written leaves it cut short: it is dropped and trained again
    (tmp_path / "runs.jsonl").write_text("\n".join(log[:3]) + "\n" + log[1][:40])

    more = "allreduce_average;decentralized:hierarchical=false,topology=ring"
    second = run_sweep("--configs", more, "--lr-grid", "0.05,1e30", "--resume", *common)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "line 4 is incomplete" in second.stderr
    assert "resuming: 2 runs" in second.stderr and "2 to go" in second.stderr
    report = json.loads((tmp_path / "results.json").read_text())
    assert sorted((r["config"], r["lr"]) for r in report["all_runs"]) == [
        ("allreduce_average", 0.05), ("decentralized:hierarchical=false,topology=ring", 0.05)]
    assert [r["lr"] for r in report["failed_runs"]] == [1e30, 1e30]  # the diverged one is not trained again
    assert report["all_runs"][0] == finished
    assert len((tmp_path / "runs.jsonl").read_text().splitlines()) == 5

    other = run_sweep("--configs", more, "--resume", *[a if a != "1" else "2" for a in common], timeout=60)
    assert other.returncode == 2 and "argument --resume:" in other.stderr
    assert "epochs 1 there, 2 now" in other.stderr


def test_idle_cores_are_counted_now_not_from_the_lagging_load_average(tmp_path, monkeypatch):
    """--jobs' default: the CPUs busy over a short sample of /proc/stat where it can be
    read (a fraction of the machine's CPUs), else the load average."""
    import os

    from bagua_algos.experiments.sweep import schedule as sweep

    if os.path.isfile("/proc/stat"):
        busy = sweep.busy_cpus(0.05)
        assert busy is not None and 0.0 <= busy <= (os.cpu_count() or 1) + 1e-9
    assert sweep.busy_cpus(0.0, str(tmp_path / "missing")) is None
    bad = tmp_path / "stat"
    bad.write_text("intr 1 2 3\n")
    assert sweep.busy_cpus(0.0, str(bad)) is None
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    monkeypatch.setattr(sweep, "busy_cpus", lambda sample_s: 0.0)
    monkeypatch.setattr(os, "getloadavg", lambda: (50.0, 50.0, 50.0))  # a lagging average is not read
    assert sweep.idle_cpus() == cpus
    monkeypatch.setattr(sweep, "busy_cpus", lambda sample_s: None)
    assert sweep.idle_cpus() == 1  # the load average, where /proc/stat cannot be read


def test_async_runs_as_processes_and_stops_its_rounds_before_the_next_run(tmp_path):
    """async has no stacked form, so the sweep runs processes; each run detaches its
    model, which ends async's background rounds before the next run and the exit."""
    result = run_sweep(
        "--workers", "2", "--configs", "async:sync_interval_ms=5;allreduce_average", "--alphas", "0.1",
        "--epochs", "1", "--max-steps-per-epoch", "4", "--out-dir", str(tmp_path), "--no-progress", "--lr", "0.05",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 workers on the processes engine (a config has no stacked form: async:" in result.stderr
    assert "did not stop cleanly" not in result.stderr and "Traceback" not in result.stderr
    report = json.loads((tmp_path / "results.json").read_text())
    assert [r["algorithm"] for r in report["all_runs"]] == ["async", "allreduce_average"]


# A cluster's variables, as Kubernetes or SLURM set them for every process of a job.
CLUSTER = {"RANK": "7", "WORLD_SIZE": "9", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "5", "NODE_RANK": "2"}


def test_a_sweep_started_with_a_clusters_rank_runs_as_the_parent(tmp_path, monkeypatch, capsys):
    """The sweep knows its own workers by launch_self's marker, not by RANK: started
    where RANK is set (and no MASTER_PORT), it is the parent and trains, where it took
    itself for a worker and stopped on MASTER_PORT (or WORLD_SIZE) not being set."""
    from bagua_algos.experiments.common import LAUNCHED_WORKER_ENV
    from bagua_algos.experiments.sweep import cli

    for name, value in {**CLUSTER, "RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    for name in ("MASTER_ADDR", "MASTER_PORT", LAUNCHED_WORKER_ENV):
        monkeypatch.delenv(name, raising=False)
    cli.main(["--workers", "2", "--engine", "sim", "--jobs", "1", "--epochs", "1", "--max-steps-per-epoch", "2",
              "--alphas", "1", "--configs", "allreduce_average", "--no-progress", "--out-dir", str(tmp_path)])
    assert "heterogeneity_sweep: 2 workers on the sim engine" in capsys.readouterr().err
    report = json.loads((tmp_path / "results.json").read_text())
    assert report["world_size"] == 2 and [row["label"] for row in report["results"]] == ["allreduce_average"]


def test_only_launch_self_marks_a_worker_of_its_module(monkeypatch):
    from bagua_algos.experiments import common, qadam_variants
    from bagua_algos.experiments.sweep import cli

    monkeypatch.delenv(common.LAUNCHED_WORKER_ENV, raising=False)
    for name, value in CLUSTER.items():
        monkeypatch.setenv(name, value)
    assert not common.launched_worker(cli.MODULE)
    monkeypatch.setenv(common.LAUNCHED_WORKER_ENV, qadam_variants.MODULE)  # a worker of another experiment
    assert common.launched_worker(qadam_variants.MODULE) and not common.launched_worker(cli.MODULE)
    monkeypatch.setenv(common.LAUNCHED_WORKER_ENV, cli.MODULE)
    assert common.launched_worker(cli.MODULE)


def test_launch_self_gives_its_workers_the_launchers_ranks_and_leaves_this_process_as_it_was(tmp_path, monkeypatch):
    """A parent run with a cluster's RANK, WORLD_SIZE, ... in its environment: its workers
    see the launcher's values over those, and the marker; once they are done the parent's
    environment is what it was (the launcher's own variables do not stay behind)."""
    import os

    from bagua_algos.experiments import common

    for name, value in {**CLUSTER, "MASTER_ADDR": "10.9.9.9", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv(common.LAUNCHED_WORKER_ENV, raising=False)
    monkeypatch.delenv("ECHO_COMMAND", raising=False)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO / "tests" / "launch_workers"),
                                                                   os.environ.get("PYTHONPATH")])))
    before = dict(os.environ)
    out = tmp_path / "echo.json"
    common.launch_self("echo_module", 1, [str(out)], "ECHO_COMMAND")
    assert dict(os.environ) == before
    worker = json.loads(out.read_text())["environ"]
    assert worker[common.LAUNCHED_WORKER_ENV] == "echo_module" and "ECHO_COMMAND" in worker
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR")
    assert {name: worker[name] for name in launcher} == dict(zip(launcher, ("0", "1", "0", "1", "0", "127.0.0.1")))
    assert worker["MASTER_PORT"] != "1"


def test_a_sweep_config_is_built_in_python_and_a_bad_one_names_its_argument():
    """SweepConfig without argparse: derived fields from the given ones, frozen, every bad
    value refused naming the field and its flag; its settings are results.json's, one key
    per flag in the flags' order."""
    import dataclasses

    from bagua_algos.experiments.sweep import cli
    from bagua_algos.experiments.sweep.config import SweepConfig, SweepConfigError

    config = SweepConfig(workers=2, configs="allreduce_average;relay:topology=chain", alphas=[1, 0.1],
                         protocol_name="relaysum", momentum=0.0)
    assert config.model == "mlp" and config.alphas == (1.0, 0.1) and config.lrs == (0.05,) and config.runs == 4
    assert config.protocol.momentum == 0.0 and config.protocol.nesterov is False
    assert [c.spec for c in config.parsed_configs] == ["allreduce_average", "relay:topology=chain"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.workers = 3
    assert dataclasses.replace(config, epochs=4).protocol.milestones == (3.0, 3.6)  # derived again: 150, 180 of 200
    dests = [action.dest for action in cli.build_parser()._actions if action.dest != "help"]
    assert list(config.settings()) == dests  # --protocol's dest is "protocol": the resolved protocol there
    for kwargs, argument, flag in [
        ({"workers": 0}, "workers", "--workers"), ({"lr": float("nan")}, "lr", "--lr"),
        ({"alphas": (0.1, -1)}, "alphas", "--alphas"), ({"momentum": 1.5}, "momentum", "--momentum"),
        ({"protocol_name": "adam"}, "protocol_name", "--protocol"), ({"configs": "ddp"}, "configs", "--configs"),
        ({"model": "vgg11"}, "model", "--model"), ({"dataset": "cifar10"}, "data_dir", "--data-dir"),
        ({"engine": "sim", "configs": "async"}, "engine", "--engine"),
        ({"engine": "processes", "jobs": 2}, "jobs", "--jobs"),
    ]:
        with pytest.raises(SweepConfigError) as error:
            SweepConfig(**kwargs)
        assert (error.value.argument, error.value.flag) == (argument, flag), kwargs
        assert str(error.value).startswith(f"{argument} ({flag}): ")
