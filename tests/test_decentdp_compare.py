"""benchmarks/decentdp_compare.py: without Decent-DP it says how to get it; bad input is
refused by name; where decent-dp is installed, a 2-worker loopback job times both sides."""

from __future__ import annotations

import json
import sys

import pytest

from bagua_algos.experiments import decentdp_compare


def test_without_decent_dp_the_command_says_how_to_get_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "decent_dp", None)  # an import of it fails, present or not
    monkeypatch.setitem(sys.modules, "decent_dp.ddp", None)
    assert decentdp_compare.main(["--links", "loopback", "--workers", "2"]) == 2
    assert "pip install decent-dp" in capsys.readouterr().err


@pytest.mark.parametrize("argv, names", [
    (["--workers", "6"], "argument --workers"),
    (["--workers", "a"], "argument --workers"),
    (["--links", "fast"], "argument --links"),
    (["--configs", "allreduce"], "argument --configs"),
    (["--warmup", "1"], "argument --warmup"),
    (["--steps", "0"], "argument --steps"),
])
def test_bad_input_is_refused(argv, names, capsys):
    with pytest.raises(SystemExit) as exit_:
        decentdp_compare.parse_args(argv)
    assert exit_.value.code == 2 and names in capsys.readouterr().err


def test_a_loopback_job_times_both_sides(tmp_path, capsys):
    pytest.importorskip("decent_dp.ddp", reason="decent-dp is not installed (pip install decent-dp)")
    out = tmp_path / "jobs.json"
    assert decentdp_compare.main(["--workers", "2", "--links", "loopback", "--mlp-hidden", "16", "--mlp-layers", "1",
                                  "--steps", "3", "--warmup", "2", "--rounds", "2", "--out", str(out)]) == 0
    (record,) = json.loads(out.read_text())
    assert record["workers"] == 2 and record["link"] == "loopback"
    assert set(record["blocks"]) == {"shift_one", "sgp", "ring", "one-peer-exp"}
    assert all(len(runs) == 2 and all(b["s"] > 0 and b["cpu_s"] > 0 for b in runs)
               for runs in record["blocks"].values())
    assert set(record["summary"]["pairs"]) == {"shift_one / ring", "shift_one / one-peer-exp", "sgp / one-peer-exp"}
    assert "sgp / one-peer-exp" in capsys.readouterr().out
