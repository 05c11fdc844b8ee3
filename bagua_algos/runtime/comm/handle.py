"""Pending communications: :class:`CommHandle` and the finishers run on ``wait()``."""

from __future__ import annotations

from .fault_tolerance import _ft, report_error

class CommHandle:
    """A pending communication; ``wait()`` blocks until it is done and runs the finishers.

    Finishers are callables run once, in order, in the thread that calls ``wait()``,
    after every underlying work completed (e.g. dividing a sum by the group size to
    emulate AVG). A failed work raises from ``wait()`` and the finishers do not run.
    """

    def __init__(self, works=(), finishers=()):
        self._works = [w for w in works if w is not None]
        self._finishers = list(finishers)
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        for work in self._works:
            if _ft["manager"] is None:
                work.wait()
                continue
            try:  # under torchft a failed collective discards the step instead of raising
                work.wait()
            except Exception as exc:  # noqa: BLE001 - reported; should_commit() says False everywhere
                report_error(exc)
                self._done = True
                return
        for finish in self._finishers:
            finish()
        self._done = True

    def then(self, finisher) -> "CommHandle":
        """Run ``finisher()`` after the others once the communication is done."""
        if self._done:
            finisher()
        else:
            self._finishers.append(finisher)
        return self

    def is_completed(self) -> bool:
        """Whether the communication itself has finished (without waiting, and
        without running the finishers: only ``wait()`` does that)."""
        return self._done or all(w.is_completed() for w in self._works)

    @property
    def done(self) -> bool:
        """Whether ``wait()`` has returned (finishers run)."""
        return self._done


def _finish(handle: CommHandle, async_op: bool):
    if async_op:
        return handle
    handle.wait()
    return None


def _skip(async_op: bool):
    return CommHandle() if async_op else None
