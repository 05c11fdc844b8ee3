"""A process leaves cleanly while (or after) its communication threads work.

CPython kills a daemon thread that wakes up during interpreter finalization with
pthread_exit; inside torch's C++ code that ends in std::terminate ("terminate called
without an active exception", SIGABRT). The runtime ends its communication threads at
exit, after the ops handed to them, so no thread of ours is running then.
"""

from __future__ import annotations

import threading
import time

import torch

from bagua_algos.runtime import backend as backend_module
from bagua_algos.runtime.backend import BaguaBackend
from subprocesses import REPO, child_env, run_python

SCRIPT = REPO / "tests" / "launch_workers" / "exit_mid_op.py"


class FakeBucket:
    """What the backend needs of a bucket: tensors, a name, a device and its ops."""

    def __init__(self, name: str, log: list, seconds: float = 0.0):
        self.name = name
        self.tensors = [torch.zeros(1)]
        self.device = torch.device("cpu")
        self._log, self._seconds = log, seconds

    def before_ops(self) -> None:
        pass

    def is_local_only(self) -> bool:
        return False  # its ops stand for communication: they run on the communication thread

    def run_ops(self) -> None:
        time.sleep(self._seconds)
        self._log.append((self.name, threading.current_thread().name))


def hand_over(backend: BaguaBackend, bucket: FakeBucket) -> None:
    backend.mark_communication_ready(bucket.tensors[0])


def test_stop_runs_what_was_handed_over_and_ends_the_thread():
    log: list = []
    slow, fast = FakeBucket("slow", log, seconds=0.3), FakeBucket("fast", log)
    backend = BaguaBackend("stop-test")
    backend.register_ordered_buckets([slow, fast])
    hand_over(backend, slow)
    thread = backend._thread
    assert backend.stop(timeout=10)  # waits for the slow op, which still runs
    assert not thread.is_alive() and log == [("slow", "bagua-comm-stop-test")]
    hand_over(backend, fast)  # a new thread starts for the next hand-over
    backend.wait_pending_comm_ops()
    assert [name for name, _ in log] == ["slow", "fast"]
    assert backend.stop(timeout=10) and backend.stop(timeout=10)  # idempotent


def test_ops_stay_in_order_when_a_stopped_thread_is_still_busy():
    log: list = []
    first, second = FakeBucket("first", log, seconds=0.4), FakeBucket("second", log)
    backend = BaguaBackend("busy-stop-test")
    backend.register_ordered_buckets([first, second])
    hand_over(backend, first)
    assert not backend.stop(timeout=0.01)  # still running the first op
    hand_over(backend, second)  # the new thread waits for the old one
    backend.wait_pending_comm_ops()
    assert [name for name, _ in log] == ["first", "second"]
    backend.stop(timeout=10)


def test_idle_thread_holds_no_bucket():
    import gc
    import weakref

    log: list = []
    bucket = FakeBucket("b", log)
    backend = BaguaBackend("idle-test")
    backend.register_ordered_buckets([bucket])
    hand_over(backend, bucket)
    backend.wait_pending_comm_ops()
    ref = weakref.ref(bucket)
    backend.register_ordered_buckets([])
    del bucket
    for _ in range(50):  # the thread drops its references right after the op's bookkeeping
        gc.collect()
        if ref() is None:
            break
        time.sleep(0.01)
    assert ref() is None
    backend.stop(timeout=10)


def test_stop_communication_threads_covers_every_module():
    log: list = []
    buckets = [FakeBucket(f"m{i}", log, seconds=0.05) for i in range(3)]
    backends = [backend_module.get_backend(f"exit-test-module-{i}") for i in range(3)]
    for b, bucket in zip(backends, buckets):
        b.register_ordered_buckets([bucket])
        hand_over(b, bucket)
    threads = [b._thread for b in backends]
    assert backend_module.stop_communication_threads(timeout=10)
    assert sorted(name for name, _ in log) == ["m0", "m1", "m2"]
    assert not any(t.is_alive() for t in threads)



def test_a_backend_of_another_kind_is_registered_and_dispatches_its_buckets():
    """register_backend makes a backend the module's (one per name); its dispatch is what
    happens to a ready bucket (here: run at once on the marking thread)."""
    import pytest

    class AtOnce(BaguaBackend):
        def dispatch(self, bucket, events) -> None:
            bucket.before_ops()
            bucket.run_ops()

    log: list = []
    mine = AtOnce("exit-test-registered")
    backend_module.register_backend("exit-test-registered", mine)
    try:
        assert backend_module.get_backend("exit-test-registered") is mine
        backend_module.register_backend("exit-test-registered", mine)  # the same one again: nothing changes
        with pytest.raises(ValueError, match="module 'exit-test-registered' has a backend already"):
            backend_module.register_backend("exit-test-registered", BaguaBackend("exit-test-registered"))
        with pytest.raises(TypeError, match="backend must be a BaguaBackend, got dict"):
            backend_module.register_backend("exit-test-other", {})
        bucket = FakeBucket("a", log)
        mine.register_ordered_buckets([bucket])
        hand_over(mine, bucket)
        assert log == [("a", threading.current_thread().name)] and mine._thread is None
    finally:
        backend_module.unregister_backend("exit-test-registered")
    assert backend_module.get_backend("exit-test-registered") is not mine
    backend_module.unregister_backend("exit-test-registered")

def test_leaving_mid_op_finishes_the_op_and_exits_with_the_scripts_code():
    """sys.exit(0) / an uncaught error right after buckets were handed over: before the
    fix 6 of 8 such runs aborted with SIGABRT (exit code -6) and the op never finished."""
    runs = []
    for mode, expected in (("exit", 0), ("raise", 1)) * 2:
        code, out, err = run_python([SCRIPT, mode], env=child_env(), timeout=60)
        runs.append((mode, code))
        assert "terminate called" not in err, f"{mode}: {err[-2000:]}"
        assert code == expected, f"{mode}: exit code {code}\n{err[-2000:]}"
        assert "op of bucket" in out and "done" in out, f"{mode}: the op did not finish\n{out}"
    print(runs)


def test_async_algorithm_exits_without_abort():
    """A script that never calls abort() under the async algorithm ends: the exit hook
    stops the background rounds on every worker (the stop flag travels in a round)."""
    from subprocesses import free_port

    worker = REPO / "tests" / "launch_workers" / "async_no_abort.py"
    for steps in ("5", "40"):  # workers reach their exit at different times in both cases
        code, out, err = run_python(["-m", "bagua_algos.launch", "--nproc_per_node", "2", "--master_port",
                                     str(free_port()), worker, steps], timeout=90)
        assert code == 0, f"stdout:\n{out}\nstderr:\n{err[-3000:]}"
        assert "terminate called" not in err
        assert out.count("exiting without abort()") == 2
