"""The helper thread that posts the second level of a two-level allreduce on gloo."""

from __future__ import annotations

import queue
import threading



class _Job:
    """A function run on the helper thread; ``wait()`` re-raises its exception."""

    def __init__(self, fn):
        self._fn = fn
        self._event = threading.Event()
        self._error = None

    def run(self) -> None:
        try:
            self._fn()
        except BaseException as exc:  # noqa: BLE001 - handed to wait()
            self._error = exc
        finally:
            self._event.set()

    def wait(self) -> None:
        self._event.wait()
        if self._error is not None:
            raise self._error

    def is_completed(self) -> bool:
        return self._event.is_set()


_helper = {"thread": None, "queue": None, "lock": threading.Lock()}


def _submit(fn) -> _Job:
    """Run ``fn`` on the helper thread, after every job submitted before it."""
    job = _Job(fn)
    with _helper["lock"]:
        if _helper["thread"] is None:
            q = queue.SimpleQueue()

            def loop():
                while True:
                    item = q.get()
                    if item is None:
                        return
                    item.run()

            thread = threading.Thread(target=loop, name="bagua-algos-comm", daemon=True)
            thread.start()
            _helper.update(thread=thread, queue=q)
        _helper["queue"].put(job)
    return job


def _stop_helper(timeout_s: float) -> None:
    """End the helper thread after its queued jobs (waiting ``timeout_s`` at most)."""
    with _helper["lock"]:
        thread, q = _helper["thread"], _helper["queue"]
        _helper.update(thread=None, queue=None)
    if thread is not None:
        q.put(None)
        thread.join(timeout_s)
