"""Child processes for tests: a clean environment, a free port, and a hard timeout that
kills the child's whole process session (a launcher and its workers) and fails the test;
and :func:`restore_environ`, with which conftest.py gives every test back the environment
of this process as the test found it."""

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


# Ports handed to launchers and stores come from below the kernel's ephemeral range, each
# pytest-xdist worker from its own slice, taken in turn. A port from bind(("", 0)) is an
# ephemeral one: once its test is over, the kernel hands it to the next listener, such as a
# gloo pair in another test of a parallel run, and a client still retrying the old
# rendezvous (an elastic node that lost its store) then connects into that group and breaks
# its handshake ("Gloo connectFullMesh failed ... Connection closed by peer"). Below the
# range, nothing but these tests binds the port, and no two workers share a slice.
_LOWEST_PORT = 10000


def _port_slice() -> range:
    try:
        first_ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        first_ephemeral = 32768  # Linux's default
    workers = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0) % workers
    size = (first_ephemeral - _LOWEST_PORT) // workers
    return range(_LOWEST_PORT + worker * size, _LOWEST_PORT + (worker + 1) * size)


_PORTS = _port_slice()
_next_port = os.getpid() % max(1, len(_PORTS))


def free_port() -> int:
    """A TCP port of this test process's slice that is free on every address right now."""
    global _next_port
    for _ in range(len(_PORTS)):
        port = _PORTS[_next_port]
        _next_port = (_next_port + 1) % len(_PORTS)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # the slice is all taken
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


def restore_environ(saved: dict, environ=None) -> list[str]:
    """Make ``environ`` (``os.environ``) hold exactly ``saved`` again: the variables added
    since are removed, the changed or removed ones set back; an unchanged one is not
    written. Returns the names of those it removed or set, sorted."""
    environ = os.environ if environ is None else environ
    touched = sorted(set(environ) - set(saved))
    for name in touched:
        del environ[name]
    for name, value in saved.items():
        if environ.get(name) != value:
            environ[name] = value
            touched.append(name)
    return sorted(touched)


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


# The program run by run_commands_in_one_python: it reads a JSON list of command lines
# (each ``[script, args...]`` or ``["-m", module, args...]``) from stdin, runs each as
# ``python COMMAND`` would run it as __main__ (sys.argv, sys.path[0], stdout and stderr its
# own), and prints one JSON list of [exit code, stdout, stderr] after MARKER.
_ONE_PYTHON = r'''
import contextlib, io, json, os, runpy, sys, traceback
MARKER = sys.argv[1]
commands = json.load(sys.stdin)
path0 = sys.path[0]
answers = []
for command in commands:
    out, err = io.StringIO(), io.StringIO()
    module = command[0] == "-m"
    target = command[1] if module else command[0]
    sys.argv = [target, *command[2 if module else 1:]]
    sys.path[0] = os.getcwd() if module else os.path.dirname(os.path.abspath(target))
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            if module:
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(target, run_name="__main__")
        except SystemExit as exc:  # what the interpreter makes of it at exit
            if exc.code is None:
                code = 0
            elif isinstance(exc.code, int):
                code = exc.code
            else:
                print(exc.code, file=sys.stderr)
                code = 1
        except BaseException:
            traceback.print_exc()
            code = 1
    sys.path[0] = path0
    answers.append([code, out.getvalue(), err.getvalue()])
sys.stdout.write(MARKER + json.dumps(answers))
'''


def run_commands_in_one_python(commands, env=None, timeout: float = TIMEOUT) -> list[tuple[int, str, str]]:
    """``[run_python(command) for command in commands]``'s (exit code, stdout, stderr),
    the commands run one after another in one child Python instead of one each: for
    commands that end early (a usage error), whose cost is mostly the interpreter's start
    and its imports (torch: seconds), which they then pay once. Each command runs as
    ``python COMMAND`` runs it as __main__ (its sys.argv and sys.path[0], SystemExit's
    code, an uncaught exception's traceback on its stderr and exit code 1); the modules it
    imported stay loaded for the next, so use it only for commands that change no state
    another one reads. Past ``timeout`` (for all of them) the child's session is killed
    and the test fails, as :func:`run_python`."""
    import json

    marker = "\n=== run_commands_in_one_python answers ===\n"
    proc = subprocess.Popen(
        [sys.executable, "-c", _ONE_PYTHON, marker], cwd=REPO, env=env or child_env(),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(json.dumps([[str(a) for a in command] for command in commands]), timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{commands} timed out after {timeout}s in one python\nstdout:\n{out}\nstderr:\n{err}")
    assert proc.returncode == 0 and marker in out, f"the commands' python failed ({proc.returncode}):\n{out}\n{err}"
    return [tuple(answer) for answer in json.loads(out.split(marker, 1)[1])]
