"""benchmarks/engine_benchmark.py runs each of its sections and prints its ratios (the
figures themselves are measured by hand and recorded in docs/benchmarks.md)."""

from __future__ import annotations

import json

import pytest

from subprocesses import REPO, run_python

SCRIPT = REPO / "benchmarks" / "engine_benchmark.py"


@pytest.mark.parametrize("section,args,key", [
    ("batching", ["--workers", "3", "--batch", "4", "--steps", "1", "--rounds", "1", "--models", "mlp"],
     "ratio_vs_one_model_at_n_times_b"),
    ("comm", ["--workers", "4", "--batch", "4", "--steps", "1", "--rounds", "2"], "comm_share"),
])
def test_each_section_prints_its_ratio(section, args, key):
    code, out, err = run_python([SCRIPT, section, "--device", "cpu", *args], timeout=180)
    assert code == 0, err[-3000:]
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert "machine" in lines[0]
    figures = [line for line in lines[1:] if line.get("section") == section]
    assert figures and all(line[key] > 0 for line in figures)


def test_a_bad_model_is_refused_by_name():
    code, out, err = run_python([SCRIPT, "batching", "--models", "mlp,alexnet"], timeout=60)
    assert code == 2 and "argument --models: unknown ['alexnet']" in err
