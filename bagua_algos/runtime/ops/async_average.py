"""Bagua's asynchronous model average op: rounds on the communication thread while
training goes on, and the weight lock that keeps a round and a step apart."""

from __future__ import annotations

import threading

import torch

from .. import comm

__all__ = ["AsyncModelAverageOp"]


class _WeightLock:
    """A host lock whose hand-over also orders the CUDA work of the two threads.

    The training thread queues its steps on its stream and the communication thread its
    rounds on another; holding a ``threading.Lock`` orders only when they are *queued*.
    So each release records an event on the releasing thread's current stream, and the
    next holder's stream waits for it before touching the weights: on the GPU, too, a
    round never overlaps a step (the host never blocks on the GPU for it)."""

    def __init__(self, device: torch.device):
        self._lock = threading.Lock()
        self._device = device
        self._released = None  # torch.cuda.Event of the last release (CUDA only)

    def acquire(self) -> None:
        self._lock.acquire()
        if self._released is not None:
            torch.cuda.current_stream(self._device).wait_event(self._released)

    def release(self) -> None:
        if self._device.type == "cuda":
            self._released = torch.cuda.Event()
            self._released.record(torch.cuda.current_stream(self._device))
        self._lock.release()

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class AsyncModelAverageOp:
    """One round of asynchronous model averaging (Bagua's async op, on gloo too).

    A round copies the weights s under the weight lock, averages the copies over the
    group, and, under the lock again, moves the weights by the average's change:
    x ← x + (mean_j s_j − s), so local steps taken meanwhile are kept. Every round's
    allreduce also carries a stop flag: once any worker has called :meth:`abort`, all
    of them learn it in the same round and stop after it, so every worker runs the
    same number of collectives and nobody is left waiting.
    """

    def __init__(self, bucket, peer_selection_mode: str, group):
        if peer_selection_mode != "all":
            raise ValueError(f"the asynchronous model average supports peer_selection_mode='all' only, got {peer_selection_mode!r}")
        self.peer_selection_mode = peer_selection_mode
        self.group = group
        # One worker: a round moves the weights by s/1 - s = 0 and reads nothing else,
        # so it only counts (and learns of an abort); nothing to lock against.
        self.local_only = comm.get_world_size(group) == 1
        self._lock = _WeightLock(bucket.device)
        self._locked = False
        self._abort_requested = False
        self._stopped = False
        self.rounds = 0

    # --- the weight lock (training thread: forward to optimizer step) -----------------
    def lock_weight(self) -> None:
        if not self._locked and not self.local_only:
            self._lock.acquire()
            self._locked = True

    def unlock_weight(self) -> None:
        if self._locked:
            self._locked = False
            self._lock.release()

    # --- life cycle -----------------------------------------------------------------------
    def get_status(self) -> bool:
        """True while rounds still run (no worker has aborted)."""
        return not self._stopped

    def abort(self) -> None:
        """Ask every worker to stop after the next round."""
        self._abort_requested = True

    def reset(self) -> None:
        """Run rounds again after an abort."""
        self._abort_requested = False
        self._stopped = False

    def __call__(self, bucket) -> None:
        if self._stopped:
            return
        if self.local_only:
            self.rounds += 1
            self._stopped = self._abort_requested
            return
        with self._lock:
            snapshot = bucket.flattened_tensor()
        message = torch.cat([snapshot, snapshot.new_full((1,), 1.0 if self._abort_requested else 0.0)])
        comm.allreduce_inplace(message, comm.ReduceOp.SUM, group=self.group)
        size = comm.get_world_size(self.group)
        change = message[:-1].div_(size).sub_(snapshot)
        with self._lock:
            flat = bucket.flat_view()
            flat.add_(change)
            bucket.write_flat(flat)
        self.rounds += 1
        if message[-1].item() > 0:
            self._stopped = True
