"""The sweep's run log: every finished run kept on disk the moment it ends.

A sweep at the seeds' scale (VGG-11, 200 epochs, 3 α × 8 configurations × a learning-
rate grid) runs for hours; a crash, a Ctrl-C or a preempted machine must not take the
finished runs with it. ``OUT_DIR/runs.jsonl`` holds:

- line 1: ``{"sweep_settings": {...}}``, the settings every run's result depends on
  (:data:`RESULT_SETTINGS`);
- then one line per finished run, appended and flushed to disk as it ends: the record
  that ``results.json`` lists under ``all_runs`` (or, for a run stopped by a NaN, under
  ``failed_runs``, with its ``"error"``).

``--resume`` reads it back: runs already there are not trained again (a run that
diverged would diverge again: it stays failed), and the tables and plots cover all of
them. A resume whose settings differ from the log's is refused, naming each setting
that differs, because its runs would not be comparable. A last line cut short by a kill
while it was written is dropped with a warning (that run is trained again); any other
line that is not of its shape (the settings, then run records: JSON objects with a
config, α and learning rate) is refused naming the file and the line. Without
``--resume`` the log starts over.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

__all__ = ["RUNS_FILE", "RESULT_SETTINGS", "ResumeError", "RunLog", "run_key", "read_previous_runs"]

RUNS_FILE = "runs.jsonl"
RESULT_SETTINGS = ("dataset", "data_dir", "model", "workers", "epochs", "batch_size", "protocol",
                   "max_steps_per_epoch", "seed")
"""What a run's result depends on besides its (configuration, α, learning rate)."""


class ResumeError(ValueError):
    """The run log cannot be resumed (other settings, or a line that is not a record)."""


def settings_of(sweep) -> dict:
    """The RESULT_SETTINGS of ``sweep`` (a :class:`~bagua_algos.experiments.sweep.config.SweepConfig`),
    JSON-ready: the run log's first line."""
    values = {name: getattr(sweep, name) for name in RESULT_SETTINGS}
    if hasattr(values["protocol"], "to_dict"):  # every knob of the protocol, JSON-ready
        values["protocol"] = values["protocol"].to_dict()
    if values["data_dir"] is not None:
        values["data_dir"] = str(Path(values["data_dir"]).expanduser().resolve())
    return values


def run_key(record: dict) -> tuple:
    """A run's identity within one sweep: its configuration, α and learning rate."""
    return record["config"], float(record["alpha"]), float(record["lr"])


def read_previous_runs(sweep) -> list[dict]:
    """The runs ``OUT_DIR/runs.jsonl`` holds for the settings of ``sweep`` (a SweepConfig) ([] if there is no log);
    raises :class:`ResumeError` naming what stands in the way."""
    path = Path(sweep.out_dir) / RUNS_FILE
    if not path.exists():
        return []
    try:
        lines = path.read_text(encoding="utf-8").split("\n")
    except (OSError, UnicodeDecodeError) as error:
        raise ResumeError(f"{path} is unreadable ({getattr(error, 'strerror', None) or error}); move it away and run "
                          "without --resume to start over") from None
    if lines and lines[-1] == "":
        lines.pop()
    records = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            if number == len(lines) and number > 1:  # cut short by a kill while it was written
                print(f"heterogeneity_sweep: {path}: line {number} is incomplete (the sweep stopped while writing "
                      "it); that run is trained again", file=sys.stderr)
                break
            record = None
        why = _not_a_record(record, first=number == 1)
        if why:
            fix = "" if number == 1 else "delete that line (its run is trained again), or "
            raise ResumeError(f"{path}: line {number} {why}, got {line[:60]!r}; {fix}move the file away and run "
                              "without --resume to start over")
        records.append(record)
    if not records:
        raise ResumeError(f"{path} does not start with the sweep's settings; move the file away to start over")
    saved, now = records[0]["sweep_settings"], settings_of(sweep)
    differ = [f"{name} {saved.get(name)!r} there, {now[name]!r} now" for name in RESULT_SETTINGS
              if saved.get(name) != now[name]]
    if differ:
        raise ResumeError(f"the runs in {path} were made with other settings ({'; '.join(differ)}): resume with the "
                          "same settings, or choose another --out-dir")
    return records[1:]


def _not_a_record(record, first: bool) -> str:
    """Why ``record`` (a parsed line, None if it is not JSON) is not what that line of
    the log holds ("" if it is): line 1 the settings, every other line a run's record
    (a JSON object with its ``config``, ``alpha`` and ``lr``, as :func:`run_key` reads)."""
    if first:
        ok = isinstance(record, dict) and isinstance(record.get("sweep_settings"), dict)
        return "" if ok else 'is not the sweep\'s settings (a JSON object {"sweep_settings": {...}})'
    if not isinstance(record, dict) or "sweep_settings" in record:
        return "is not a run's record (a JSON object with config, alpha and lr)"
    try:
        run_key(record)
    except (KeyError, TypeError, ValueError):
        return "is a JSON object without a run's config, alpha and lr"
    return ""


class RunLog:
    """Appends each finished run to ``OUT_DIR/runs.jsonl`` (only the process that writes
    the outputs keeps one). It starts by writing the log anew, atomically: the settings,
    then ``previous`` (the runs being resumed, [] for a new sweep), which also drops a
    line an earlier kill cut short."""

    def __init__(self, sweep, previous: list[dict]):
        self.path = Path(sweep.out_dir) / RUNS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.path.with_name(self.path.name + ".tmp")
        with open(temporary, "w") as f:
            for record in [{"sweep_settings": settings_of(sweep)}, *previous]:
                f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, self.path)

    def append(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
