"""The sweep's executors (local and Ray) and its learning-rate tuning that brackets the
best rate: the same records wherever a run trains, a two-node Ray cluster on this
machine, a lost worker retried, a failing run recorded once, ``--resume`` across
executors, the GPU placement of the local executor, and the lr grid's extensions.

One Ray cluster serves the module: a head and a second node, one CPU each, both on this
machine (``ray.cluster_utils.Cluster``); the sweeps join it (the driver is already
connected) and leave it running.
"""

from __future__ import annotations

import json
import math
import sys
import textwrap
import time

import pytest

from subprocesses import REPO, run_python

ray = pytest.importorskip("ray")

TEST_TIMEOUT_S = 240


@pytest.fixture(autouse=True)
def bounded():
    """No test may hang: SIGALRM ends one that runs past TEST_TIMEOUT_S (pytest reports
    it as failed; the module's fixtures still shut Ray down)."""
    import signal

    def expire(signum, frame):
        raise TimeoutError(f"the test ran past {TEST_TIMEOUT_S} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(TEST_TIMEOUT_S)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)

TINY = ["--workers", "2", "--alphas", "0.1", "--epochs", "2", "--max-steps-per-epoch", "2", "--no-progress",
        "--lr-grid", "0.05,0.1", "--lr-extend", "1"]
TWO = "allreduce_average;decentralized:hierarchical=false,topology=ring"
VOLATILE = ("seconds", "ran_on")  # where and how fast: the only fields that may differ between executors


@pytest.fixture(scope="module")
def cluster():
    """Two Ray nodes of one CPU each on this machine, the driver connected, within
    TEST_TIMEOUT_S. They listen on the machine's own address: Ray 2.60's test cluster
    started with node_ip_address 127.0.0.1 still announces the GCS at the host's address
    and its nodes wait on it forever."""
    import signal

    from ray.cluster_utils import Cluster

    def expire(signum, frame):
        raise TimeoutError(f"the Ray test cluster did not start within {TEST_TIMEOUT_S} s")

    if ray.is_initialized():
        ray.shutdown()
    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(TEST_TIMEOUT_S)
    made = Cluster(initialize_head=True, connect=False, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        made.add_node(num_cpus=1)
        made.wait_for_nodes()
        ray.init(address=made.address, log_to_driver=False)
    except BaseException:
        made.shutdown()
        raise
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    yield made
    ray.shutdown()
    made.shutdown()


def sweep(tmp, *args, executor="local"):
    """The sweep in this process (``bagua-algos sweep``), its runs.jsonl records (the
    settings line dropped) and results.json."""
    from bagua_algos.experiments.sweep import cli

    extra = ["--jobs", "1"] if executor == "local" else []
    cli.main([*TINY, "--out-dir", str(tmp), "--executor", executor, *extra, *args])
    records = [json.loads(line) for line in (tmp / "runs.jsonl").read_text().splitlines()[1:]]
    return records, json.loads((tmp / "results.json").read_text())


def by_key(records):
    return {(r["config"], r["alpha"], r["lr"]): {k: v for k, v in r.items() if k not in VOLATILE} for r in records}


@pytest.fixture(scope="module")
def local_reference(tmp_path_factory):
    """The two-config sweep on the local executor: the records every executor must give."""
    return sweep(tmp_path_factory.mktemp("local"), "--configs", TWO)


def test_ray_gives_the_local_executors_records_bit_for_bit_across_two_nodes(cluster, local_reference, tmp_path):
    records, report = sweep(tmp_path, "--configs", TWO, executor="ray")
    local_records, local_report = local_reference
    assert len(records) == len(local_records) >= 4  # the grid, and its extensions (one per row at most)
    assert by_key(records) == by_key(local_records)
    assert [(r["config"], r["lr"], r["final_mean_worker_accuracy"]) for r in report["results"]] == \
        [(r["config"], r["lr"], r["final_mean_worker_accuracy"]) for r in local_report["results"]]
    # every run says where it ran: the Ray node; two nodes with one CPU each, so both take runs
    nodes = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
    assert len(nodes) == 2
    ran_on = {r["ran_on"]["node_id"] for r in records}
    assert ran_on <= nodes and len(ran_on) == 2, ran_on
    assert all(r["ran_on"]["host"] and r["ran_on"]["node_ip"] for r in records)
    assert report["settings"]["executor"] == "ray"


def algorithm_file(tmp_path, name: str, body: str):
    """A file algorithm ``name`` (all-reduce model averaging) whose ``reify``, run only
    where a run trains (never in the driver's checks), first runs ``body``; MARK is a
    file beside it. Returns its --configs entry and MARK."""
    path = tmp_path / f"{name}.py"
    lines = ["import os", "from pathlib import Path", "",
             "from bagua_algos.algorithms import AllreduceAverageAlgorithm", "",
             f"MARK = Path({str(tmp_path / (name + '.mark'))!r})", "", "",
             f"class {name}(AllreduceAverageAlgorithm):", "    def reify(self, process_group):",
             *("        " + line for line in textwrap.dedent(body).strip().splitlines()),
             "        return super().reify(process_group)", ""]
    path.write_text("\n".join(lines))
    return f"{path}:{name}", tmp_path / f"{name}.mark"


def test_a_lost_worker_is_retried_and_every_run_is_logged_once(cluster, local_reference, tmp_path):
    """The Ray worker training a run dies (its process exits mid-run, once): Ray runs the
    task again, and the log holds every run exactly once, with the records of a run that
    never died."""
    spec, mark = algorithm_file(tmp_path, "DiesOnce", """
        if not MARK.exists():
            MARK.write_text(str(os.getpid()))
            os._exit(1)
    """)
    records, report = sweep(tmp_path / "out", "--configs", spec, "--lr-extend", "0", executor="ray")
    assert mark.exists()
    assert sorted(r["lr"] for r in records) == [0.05, 0.1] and not report["failed_runs"]
    reference = {k[2]: v for k, v in by_key(local_reference[0]).items() if k[0] == "allreduce_average"}
    for record in records:  # the same training as the registered algorithm it subclasses
        assert record["curve_train_loss"] == reference[record["lr"]]["curve_train_loss"]


def test_a_run_that_raises_or_diverges_is_recorded_once_as_failed_not_retried(cluster, tmp_path, capsys):
    spec, mark = algorithm_file(tmp_path, "Raises", """
        with open(MARK, "a") as f:
            f.write("called\\n")
        raise RuntimeError("this run fails on its own")
    """)
    records, report = sweep(tmp_path / "out", "--configs", f"{spec};allreduce_average", "--lr-grid", "0.05,1e30",
                            "--lr-extend", "0", executor="ray")
    assert mark.read_text().splitlines() == ["called", "called"]  # one call per rate: no retry
    failed = sorted((r["config"].split(":")[-2 if r["config"].count(":") else 0].rsplit("/", 1)[-1], r["lr"],
                     r["error"]) for r in report["failed_runs"])
    assert [(name, lr) for name, lr, _ in failed] == [("Raises.py", 0.05), ("Raises.py", 1e30),
                                                      ("allreduce_average", 1e30)]
    assert failed[0][2] == failed[1][2] == "RuntimeError: this run fails on its own"
    assert "training loss is nan" in failed[2][2]
    assert len(records) == 4 and sum("error" in r for r in records) == 3
    assert "stopped" in capsys.readouterr().err


@pytest.mark.parametrize("first,second", [("local", "ray"), ("ray", "local")])
def test_resume_goes_on_across_executors_to_the_same_table(cluster, local_reference, tmp_path, first, second):
    sweep(tmp_path, "--configs", "allreduce_average", executor=first)
    records, report = sweep(tmp_path, "--configs", TWO, "--resume", executor=second)
    local_records, local_report = local_reference
    assert by_key(records) == by_key(local_records) and len(records) == len(local_records)
    assert [{k: v for k, v in r.items() if k not in VOLATILE} for r in report["results"]] == \
        [{k: v for k, v in r.items() if k not in VOLATILE} for r in local_report["results"]]


def test_ray_refuses_the_processes_engine_and_a_jobs_count(cluster, capsys):
    from bagua_algos.experiments.sweep import cli

    for args, message in ((["--engine", "processes"], "argument --executor: ray trains each run as one task"),
                          (["--jobs", "2"], "argument --jobs: 2 runs at a time is the local executor's"),
                          (["--executor", "local", "--ray-address", "auto"],
                           "argument --ray-address: 'auto' is where --executor ray sends the runs")):
        with pytest.raises(SystemExit) as stop:
            cli.main([*TINY, "--executor", "ray", *args])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and message in err and err.count("error:") == 1 and "Traceback" not in err


def test_missing_ray_names_the_extra_in_one_line(monkeypatch, capsys, tmp_path):
    from bagua_algos.experiments.sweep import cli

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(SystemExit) as stop:
        cli.main([*TINY, "--executor", "ray", "--out-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("error:") == 1
    assert "argument --executor: ray is not installed in this Python; pip install 'bagua-algos[ray]'" in err
    assert not (tmp_path / "runs.jsonl").exists()


def test_an_unreachable_ray_address_fails_fast_in_one_line(tmp_path):
    started = time.monotonic()
    code, out, err = run_python([REPO / "benchmarks" / "heterogeneity_sweep.py", *TINY, "--executor", "ray",
                                 "--ray-address", "127.0.0.1:1", "--out-dir", str(tmp_path)], timeout=60)
    assert code == 2 and time.monotonic() - started < 60
    assert "argument --ray-address: nothing answers at 127.0.0.1:1" in err
    assert err.count("error:") == 1 and "Traceback" not in err


def test_local_gpu_placement_is_a_function_of_the_visible_gpus():
    from bagua_algos.experiments.sweep.executors import ExecutorError, gpu_slots, local_gpu_jobs

    assert gpu_slots(2, 1, None) == [0, 1]
    assert gpu_slots(1, 0.25, None) == [0, 0, 0, 0]  # four runs share the GPU
    assert gpu_slots(2, 0.5, 3) == [0, 0, 1]
    assert gpu_slots(4, 2, None) == [0, 2]  # a run holds two GPUs, trains on the first
    assert local_gpu_jobs(None, 3, 8, 1) == [0, 1, 2]  # at most one job per run
    assert local_gpu_jobs(None, 10, 2, 0.5) == [0, 0, 1, 1]
    for args, flag, words in (((1, 2, None), "--gpus-per-run", "asks for 2 GPUs and this machine has 1"),
                              ((2, 1, 3), "--jobs", "3 runs at a time with --gpus-per-run 1 need 3 GPUs"),
                              ((2, 1.5, None), "--gpus-per-run", "a fraction of one GPU or a whole number"),
                              ((2, math.nan, None), "--gpus-per-run", "positive")):
        with pytest.raises(ExecutorError) as error:
            gpu_slots(*args)
        assert error.value.flag == flag and words in error.value.reason
    with pytest.raises(ExecutorError, match="no visible GPU"):
        local_gpu_jobs(None, 4, 0, 1)


def test_the_gpu_jobs_spawned_per_slot_give_the_records_of_one_process():
    """The local executor's GPU path (processes spawned, one per GPU slot, the sweep
    rebuilt from its fields in each) run on the CPU: the same records as in this process."""
    from bagua_algos.experiments.data import build_model, load_data
    from bagua_algos.experiments.sweep.config import SweepConfig
    from bagua_algos.experiments.sweep.runs import one_run, train_stacked
    from bagua_algos.experiments.sweep.executors import run_gpu_jobs

    sweep_ = SweepConfig(workers=2, configs=TWO, alphas=(0.1,), epochs=1, max_steps_per_epoch=2, lr_grid=(0.05,))
    data = load_data(sweep_.dataset, None, sweep_.seed)
    jobs = [(c, 0.1, lr) for c in sweep_.parsed_configs for lr in sweep_.lrs]
    spawned = dict(run_gpu_jobs(sweep_, data, jobs, [0]))  # one process: a spawn imports torch anew (slow here)
    make_model = lambda: build_model(data, sweep_.model)  # noqa: E731
    here = [one_run(lambda c, a, lr: train_stacked(sweep_, data, c, a, lr, make_model), *job) for job in jobs]
    assert sorted(spawned) == list(range(len(jobs)))
    assert by_key([spawned[i] for i in range(len(jobs))]) == by_key(here)


def records_for(scores: dict, config="c", alpha=0.1) -> list:
    """Run records of one (config, α): rate -> accuracy, None for a run that diverged."""
    return [{"config": config, "alpha": alpha, "lr": lr, **({"error": "nan"} if acc is None else
                                                            {"final_mean_worker_accuracy": acc})}
            for lr, acc in scores.items()]


def test_the_lr_grid_grows_past_an_edge_best_until_a_worse_rate_or_a_nan_brackets_it():
    from bagua_algos.experiments.sweep.config import SweepConfig
    from bagua_algos.experiments.sweep.runs import extension_jobs

    sweep_ = SweepConfig(workers=2, configs="allreduce_average", alphas=(0.1,), lr_grid=(0.05, 0.1), lr_extend=2)
    spec = sweep_.parsed_configs[0].spec
    grow = lambda scores, s=sweep_: [lr for _, _, lr in extension_jobs(s, records_for(scores, spec))]  # noqa: E731
    assert grow({0.05: 0.5, 0.1: 0.7}) == [0.2]  # best at the top: double it
    assert grow({0.05: 0.7, 0.1: 0.5}) == [0.025]  # best at the bottom: halve it
    assert grow({0.05: 0.7, 0.1: 0.7}) == [0.025]  # a tie goes to the smaller rate
    assert grow({0.05: 0.5, 0.1: 0.7, 0.2: 0.6}) == []  # bracketed
    assert grow({0.05: 0.5, 0.1: 0.7, 0.2: None}) == []  # a NaN is the worst: doubling stops there
    assert grow({0.05: None, 0.1: None}) == [0.025]  # every rate diverged: go lower
    assert grow({0.05: 0.5, 0.1: 0.6, 0.2: 0.7, 0.4: 0.8}) == []  # two extensions used: at edge, stop
    assert grow({0.05: 0.5}) == []  # the grid not yet trained: nothing to decide
    assert grow({0.05: 0.5, 0.1: 0.7}, SweepConfig(configs="allreduce_average", lr_grid=(0.05, 0.1), lr_extend=0)) \
        == []
    assert grow({0.05: 0.5}, SweepConfig(configs="allreduce_average", lr=0.05)) == []  # a single rate: no grid


def test_a_row_still_best_at_an_edge_is_marked_in_the_table_csv_and_json(tmp_path, capsys):
    """Extensions are ordinary runs (logged, resumable); a row whose best rate is still
    the highest tried after --lr-extend is marked, with its tried grid."""
    # rates far below the best: on 20 steps the larger one learns more (0.106, 0.133, 0.175)
    records, report = sweep(tmp_path, "--configs", "allreduce_average", "--lr-grid", "0.002,0.004",
                            "--lr-extend", "1", "--max-steps-per-epoch", "10")
    assert [r["lr"] for r in records] == [0.002, 0.004, 0.008]
    (row,) = report["results"]
    assert row["lr"] == 0.008 and row["lr_at_edge"] is True and row["lr_grid_tried"] == [0.002, 0.004, 0.008]
    out = capsys.readouterr().out
    assert "0.008 (edge)" in out and "the optimum may lie beyond" in out
    csv_text = (tmp_path / "results.csv").read_text()
    assert "lr_at_edge,lr_grid_tried" in csv_text.splitlines()[0] and "True,0.002;0.004;0.008" in csv_text


def test_reproduce_passes_the_executor_to_its_sweeps_and_checks_it_first(monkeypatch, capsys):
    from types import SimpleNamespace

    from bagua_algos.experiments.reproduce import cli as reproduce
    from bagua_algos.experiments.reproduce.context import Context

    args = reproduce.parse_args(["list", "--executor", "ray", "--ray-address", "auto", "--gpus-per-run", "0.5"])
    flags = Context.sweep_flags(SimpleNamespace(args=args))
    assert flags == ["--lr-extend", "0", "--executor", "ray", "--ray-address", "auto", "--gpus-per-run", "0.5"]
    assert Context.sweep_flags(SimpleNamespace(args=SimpleNamespace())) == ["--lr-extend", "0", "--executor", "local"]
    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # as in a fresh process (the module's Ray may be up)
    for argv, message in ((["list", "--executor", "ray", "--ray-address", "127.0.0.1:1"],
                           "argument --ray-address: nothing answers at 127.0.0.1:1"),
                          (["list", "--gpus-per-run", "0"], "argument --gpus-per-run: expected a positive number")):
        with pytest.raises(SystemExit) as stop:
            reproduce.parse_args(argv)
        assert stop.value.code == 2 and message in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(SystemExit):
        reproduce.parse_args(["list", "--executor", "ray"])
    assert "pip install 'bagua-algos[ray]'" in capsys.readouterr().err


def test_an_op_refusing_a_nan_is_a_diverged_run_and_other_errors_still_raise():
    """A grid extended upwards may overflow a compressor's gradients: the min-max codec's
    refusal (a ValueError on every worker) ends that run as diverged, not the sweep."""
    from bagua_algos.experiments.common import parse_configs
    from bagua_algos.experiments.sweep.runs import one_run

    (config,) = parse_configs("allreduce_average")

    def refuses(*_):
        raise ValueError("the bucket's values of rank(s) [0, 1] has NaN/inf values, which the min-max codec ...")

    record = one_run(refuses, config, 0.1, 0.4)
    assert record["lr"] == 0.4 and "has NaN/inf values" in record["error"] and record["ran_on"]["host"]

    def broken(*_):
        raise ValueError("a bug, not a divergence")

    with pytest.raises(ValueError, match="a bug"):
        one_run(broken, config, 0.1, 0.4)
