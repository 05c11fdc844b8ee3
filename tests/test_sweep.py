"""The heterogeneity sweep end to end, in miniature (a subprocess with a hard timeout)."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "heterogeneity_sweep.py"


def run_sweep(*args, timeout=240):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=env)


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


@pytest.mark.parametrize(
    "args,message",
    [
        (["--configs", "allreduce_average;warp_drive"], "unknown algorithm 'warp_drive'"),
        (["--configs", "ddp"], "'ddp' trains gradients"),
        (["--dataset", "cifar10"], "--data-dir"),
        (["--alphas", "0.1,-1"], "positive"),
        (["--workers", "0"], "positive integer"),
    ],
)
def test_bad_arguments_fail_fast_with_a_clear_message(args, message):
    result = run_sweep(*args, timeout=60)
    assert result.returncode == 2
    assert message in result.stderr
