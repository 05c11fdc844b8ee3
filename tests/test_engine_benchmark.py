"""benchmarks/engine_benchmark.py runs each of its sections and prints its ratios (the
figures themselves are measured by hand and recorded in docs/benchmarks.md)."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from subprocesses import REPO, run_python

SCRIPT = REPO / "benchmarks" / "engine_benchmark.py"


@pytest.mark.parametrize("section,args,key", [
    ("batching", ["--workers", "3", "--batch", "4", "--steps", "1", "--rounds", "1", "--models", "mlp"],
     "ratio_vs_one_model_at_n_times_b"),
    ("comm", ["--workers", "4", "--batch", "4", "--steps", "1", "--rounds", "2", "--passes", "torch"], "comm_share"),
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


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler for cuda_ext")
def test_comm_compares_the_compiled_passes_with_torchs():
    """--passes both (the default on CPU): each form with the torch passes and with
    cuda_ext's, and a line per form with the ratio of their hooks' times."""
    code, out, err = run_python([SCRIPT, "comm", "--device", "cpu", "--workers", "4", "--batch", "4", "--steps", "1",
                                 "--rounds", "2", "--warmup", "1"], timeout=420)
    assert code == 0, err[-3000:]
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")][1:]
    shares = {(line["algorithm"], line["passes"]) for line in lines if "comm_share" in line}
    ratios = {line["algorithm"]: line["hooks_compiled_over_torch"] for line in lines
              if "hooks_compiled_over_torch" in line}
    assert ("decentralized_ring", "torch") in shares and ("decentralized_ring", "compiled") in shares
    assert set(ratios) == {algorithm for algorithm, _ in shares} and all(r > 0 for r in ratios.values())
