"""The sweep's and reproduce's files never end in a traceback: a corrupt split cache is
made again; --seed out of numpy's range, an --out-dir (or reproduce's --out) that cannot
be written and a runs.jsonl line that is not a record each end with one line naming
the argument, exit 2, before any training; a sweep whose every run diverges still
writes its report, saying so."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from subprocesses import REPO, run_python

SWEEP = REPO / "benchmarks" / "heterogeneity_sweep.py"
REPRODUCE = REPO / "benchmarks" / "reproduce.py"
TINY = ["--workers", "2", "--configs", "allreduce_average", "--alphas", "0.1", "--epochs", "1",
        "--max-steps-per-epoch", "2", "--no-progress", "--jobs", "1"]


def _last_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


# ------------------------------------------------------------------ the split cache


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty", "missing_array"])
def test_a_corrupt_split_cache_is_deleted_and_made_again(tmp_path, monkeypatch, damage):
    from bagua_algos.experiments import data

    monkeypatch.setenv(data.CACHE_ENV, str(tmp_path))
    first = data.load_data("digits", None, 3)
    path = data.split_cache_path("digits", 3)
    assert path.is_file()
    content = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(content[: len(content) // 2])
    elif damage == "garbage":
        path.write_bytes(b"not a zip file at all" * 10)
    elif damage == "empty":
        path.write_bytes(b"")
    else:
        np.savez(path.with_suffix(".part.npz"), train_x=np.zeros(3))
        path.with_suffix(".part.npz").replace(path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = data.load_data("digits", None, 3)
    messages = [str(w.message) for w in caught if "cached digits split" in str(w.message)]
    assert len(messages) == 1 and "deleted, making it again" in messages[0] and "\n" not in messages[0]
    for name in ("train_x", "train_y", "test_x", "test_y"):
        assert np.array_equal(getattr(first, name).numpy(), getattr(again, name).numpy())
    with warnings.catch_warnings(record=True) as caught:  # the cache is whole again: read without a word
        warnings.simplefilter("always")
        data.load_data("digits", None, 3)
    assert not [w for w in caught if "cached digits split" in str(w.message)]


# ----------------------------------------------------------------------- run log


def _config(out_dir, *extra):
    from bagua_algos.experiments.sweep.cli import build_parser, config_from_arguments

    return config_from_arguments(build_parser().parse_args([*TINY, "--out-dir", str(out_dir), *extra]))


@pytest.mark.parametrize("line,why", [
    ("5", "line 2 is not a run's record"),
    ("[1, 2]", "line 2 is not a run's record"),
    ('"text"', "line 2 is not a run's record"),
    ('{"config": "allreduce_average"}', "line 2 is a JSON object without a run's config, alpha and lr"),
    ('{"config": "x", "alpha": "abc", "lr": 0.1}', "line 2 is a JSON object without a run's config, alpha and lr"),
    ("not json", "line 2 is not a run's record"),
])
def test_a_run_log_line_that_is_not_a_record_names_the_file_and_line(tmp_path, line, why):
    from bagua_algos.experiments.sweep.runlog import RUNS_FILE, ResumeError, read_previous_runs, settings_of

    config = _config(tmp_path)
    good = {"config": "allreduce_average", "alpha": 0.1, "lr": 0.05}
    (tmp_path / RUNS_FILE).write_text("\n".join([json.dumps({"sweep_settings": settings_of(config)}), line,
                                                 json.dumps(good)]) + "\n")
    with pytest.raises(ResumeError, match=f"{RUNS_FILE}: {why}.*delete that line.*without --resume") as error:
        read_previous_runs(config)
    assert "\n" not in str(error.value)


def test_a_run_log_whose_first_line_is_not_the_settings_is_refused(tmp_path):
    from bagua_algos.experiments.sweep.runlog import RUNS_FILE, ResumeError, read_previous_runs

    config = _config(tmp_path)
    for first in ("5", '{"sweep_settings": 5}', "[]"):
        (tmp_path / RUNS_FILE).write_text(first + "\n")
        with pytest.raises(ResumeError, match="line 1 is not the sweep's settings"):
            read_previous_runs(config)


# --------------------------------------------------------- the commands, end to end


def test_bad_seed_out_dir_and_run_log_end_with_one_line_and_exit_2(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    log_dir = tmp_path / "log"
    from bagua_algos.experiments.sweep.runlog import RUNS_FILE, settings_of

    log_dir.mkdir()
    (log_dir / RUNS_FILE).write_text(json.dumps({"sweep_settings": settings_of(_config(log_dir))}) + "\n[1, 2]\n{}\n")
    cases = [
        (["--seed", "-1"], "argument --seed: expected an integer in [0, 4294967295]"),
        (["--seed", "4294967296"], "argument --seed: expected an integer in [0, 4294967295]"),
        (["--out-dir", str(a_file / "sub")], f"argument --out-dir: cannot write in '{a_file / 'sub'}' (Not a directory)"),
        (["--out-dir", str(log_dir), "--resume"], f"argument --resume: {log_dir / RUNS_FILE}: line 2 is not a run's record"),
    ]
    for args, message in cases:
        code, out, err = run_python([SWEEP, *TINY, *args], timeout=180)
        assert code == 2 and message in _last_line(err), (args, err[-2000:])
        assert "Traceback" not in err and "stopped" not in err  # refused before any run trained
    code, out, err = run_python([REPRODUCE, "seed001-table4", "--out", str(a_file / "sub")], timeout=180)
    assert code == 2 and "Traceback" not in err
    assert f"argument --out: cannot write in '{a_file / 'sub'}' (Not a directory)" in _last_line(err)


def test_a_sweep_whose_every_run_diverges_still_reports(tmp_path):
    out = tmp_path / "sweep"
    code, stdout, err = run_python([SWEEP, *TINY, "--lr", "1e30", "--out-dir", str(out)], timeout=240)
    assert code == 0, err[-3000:]
    assert "every run diverged (1 run, listed under failed_runs in results.json)" in stdout
    report = json.loads((out / "results.json").read_text())
    assert report["results"] == [] and len(report["failed_runs"]) == 1
    for name in ("accuracy_vs_epoch.png", "class_histograms.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_plots_of_no_run_are_a_note(tmp_path):
    from bagua_algos.experiments.sweep.plots import plot_accuracy, plot_histograms

    report = {"failed_runs": [{"error": "nan"}] * 3, "world_size": 2, "settings": {"dataset": "digits"}}
    plot_accuracy([], tmp_path / "a.png", report)
    plot_histograms([], tmp_path / "h.png", report)
    for name in ("a.png", "h.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("seed", [-1, 2**32, True, 1.0])
def test_a_sweep_config_built_in_python_refuses_a_seed_numpy_cannot_take(seed):
    from bagua_algos.experiments.sweep.config import SweepConfig, SweepConfigError

    with pytest.raises(SweepConfigError, match=r"expected an integer in \[0, 4294967295\]") as error:
        SweepConfig(seed=seed)
    assert error.value.flag == "--seed"
    assert SweepConfig(seed=2**32 - 1).seed == 2**32 - 1
