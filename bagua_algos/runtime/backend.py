"""The per-module communication backend: readiness, bucket order, and one worker thread.

Bagua's Rust backend keeps, for each module, the buckets in their registered order,
learns which tensors are ready (``tensor.bagua_mark_communication_ready()``), and runs
a ready bucket's ops, in the order they were appended, on a communication thread, so
the training thread goes on with backward while earlier buckets communicate. This is
the same design in Python:

1. ``register_ordered_buckets(buckets)``: the order every rank schedules buckets in;
2. ``mark_communication_ready(tensor)`` (training thread, or any thread): once bucket k
   and every bucket before it are ready, they are handed to the worker in order, so
   every rank issues its collectives in the same order whatever order gradients come;
3. the worker runs each bucket's ops one after the other (an op may block on a
   collective: only the worker waits, and a multi-stage op such as compress →
   collective → decompress never blocks the training thread between its stages);
4. ``wait_pending_comm_ops()``: hands over the buckets left of a round that has begun
   (tensors that got no gradient count as ready, as in DDP with unused parameters),
   waits until the worker has run everything, and re-raises the first error an op
   raised, with the op's traceback.

On CUDA the worker runs ops on its own stream: it waits for the events recorded when
tensors were marked ready, and ``wait_pending_comm_ops`` makes the caller's stream wait
for the communication stream.

The interface, for another kind of backend (the one-process engine's runs a bucket's
ops at once on the marking thread):

- a bucket is anything with the :class:`ExecutableBucket` methods (``BaguaBucket`` has
  them): this module imports no bucket, so the buckets' module may import this one;
- :meth:`BaguaBackend.dispatch` is what happens to a bucket once it and every bucket
  before it are ready; a subclass overrides it;
- :func:`register_backend` makes a backend the one ``get_backend`` returns for a module
  name, and :func:`unregister_backend` forgets it.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
import traceback
from typing import Protocol

import torch

__all__ = ["BaguaBackend", "CommOpError", "ExecutableBucket", "get_backend", "register_backend",
           "stop_communication_threads", "unregister_backend"]

# How long the exit hook waits, in all, for ops still running on the communication threads
# (e.g. the script died of an exception mid-step) before leaving them running.
EXIT_JOIN_TIMEOUT_S = 60.0

# Tells a worker to return (queued after the jobs handed over before it).
_STOP = None


class CommOpError(RuntimeError):
    """An op failed on the communication thread; the message holds its traceback."""


class ExecutableBucket(Protocol):
    """What a backend asks of a bucket (``runtime/bucket.py``'s ``BaguaBucket``)."""

    name: str
    tensors: list  # the Bagua tensors whose readiness makes the bucket ready
    device: torch.device  # where its ops run (a CUDA device: on the backend's stream)

    def before_ops(self) -> None:
        """The effective tensors back in the bucket's buffer (on the training thread)."""

    def is_local_only(self) -> bool:
        """Whether its ops only count on the host: run on the marking thread, no event."""

    def run_ops(self) -> None:
        """Its ops, once, in order."""


class BaguaBackend:
    """Bucket scheduling and the communication thread of one module."""

    def __init__(self, module_name: str):
        self.module_name = module_name
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._buckets: list[ExecutableBucket] = []
        self._slot: dict[int, tuple[int, int]] = {}  # id(proxy tensor) → (bucket, tensor index)
        self._ready: list[set[int]] = []
        self._events: list[list] = []
        self._next = 0  # first bucket of this round not handed to the worker yet
        self._in_flight = 0
        self._error: tuple[BaseException, str, str] | None = None
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stopped: threading.Thread | None = None  # told to stop, maybe still running
        self._streams: dict = {}
        self._done_events: list = []

    # --- set-up -------------------------------------------------------------------------
    def register_ordered_buckets(self, buckets: list[ExecutableBucket]) -> None:
        """Schedule ``buckets`` in this order from now on (pending ops finish first)."""
        self.wait_pending_comm_ops()
        slot = {}
        for b, bucket in enumerate(buckets):
            for t, tensor in enumerate(bucket.tensors):
                key = id(tensor)
                if key in slot:
                    raise ValueError(
                        f"Bagua tensor {tensor.bagua_tensor_name!r} is in two buckets "
                        f"({buckets[slot[key][0]].name!r} and {bucket.name!r})"
                    )
                slot[key] = (b, t)
        with self._lock:
            self._buckets = list(buckets)
            self._slot = slot
            self._ready = [set() for _ in buckets]
            self._events = [[] for _ in buckets]
            self._next = 0

    def wants_event(self, tensor: torch.Tensor) -> bool:
        """Whether marking ``tensor`` ready needs a CUDA event: not when its bucket's ops
        all run on the marking thread without touching device data (one worker)."""
        where = self._slot.get(id(tensor))
        return where is None or not self._buckets[where[0]].is_local_only()

    @property
    def buckets(self) -> list[ExecutableBucket]:
        return list(self._buckets)

    # --- readiness ----------------------------------------------------------------------
    def mark_communication_ready(self, tensor: torch.Tensor, event=None) -> None:
        """Mark ``tensor`` (a Bagua tensor of one of the registered buckets) ready."""
        with self._lock:
            where = self._slot.get(id(tensor))
            if where is None:
                raise ValueError(
                    f"Bagua tensor {getattr(tensor, 'bagua_tensor_name', '?')!r} is not in any bucket "
                    f"registered with the backend of module {self.module_name!r}"
                )
            b, t = where
            self._ready[b].add(t)
            if event is not None:
                self._events[b].append(event)
            while self._next < len(self._buckets):
                k = self._next
                if len(self._ready[k]) < len(self._buckets[k].tensors):
                    break
                self._hand_over(k)

    def _hand_over(self, k: int) -> None:
        """Advance the round past bucket ``k`` (lock held) and dispatch it."""
        bucket = self._buckets[k]
        events = self._events[k]
        self._ready[k] = set()
        self._events[k] = []
        self._next = k + 1
        if self._next == len(self._buckets):
            self._next = 0  # the round is complete; the next one starts from bucket 0
        self.dispatch(bucket, events)

    def dispatch(self, bucket: ExecutableBucket, events: list) -> None:
        """Have ``bucket``'s ops run: it and every bucket before it are ready. Called with
        the backend's lock held, on the thread that marked the last tensor ready, once
        per bucket and round, in the registered order; ``events`` are the CUDA events
        recorded when its tensors were marked. Here: its ops go to the communication
        thread (or run here when they only count on the host), and an error is raised
        at ``wait_pending_comm_ops``. A backend of another kind overrides it."""
        if bucket.is_local_only():
            # Every op is a no-op or a host-side count here (one worker): run them on
            # this thread; the effective tensors need not be in the buffer for that.
            try:
                bucket.run_ops()
            except BaseException as exc:  # noqa: BLE001 - reported at the wait, as the thread's
                if self._error is None:
                    self._error = (exc, bucket.name, traceback.format_exc())
            return
        bucket.before_ops()  # effective tensors back in the bucket's buffer (training thread)
        self._in_flight += 1
        self._start_worker()
        self._jobs.put((bucket, events))

    def _round_started(self) -> bool:
        return self._next > 0 or any(self._ready[k] for k in range(len(self._buckets)))

    # --- waiting ------------------------------------------------------------------------
    def wait_pending_comm_ops(self) -> None:
        """Hand over the rest of a round that has begun, wait for all ops, re-raise errors."""
        with self._lock:
            if self._buckets and self._round_started():
                for k in range(self._next, len(self._buckets)):
                    self._hand_over(k)
            while self._in_flight:
                self._idle.wait()
            error, self._error = self._error, None
            done_events, self._done_events = self._done_events, []
        for device, event in done_events:
            torch.cuda.current_stream(device).wait_event(event)
        if error is not None:
            exc, bucket_name, text = error
            raise CommOpError(
                f"an op of bucket {bucket_name!r} (module {self.module_name!r}) failed on the "
                f"communication thread:\n{text}"
            ) from exc

    # --- the communication thread -------------------------------------------------------
    def _start_worker(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            _register_exit_hook()
            # A thread told to stop may still be running the ops queued before the stop:
            # the new one waits for it, so ops still run one at a time, in order.
            previous, self._stopped = self._stopped, None
            self._thread = threading.Thread(
                target=self._work, args=(previous,), name=f"bagua-comm-{self.module_name}", daemon=True
            )
            self._thread.start()

    def stop(self, timeout: float | None = None) -> bool:
        """End the communication thread once the ops handed to it have run (a new one
        starts on the next hand-over). Returns whether it ended within ``timeout`` s."""
        thread = self._request_stop()
        if thread is not None:
            thread.join(timeout)
        return thread is None or not thread.is_alive()

    def _request_stop(self) -> threading.Thread | None:
        """Queue the stop marker; the thread that will see it (None if there is none)."""
        with self._lock:
            thread = self._thread
            if thread is None:
                return None
            self._jobs.put(_STOP)
            self._thread, self._stopped = None, thread
            return thread

    def _work(self, previous: threading.Thread | None) -> None:
        if previous is not None:
            previous.join()
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            bucket, events = job
            done = None
            try:
                if self._error is None:  # after a failure, later buckets are skipped
                    done = self._run(bucket, events)
            except BaseException as exc:  # noqa: BLE001 - every failure reaches the trainer
                with self._lock:
                    if self._error is None:
                        self._error = (exc, bucket.name, traceback.format_exc())
            with self._lock:
                if done is not None:
                    self._done_events.append(done)
                self._in_flight -= 1
                if self._in_flight == 0:
                    self._idle.notify_all()
            del job, bucket, events, done  # an idle thread keeps no bucket (nor its groups) alive

    def _run(self, bucket: ExecutableBucket, events):
        device = bucket.device
        if device.type != "cuda":
            bucket.run_ops()
            return None
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        for event in events:
            stream.wait_event(event)
        with torch.cuda.stream(stream):
            bucket.run_ops()
        done = torch.cuda.Event()
        done.record(stream)
        return device, done


_backends: dict[str, BaguaBackend] = {}
_backends_lock = threading.Lock()


def get_backend(module_name: str) -> BaguaBackend:
    """The backend of the module named ``module_name`` (created on first use)."""
    backend = _backends.get(module_name)  # never replaced while registered: no lock needed to find it
    if backend is not None:
        return backend
    with _backends_lock:
        backend = _backends.get(module_name)
        if backend is None:
            backend = _backends[module_name] = BaguaBackend(module_name)
        return backend


def register_backend(module_name: str, backend: BaguaBackend) -> None:
    """Make ``backend`` the one :func:`get_backend` returns for ``module_name`` (a
    backend of another kind, made by its owner). A name has one backend while it is
    registered: registering a second one for it is refused."""
    if not isinstance(backend, BaguaBackend):
        raise TypeError(f"register_backend: backend must be a BaguaBackend, got {type(backend).__name__}")
    with _backends_lock:
        present = _backends.get(module_name)
        if present is not None and present is not backend:
            raise ValueError(f"register_backend: module {module_name!r} has a backend already; "
                             "unregister_backend it first, or use another module name")
        _backends[module_name] = backend


def unregister_backend(module_name: str) -> None:
    """Forget the backend of ``module_name`` (none registered: nothing to do); the next
    :func:`get_backend` for the name makes a new one. Its thread is not stopped here."""
    with _backends_lock:
        _backends.pop(module_name, None)


def stop_communication_threads(timeout: float | None = None) -> bool:
    """End every module's communication thread after the ops already handed to it;
    whether all ended within ``timeout`` seconds (one deadline for all of them)."""
    with _backends_lock:
        backends = list(_backends.values())
    threads = [t for t in (b._request_stop() for b in backends) if t is not None]
    deadline = None if timeout is None else time.monotonic() + timeout
    for thread in threads:
        thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
    return not any(t.is_alive() for t in threads)


# Why the threads are ended at exit: they are daemon threads, and CPython ends a daemon
# thread that wakes up during interpreter finalization with pthread_exit. When that
# happens inside torch's C++ code (an op that released the GIL, e.g. a matrix product
# or a gloo wait), the unwinding meets a noexcept frame and std::terminate aborts the
# process ("terminate called without an active exception", SIGABRT), even after a
# successful run. Ending them first, at exit, lets the last op finish and leaves no
# thread of ours running during finalization. The hook is registered when the first
# thread starts, i.e. after comm.init_process_group registered its own exit hook, so
# (atexit runs hooks last-in first-out) the threads end before the groups are destroyed.
_exit_hook = {"registered": False}


def _register_exit_hook() -> None:
    if not _exit_hook["registered"]:
        atexit.register(stop_communication_threads, EXIT_JOIN_TIMEOUT_S)
        _exit_hook["registered"] = True
