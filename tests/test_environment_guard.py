"""conftest.py's guard: every test gets back the environment it found, so that a
variable one test sets (RANK, as ``init_process_group`` writes it) never reaches the
next test of the same pytest process."""

from __future__ import annotations

import os
import subprocess
import sys

from subprocesses import restore_environ

ADDED, CHANGED, REMOVED = "BAGUA_ALGOS_GUARD_ADDED", "BAGUA_ALGOS_GUARD_CHANGED", "BAGUA_ALGOS_GUARD_REMOVED"
LEAKED = "BAGUA_ALGOS_GUARD_LEAKED"


def _seen_by_a_child(names) -> dict:
    """The values a new process inherits: os.environ's changes reached the C environment."""
    code = f"import os; print(repr({{n: os.environ.get(n) for n in {list(names)!r}}}))"
    return eval(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                               check=True).stdout)


def test_restore_puts_back_added_changed_and_removed_variables(monkeypatch):
    monkeypatch.setenv(CHANGED, "before")
    monkeypatch.setenv(REMOVED, "kept")
    monkeypatch.delenv(ADDED, raising=False)
    saved = dict(os.environ)
    os.environ[ADDED] = "new"
    os.environ[CHANGED] = "after"
    del os.environ[REMOVED]
    assert restore_environ(saved) == [ADDED, CHANGED, REMOVED]
    assert dict(os.environ) == saved
    assert _seen_by_a_child([ADDED, CHANGED, REMOVED]) == {ADDED: None, CHANGED: "before", REMOVED: "kept"}
    assert restore_environ(saved) == []  # nothing left to put back: nothing is written


def test_restore_works_on_the_mapping_it_is_given():
    environ = {"RANK": "0", "PATH": "/bin"}
    assert restore_environ({"PATH": "/usr/bin", "HOME": "/root"}, environ) == ["HOME", "PATH", "RANK"]
    assert environ == {"PATH": "/usr/bin", "HOME": "/root"}


# The two tests below run in this order whenever the second runs after the first in one
# process (the file's order; `--dist loadfile` keeps a file on one worker). Run alone, or
# first, the second passes as well: it can only fail if the first one's variable leaked.

def test_a_test_that_sets_a_variable_directly():
    os.environ[LEAKED] = "1"  # deliberately not through monkeypatch


def test_the_next_test_does_not_see_it():
    assert LEAKED not in os.environ
    assert _seen_by_a_child([LEAKED]) == {LEAKED: None}
