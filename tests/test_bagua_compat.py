"""The compatibility package ``bagua`` and the launcher putting it on the workers' path.

A real Bagua is simulated by a directory holding a package ``bagua`` (with
``FAKE_REAL_BAGUA = True``), put on ``sys.path`` or on the launcher's PYTHONPATH.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path

import pytest

from subprocesses import finish, start_python

from bagua_algos import compat
from bagua_algos.launcher import launch


@pytest.fixture
def fake_real_bagua(tmp_path) -> Path:
    """A directory with a regular package ``bagua`` that is not ours."""
    root = tmp_path / "site"
    (root / "bagua").mkdir(parents=True)
    (root / "bagua" / "__init__.py").write_text('"""Stands in for a real Bagua."""\nFAKE_REAL_BAGUA = True\n')
    importlib.invalidate_caches()
    return root


@pytest.fixture
def clean_import_state(monkeypatch):
    """sys.path / sys.modules changes of a test are undone; no real Bagua to start with."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "bagua", raising=False)
    if compat.real_bagua_installed():
        pytest.skip(f"a real Bagua is installed here: {compat.find_real_bagua().origin}")
    yield
    sys.modules.pop("bagua", None)
    importlib.invalidate_caches()


# ----------------------------------------------------------------- bagua_algos.compat


def test_compat_path_holds_the_package(repo_root):
    path = compat.compat_path()
    assert os.path.isabs(path)
    assert Path(path) == repo_root / "bagua_algos" / "compat"
    assert (Path(path) / "bagua" / "__init__.py").is_file()


def test_no_real_bagua_by_default(clean_import_state):
    assert compat.find_real_bagua() is None
    assert "bagua" not in sys.modules


def test_our_package_on_sys_path_is_not_a_real_bagua(clean_import_state):
    sys.path.insert(0, compat.compat_path())
    importlib.invalidate_caches()
    assert not compat.real_bagua_installed()
    import bagua  # the placeholder

    assert Path(bagua.__file__).parent == Path(compat.compat_path()) / "bagua"
    assert not compat.real_bagua_installed()  # also once imported (found in sys.modules)


def test_a_real_bagua_is_found_without_importing_it(clean_import_state, fake_real_bagua):
    sys.path.append(str(fake_real_bagua))
    importlib.invalidate_caches()
    assert compat.real_bagua_installed()
    assert Path(compat.find_real_bagua().origin) == fake_real_bagua / "bagua" / "__init__.py"
    assert "bagua" not in sys.modules


def test_a_real_bagua_behind_ours_on_the_path_still_counts(clean_import_state, fake_real_bagua):
    # e.g. a launcher started from a worker, whose PYTHONPATH begins with ours
    sys.path[:0] = [compat.compat_path()]
    sys.path.append(str(fake_real_bagua))
    importlib.invalidate_caches()
    assert compat.real_bagua_installed()


def test_a_plain_directory_named_bagua_is_not_a_bagua(clean_import_state, tmp_path):
    (tmp_path / "data" / "bagua").mkdir(parents=True)  # namespace package, no __init__.py
    sys.path.insert(0, str(tmp_path / "data"))
    importlib.invalidate_caches()
    assert not compat.real_bagua_installed()


# ------------------------------------------------------------- the launcher's decision


def test_flag_parses():
    assert launch.parse_args(["t.py"]).no_bagua_compat is False
    args = launch.parse_args(["--no_bagua_compat", "t.py", "--no_bagua_compat"])
    assert args.no_bagua_compat is True
    assert args.training_script_args == ["--no_bagua_compat"]  # the script's own flag


def test_pythonpath_without_a_real_bagua(clean_import_state):
    ours = compat.compat_path()
    assert launch.bagua_compat_pythonpath(None) == (ours, None)
    assert launch.bagua_compat_pythonpath("") == (ours, None)
    joined = os.pathsep.join(["/a", "/b"])
    assert launch.bagua_compat_pythonpath(joined) == (ours + os.pathsep + joined, None)
    already = ours + os.pathsep + "/a"
    assert launch.bagua_compat_pythonpath(already) == (already, None)  # not twice


def test_pythonpath_with_a_real_bagua_is_left_alone(clean_import_state, fake_real_bagua):
    sys.path.append(str(fake_real_bagua))
    importlib.invalidate_caches()
    for before in (None, "/a", str(fake_real_bagua)):
        after, notice = launch.bagua_compat_pythonpath(before)
        assert after == before
        assert f"Bagua is installed ({fake_real_bagua / 'bagua'})" in notice


# ----------------------------------------------------------------------- real jobs


def probe(launch_workers_dir, free_port, tmp_path, env, *flags):
    out_file = tmp_path / "probe.json"
    proc = start_python(["-m", "bagua_algos.launch", "--master_port", free_port, *flags,
                         launch_workers_dir / "bagua_probe.py", out_file], env)
    code, out, err = finish(proc, timeout=120)
    assert code == 0, f"stdout:\n{out}\nstderr:\n{err}"
    return json.loads(out_file.read_text()), err


def test_workers_import_the_compat_bagua(launch_workers_dir, free_port, tmp_path, child_env):
    env = child_env
    record, err = probe(launch_workers_dir, free_port, tmp_path, env)
    ours = compat.compat_path()
    assert record["PYTHONPATH"].split(os.pathsep)[0] == ours
    assert record["PYTHONPATH"] == ours + os.pathsep + env["PYTHONPATH"]
    assert record.get("file") == os.path.realpath(os.path.join(ours, "bagua", "__init__.py")), record
    assert "Bagua is installed" not in err


def test_workers_keep_a_real_bagua(launch_workers_dir, free_port, tmp_path, fake_real_bagua, child_env):
    env = child_env
    env["PYTHONPATH"] += os.pathsep + str(fake_real_bagua)
    record, err = probe(launch_workers_dir, free_port, tmp_path, env)
    assert record["PYTHONPATH"] == env["PYTHONPATH"]
    assert compat.compat_path() not in record["PYTHONPATH"].split(os.pathsep)
    assert record.get("fake") is True, record
    assert record["file"] == os.path.realpath(fake_real_bagua / "bagua" / "__init__.py")
    assert f"bagua_algos.launch: Bagua is installed ({fake_real_bagua / 'bagua'})" in err


def test_no_bagua_compat_flag(launch_workers_dir, free_port, tmp_path, child_env):
    env = child_env
    record, err = probe(launch_workers_dir, free_port, tmp_path, env, "--no_bagua_compat")
    assert record["PYTHONPATH"] == env["PYTHONPATH"]
    assert "error" in record and "bagua" in record["error"], record
