"""One job of forked workers that leave the interpreter normally, for the exit checks.

A fork costs nothing where a fresh interpreter costs seconds, and each worker ends
with ``sys.exit`` (atexit hooks, module teardown, C++ static destructors), which is
where a process group torn down badly aborts.
"""

import os
import sys
import traceback


def run_forked_job(world: int, worker) -> list[int]:
    """Fork ``world`` processes, each running ``worker(rank)`` and exiting with its
    return value (``None``: 0; an exception: 3, its traceback on stderr); the exit code
    of each, in rank order (a negative code is the signal that killed the worker)."""
    pids = []
    for rank in range(world):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            try:
                code = worker(rank) or 0
            except BaseException:  # noqa: BLE001 - reported through the exit code
                traceback.print_exc()
                code = 3
            sys.exit(code)  # a normal interpreter exit, not os._exit
        pids.append(pid)
    return [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
