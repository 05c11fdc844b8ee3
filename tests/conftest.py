"""Shared test set-up: the import path, and fixtures for tests that start child processes.

* ``tests/`` goes on ``sys.path`` (for helper modules such as ``subprocesses``), and
  so does the repository root, ahead of any installed copy of the project, so that
  ``pytest`` run as a plain command tests this checkout too.
  Under ``python -m pytest`` from the root both are usually there already.
* Fixtures: ``repo_root``, ``tests_dir``, ``launch_workers_dir``, ``free_port`` (a
  port free right now on 127.0.0.1) and ``child_env`` (the environment for a child
  process: no launcher variables, one thread, this checkout first on PYTHONPATH; see
  :func:`subprocesses.child_env`).
* Every test leaves ``os.environ`` as it found it (an autouse fixture puts back what the
  test, or the code it ran, added, changed or removed: :func:`subprocesses.restore_environ`),
  so that no variable set by one test, such as the RANK that ``init_process_group``
  writes, reaches the next test in the same pytest process.
* Order: the longest files first (:data:`LONGEST_FIRST`), so that under
  ``-n auto --dist loadfile`` no worker is left with one of them at the end.
* Threads: under pytest-xdist each pytest worker runs torch on its share of the cores
  (cores // workers, at least one; :func:`_torch_threads_for_this_worker`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


def _on_sys_path(directory: Path) -> bool:
    for entry in sys.path:
        try:
            if Path(os.path.realpath(entry or os.curdir)) == directory:
                return True
        except (TypeError, ValueError):
            continue
    return False


for _directory in (TESTS, REPO):  # REPO ends up first
    if not _on_sys_path(_directory):
        sys.path.insert(0, str(_directory))

import subprocesses  # noqa: E402  (needs the path above)


@pytest.fixture(autouse=True)
def _environment_restored():
    """``os.environ`` after the test exactly as before it (see the module's docstring)."""
    environ = os.environ  # the real one, even if the test puts a dict in its place
    saved = dict(environ)
    yield
    subprocesses.restore_environ(saved, environ)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    """The root of this checkout (where setup.py is)."""
    return REPO


@pytest.fixture(scope="session")
def tests_dir() -> Path:
    return TESTS


@pytest.fixture(scope="session")
def launch_workers_dir() -> Path:
    """tests/launch_workers: the scripts run under ``python -m bagua_algos.launch``."""
    return TESTS / "launch_workers"


@pytest.fixture
def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago (for --master_port)."""
    return subprocesses.free_port()


@pytest.fixture
def child_env() -> dict:
    """A fresh environment for a child process (a test may change it)."""
    return subprocesses.child_env()


# The files whose tests take longest, longest first (the sum of their tests' durations
# under `-n 2` on a 2-core machine, 2026-11-29: from about 130 s for test_torchft down to
# about 25 s; the files after them take 20 s or less each), test_cuda_ext ahead of them
# because on a fresh clone it builds cuda_ext's CPU module, which other files then load.
# Under `--dist loadfile` each file goes whole to one pytest worker, and a worker takes
# the next file when it is nearly done: started first, these files do not leave one worker
# running alone at the end (longest first: what is left to hand out at the end is short).
# xdist's own order (files with more tests first), or the alphabetical one, put several of
# them last.
LONGEST_FIRST = (
    "test_cuda_ext.py", "test_torchft.py", "test_elastic_restarts.py", "test_engine_equality.py",
    "test_elastic_launch.py", "test_comm.py", "test_sweep.py", "test_benchmarks.py", "test_netem.py",
    "test_soak.py", "test_trust_network.py", "test_launch.py", "test_reproduce.py", "test_torchft_open_points.py",
    "test_sweep_executors.py", "test_exit.py", "test_exogym_comparison.py", "test_launch_failures.py",
    "test_docs.py", "test_lightning.py", "test_bagua_api.py",
)


def _torch_threads_for_this_worker() -> None:
    """Under pytest-xdist (``-n auto``: one pytest process per core), torch's intra-op pool
    in each of those processes is cores // workers threads (at least one), not torch's
    default of one thread per core. With the default, n workers run n × n threads on n
    cores, and each parallel op of a test waits at its barrier for a thread that the other
    workers' processes, or the test's own children, have pushed off its core: measured on
    2 cores, the engine's small stacked steps ran 5 to 10 times slower so (the in-process
    half of test_engine_equality: 76 s of the suite's time, 10 s with one thread). A test
    that needs another count sets it and puts it back (test_engine_cpu_passes does). The
    children a test starts keep their own settings (one thread from
    :func:`subprocesses.child_env` or in ``run_workers``' workers)."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not workers:
        return
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, int(workers))))


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep the order below
        config.option.loadscopereorder = False
    _torch_threads_for_this_worker()


def pytest_collection_modifyitems(session, config, items):
    rank = {name: position for position, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the others keep their order
