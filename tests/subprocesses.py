"""Child processes for tests: a clean environment, a free port, and a hard timeout that
kills the child's whole process session (a launcher and its workers) and fails the test."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TIMEOUT = 120


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(extra_path=()) -> dict:
    """This environment less any launcher's variables, one thread, gloo (CPU workers), the repo importable,
    Python's fault handler on."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):
        env.pop(name, None)
    env["OMP_NUM_THREADS"] = "1"
    env["BAGUA_ALGOS_BACKEND"] = "gloo"  # CPU workers, also on a GPU machine (a test may change it)
    env["PYTHONFAULTHANDLER"] = "1"  # a child killed by SIGABRT/SIGSEGV prints every thread's Python stack
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO), *map(str, extra_path)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def start_python(args, env=None) -> subprocess.Popen:
    """``python ARGS`` in its own session, from the repository's root."""
    return subprocess.Popen(
        [sys.executable, *map(str, args)], cwd=REPO, env=env or child_env(),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float = TIMEOUT):
    """(exit code, stdout, stderr); past ``timeout`` the whole session is killed and the test fails."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{proc.args} timed out after {timeout}s\nstdout:\n{out}\nstderr:\n{err}")
    return proc.returncode, out, err


def run_python(args, env=None, timeout: float = TIMEOUT):
    return finish(start_python(args, env), timeout)
