"""Run a function on N gloo (or NCCL) workers on this machine, for tests.

``run_workers(fn, world_size, *args)`` spawns ``world_size`` processes that rendezvous
through a file store, join the process group (gloo unless ``backend="nccl"``: each
worker then on GPU LOCAL_RANK) with a short timeout, call
``fn(rank, world_size, *args)`` and send back its return value. A worker's exception
fails the caller with that worker's traceback; a worker that does not finish within
``timeout`` seconds is killed and fails the caller too, so nothing hangs.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import time
import traceback
from datetime import timedelta


DEFAULT_TIMEOUT = 120.0


def _worker(rank, world_size, store_path, fn, args, results, pg_timeout, env, backend):
    os.environ.update(env)
    local_size = int(env.get("LOCAL_WORLD_SIZE", world_size))
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank % local_size), "LOCAL_WORLD_SIZE": str(local_size)})
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        from bagua_algos.runtime import comm

        store = dist.FileStore(store_path, world_size)
        comm.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout))
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
    "nccl": CUDA tensors over NCCL, CPU tensors over gloo, one GPU per worker)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_worker, args=(r, world_size, store_path, fn, args, results, pg_timeout, dict(env or {}), backend),
                        daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        outcome: dict[int, tuple[str, object]] = {}
        failures = []
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
                    if dead:
                        # Give its message a moment to arrive; a crash may send none.
                        try:
                            rank, status, value = results.get(timeout=2.0)
                        except queue.Empty:
                            failures.append(f"worker(s) {dead} exited with code(s) {[procs[r].exitcode for r in dead]} without a result")
                            break
                    else:
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
    if failures:
        raise AssertionError("distributed test failed:\n" + "\n".join(failures))
    return [pickle.loads(outcome[r][1]) for r in range(world_size)]
