"""benchmarks/exogym_compare.py: without EXO Gym it says how to get it; the engine's side runs."""

from __future__ import annotations

import json
import sys

import pytest

from bagua_algos.experiments import exogym_compare


def test_without_exogym_the_command_says_how_to_get_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "exogym", None)  # an import of it fails, present or not
    assert exogym_compare.main(["--frameworks", "exogym,engine", "--steps", "3", "--warmup", "1"]) == 2
    assert "clone exo-explore/gym" in capsys.readouterr().err


@pytest.mark.parametrize("argv, names", [
    (["--methods", "adam"], "argument --methods"),
    (["--frameworks", "horovod"], "argument --frameworks"),
    (["--steps", "5", "--warmup", "5"], "argument --warmup"),
    (["--seeds", "a"], "argument --seeds"),
    (["--adamw", "lion"], "argument --adamw"),
])
def test_bad_input_is_refused(argv, names, capsys):
    with pytest.raises(SystemExit) as exit_:
        exogym_compare.parse_args(argv)
    assert exit_.value.code == 2 and names in capsys.readouterr().err


def test_the_engine_side_runs_and_is_measured(tmp_path, capsys):
    out = tmp_path / "runs.json"
    assert exogym_compare.main(["--frameworks", "engine", "--nodes", "2", "--steps", "4", "--warmup", "1",
                                "--seeds", "0", "--methods", "diloco,demo", "--sync-every", "2",
                                "--out", str(out)]) == 0
    records = json.loads(out.read_text())
    assert [(r["framework"], r["method"]) for r in records] == [("engine", "diloco"), ("engine", "demo")]
    for r in records:
        assert r["steps"] == 4 and r["step_s"] > 0 and r["cpu_step_s"] > 0 and r["peak_pss_mib"] > 0
        assert 0 <= r["accuracy"] <= 1
