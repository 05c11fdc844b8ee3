"""Run a function on N gloo (or NCCL) workers on this machine: the tests, and
``reproduce``'s count of the bytes each algorithm hands to collectives.

``run_workers(fn, world_size, *args)`` spawns ``world_size`` processes that rendezvous
through a file store, join the process group (gloo unless ``backend="nccl"``: each
worker then on GPU LOCAL_RANK) with a short timeout, call
``fn(rank, world_size, *args)`` and send back its return value. A worker's exception
fails the caller with that worker's traceback; a worker that does not finish within
``timeout`` seconds is killed and fails the caller too, so nothing hangs.

``WorkerPool(world_size)`` spawns the workers once and keeps them, in one process
group, for many calls: ``pool.run(fn, *args)`` returns what ``run_workers`` would,
without paying a spawn (seconds) per call. Tests share one through a module- or
session-scoped fixture.

``fn`` travels by reference (pickled by its module and name), so it must be a function
at the top level of a module the workers can import.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import sys
import tempfile
import time
import traceback
from datetime import timedelta


DEFAULT_TIMEOUT = 120.0

# What the fork server imports once, so that a worker forked from it starts with torch
# loaded (importing torch, and torch._dynamo that the first optimizer imports, costs a
# spawned worker about 2.5 CPU-seconds: most of the suite's CPU time was spent so).
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch.optim"]


def _context():
    """The multiprocessing context of the workers: "forkserver" with :data:`PRELOAD`.
    Like "spawn" a worker inherits no threads, CUDA state or test state of this process
    (only what it is given); unlike it, the environment and the working directory are
    the server's unless passed, so each worker is given this process's
    (:func:`_as_parent`)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _parent_state() -> tuple:
    """This process's environment and working directory, for :func:`_as_parent`."""
    return dict(os.environ), os.getcwd()


def _as_parent(state: tuple) -> None:
    """In a worker: the environment and working directory its caller had when it was
    started, as a spawned process would have."""
    environ, cwd = state
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)


def _join_group(rank, world_size, store_path, pg_timeout, env, backend):
    """In a worker: its launcher variables, one thread, the process group joined; the comm module."""
    os.environ.update(env)
    local_size = int(env.get("LOCAL_WORLD_SIZE", world_size))
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank % local_size), "LOCAL_WORLD_SIZE": str(local_size)})
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from bagua_algos.runtime import comm

    store = dist.FileStore(store_path, world_size)
    comm.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout))
    return comm


def _worker(rank, world_size, store_path, fn, args, results, pg_timeout, env, backend, parent):
    try:
        _as_parent(parent)
        comm = _join_group(rank, world_size, store_path, pg_timeout, env, backend)
        results.put((rank, "joined", None))
        try:
            value = fn(rank, world_size, *args)
        finally:
            comm.destroy_process_group()
        # Plain pickle bytes: tensors are copied, not shared through file descriptors
        # that vanish when this process exits.
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - every failure goes back to the test
        results.put((rank, "error", traceback.format_exc()))


def run_workers(fn, world_size: int, *args, timeout: float = DEFAULT_TIMEOUT, pg_timeout: float = 30.0,
                env: dict | None = None, backend: str = "gloo"):
    """``[fn(0, n, *args), ..., fn(n-1, n, *args)]``, each run in its own worker of a
    ``backend`` group ("gloo": CPU tensors, and CUDA tensors staged through the host;
    "nccl": CUDA tensors over NCCL, CPU tensors over gloo, one GPU per worker).

    Workers whose group does not form (a worker failed to join it, and ``fn`` finished
    nowhere) are spawned once more, with a line on stderr: a gloo handshake can be broken
    from outside the test, by a client of another test, run beside it, still retrying
    an address whose ephemeral port the kernel has since handed to this group's listener
    ("Gloo connectFullMesh failed ... Connection closed by peer"). A group that does not
    form twice fails the caller."""
    for attempt in (1, 2):
        outcome, failures, _joined = _spawn_and_collect(fn, world_size, args, timeout, pg_timeout, env, backend)
        # a worker that failed to join leaves the group unformed for all, whoever else joined
        # (those then wait in their first collective until the timeout): spawn again unless
        # some worker finished fn
        finished = any(status == "ok" for status, _ in outcome.values())
        formation_failed = not finished and any("in _join_group" in failure for failure in failures)
        if attempt == 1 and formation_failed:
            print(f"run_workers: the {world_size} workers' group did not form; spawning them once more. "
                  f"First failure:\n{failures[0][-1500:]}", file=sys.stderr, flush=True)
            continue
        break
    if failures:
        raise AssertionError("distributed test failed:\n" + "\n".join(failures))
    return [pickle.loads(outcome[r][1]) for r in range(world_size)]


def _spawn_and_collect(fn, world_size, args, timeout, pg_timeout, env, backend):
    """One spawn of :func:`run_workers`: (each rank's (status, value), the failures, the
    ranks that joined the group)."""
    ctx = _context()
    results = ctx.Queue()
    outcome: dict[int, tuple[str, object]] = {}
    failures: list[str] = []
    joined: set[int] = set()
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_worker, args=(r, world_size, store_path, fn, args, results, pg_timeout, dict(env or {}), backend,
                                              _parent_state()),
                        daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        try:
            while len(outcome) < world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = sorted(set(range(world_size)) - set(outcome))
                    failures.append(f"workers {missing} did not finish within {timeout:.0f} s")
                    break
                try:
                    rank, status, value = results.get(timeout=min(remaining, 1.0))
                except queue.Empty:
                    dead = [r for r, p in enumerate(procs) if r not in outcome and p.exitcode is not None]
                    if not dead:
                        continue
                    # Give its message a moment to arrive; a crash may send none.
                    try:
                        rank, status, value = results.get(timeout=2.0)
                    except queue.Empty:
                        failures.append(f"worker(s) {dead} exited with code(s) {[procs[r].exitcode for r in dead]} without a result")
                        break
                if status == "joined":
                    joined.add(rank)
                    continue
                outcome[rank] = (status, value)
                if status == "error":
                    failures.append(f"--- worker {rank} failed:\n{value}")
                    # Peers of a failed worker would wait for it until their timeout.
                    deadline = min(deadline, time.monotonic() + 5.0)
        finally:
            for p in procs:
                p.join(timeout=0.5 if failures else 10.0)
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
    return outcome, failures, joined


