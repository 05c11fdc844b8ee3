"""The `bagua-algos` command (bagua_algos/experiments/cli.py): every subcommand answers
--help with its own flags; an unknown one is refused naming the valid ones."""

from __future__ import annotations

import pytest

from bagua_algos.experiments import cli
from subprocesses import run_python


@pytest.mark.parametrize("command", list(cli.COMMANDS))
def test_every_subcommand_answers_help(command, capsys):
    if command == "lightning-benchmark":
        pytest.importorskip("lightning")
    with pytest.raises(SystemExit) as exit_:
        cli.main([command, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage:") and "--help" in out


def test_the_required_subcommands_are_there():
    assert {"sweep", "reproduce", "synthetic-benchmark", "network-sweep", "engine-benchmark", "lightning-benchmark",
            "elastic-faults"} <= set(cli.COMMANDS)


def test_a_command_whose_extra_is_missing_names_the_extra(monkeypatch, capsys):
    import importlib

    real = importlib.import_module

    def without_lightning(name, *args, **kwargs):
        if name == cli.COMMANDS["lightning-benchmark"][0]:
            raise ModuleNotFoundError("No module named 'lightning'", name="lightning")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib, "import_module", without_lightning)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["lightning-benchmark", "--help"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == (
        "bagua-algos lightning-benchmark: needs lightning, which is not installed "
        "(pip install 'bagua-algos[lightning]')\n")


def test_top_level_help_lists_the_commands_and_a_bad_command_is_refused(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in cli.COMMANDS)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["swep"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'swep'" in err and "sweep" in err
    assert cli.main([]) == 2  # no command: the help, and a usage error's status


def test_python_dash_m_runs_the_same_command():
    code, out, err = run_python(["-m", "bagua_algos.experiments", "sweep", "--help"], timeout=120)
    assert code == 0, err
    assert "--engine" in out and "--resume" in out


def test_elastic_faults_outside_a_checkout_says_it_needs_one(monkeypatch, tmp_path, capsys):
    from bagua_algos.experiments import elastic_faults

    monkeypatch.setattr(elastic_faults, "SCRIPT", tmp_path / "examples" / "fault_tolerance.py")
    with pytest.raises(SystemExit) as exit_:
        cli.main(["elastic-faults", "--runs", "1"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "fault_tolerance.py is not there" in err and "pip install -e '.[experiments]'" in err