def _pool_worker(rank, world_size, store_path, tasks, results, pg_timeout, env, backend, parent):
    """A pool worker: join the group, then run each task ``(call, fn, args)`` from
    ``tasks`` until ``None`` comes; every result goes back tagged with its call number
    (0: the worker could not start)."""
    try:
        _as_parent(parent)
        comm = _join_group(rank, world_size, store_path, pg_timeout, env, backend)
    except BaseException:  # noqa: BLE001
        results.put((rank, 0, "error", traceback.format_exc()))
        return
    try:
        while True:
            task = tasks.get()
            if task is None:
                break
            call, fn, args = task
            try:
                results.put((rank, call, "ok", pickle.dumps(fn(rank, world_size, *args))))
            except BaseException:  # noqa: BLE001 - every failure goes back to the caller
                results.put((rank, call, "error", traceback.format_exc()))
    finally:
        comm.destroy_process_group()


class WorkerPool:
    """``world_size`` spawned workers in one process group (as ``run_workers`` makes
    them) that stay up between calls: ``run(fn, *args)`` is ``[fn(0, n, *args), ...,
    fn(n-1, n, *args)]``, the calls one after another in the same group.

    A worker's exception fails that call (with its traceback) and leaves the pool
    usable once every rank has answered; a call whose workers do not all answer within
    its ``timeout`` (or a worker that dies) fails and shuts the pool down, so every later
    call fails at once instead of waiting. ``close()`` (or leaving a ``with`` block)
    stops the workers. Workers whose group does not form are spawned once more during
    the first call, as :func:`run_workers` does."""

    def __init__(self, world_size: int, *, pg_timeout: float = 30.0, env: dict | None = None, backend: str = "gloo"):
        self.world_size = world_size
        self.broken = ""  # why the pool can no longer be used
        self._calls = 0
        self._worker_args = (pg_timeout, dict(env or {}), backend)
        self._respawned = False  # the group is formed anew at most once (as run_workers does)
        self._spawn()

    def _spawn(self):
        """Start the workers, with a fresh store for their group."""
        ctx = _context()
        self._tmp = tempfile.TemporaryDirectory()
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        store_path = os.path.join(self._tmp.name, "store")
        self._procs = [
            ctx.Process(target=_pool_worker, args=(r, self.world_size, store_path, self._tasks[r], self._results,
                                                   *self._worker_args, _parent_state()), daemon=True)
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()

    def _respawn_if_unformed(self, call: int, outcome: dict, why: str) -> bool:
        """At the first call, when a worker could not join the group and no worker has
        answered, spawn the workers once more (see :func:`run_workers`); True if it did."""
        if call != 1 or outcome or self._respawned or "in _join_group" not in why:
            return False
        print(f"WorkerPool: the {self.world_size} workers' group did not form; spawning them once more. "
              f"First failure:\n{why[-1500:]}", file=sys.stderr, flush=True)
        self._respawned = True
        self._stop_workers()
        self._spawn()
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def run(self, fn, *args, timeout: float = DEFAULT_TIMEOUT):
        """Every worker's ``fn(rank, world_size, *args)``; the first call also waits for
        the workers to start, within the same ``timeout``."""
        if self.broken:
            raise AssertionError(f"the worker pool was shut down: {self.broken}")
        self._calls += 1
        call = self._calls
        for tasks in self._tasks:
            tasks.put((call, fn, args))
        outcome: dict[int, tuple[str, object]] = {}
        failures = []
        deadline = time.monotonic() + timeout
        while len(outcome) < self.world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(self.world_size)) - set(outcome))
                self._shut_down(f"workers {missing} did not answer call {call} within {timeout:.0f} s")
                break
            try:
                rank, got_call, status, value = self._results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if r not in outcome and p.exitcode is not None]
                if dead:
                    self._shut_down(f"worker(s) {dead} exited with code(s) {[self._procs[r].exitcode for r in dead]}")
                    break
                continue
            if got_call == 0:
                if self._respawn_if_unformed(call, outcome, value):
                    for tasks in self._tasks:
                        tasks.put((call, fn, args))
                    continue
                self._shut_down(f"worker {rank} could not start:\n{value}")
                break
            if got_call != call:  # cannot happen: a call that did not finish shuts the pool down
                self._shut_down(f"worker {rank} answered call {got_call} during call {call}")
                break
            outcome[rank] = (status, value)
            if status == "error":
                failures.append(f"--- worker {rank} failed:\n{value}")
        if self.broken:
            failures.append(self.broken)
        if failures:
            raise AssertionError("distributed call failed:\n" + "\n".join(failures))
        return [pickle.loads(outcome[r][1]) for r in range(self.world_size)]

    def _stop_workers(self):
        """Kill the workers that are still running, and remove their store."""
        for p in self._procs:
            if p.is_alive():
                p.kill()
            p.join()
        self._tmp.cleanup()

    def _shut_down(self, why: str):
        self.broken = why
        self._stop_workers()

    def close(self):
        if self.broken:
            return
        for tasks in self._tasks:
            tasks.put(None)
        for p in self._procs:
            p.join(timeout=10.0)
        self._shut_down("closed")
