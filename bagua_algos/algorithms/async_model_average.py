"""Asynchronous model averaging, Bagua's ``async`` algorithm.

Workers never wait for each other while training: a background thread averages the
models every ``sync_interval_ms`` milliseconds, with its own process group (so its
collectives never interleave with the training thread's), while forward, backward and
optimizer steps go on. One background round (the bucket's asynchronous op) copies the
weights s, averages the copies over all workers and moves each model by the change,
x ← x + (mean_j s_j − s), so local steps taken during the round are kept. The weights
are locked from each forward until the optimizer step, so a round never writes the
model in the middle of a step.

The first ``warmup_steps`` steps run synchronous gradient allreduce instead (the
algorithm then rebuilds its buckets through ``need_reset``). ``abort(module)`` stops the
background rounds (every worker stops after the same round, then the models are
averaged once more, synchronously, so they end equal); ``resume(module)`` starts them
again. Call ``abort`` before the end of training, on every worker.

Example::

    algorithm = AsyncModelAverageAlgorithm(sync_interval_ms=100)
    model = model.with_bagua([optimizer], algorithm)
    for x, y in loader:
        ...                     # forward, backward, optimizer.step() as usual
    model.bagua_algorithm.abort(model)
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
import warnings
from typing import TYPE_CHECKING

from ..arguments import check_choice, check_int
from ..runtime import comm
from ..runtime.algorithm import (Algorithm, AlgorithmImpl, BackwardHook, ForwardPreHook, PostBackwardHook,
                                 PostOptimizerStepHook)
from ..runtime.bucket import BaguaBucket
from .model_averaging import ModelAveragingAlgorithmImpl
from .table import AlgorithmConfig, register_algorithm

if TYPE_CHECKING:
    from ..runtime.ddp import BaguaDistributedDataParallel

__all__ = ["AsyncModelAverageAlgorithm", "AsyncModelAverageAlgorithmImpl"]


class AsyncModelAverageAlgorithmImpl(ModelAveragingAlgorithmImpl):
    """Model averaging after the warm-up; during it, gradient allreduce (the
    defaults of ``AlgorithmImpl``), so the hooks are its own."""
    WORLD_SIZE_RULE = {
        "step counter, step_id": "carried over",
        "background rounds": "reset (counted from 0 by each run; not saved)",
    }

    # The weights are locked from the forward pre-hook until the step's hook unlocks
    # them: without an optimizer step the background rounds would wait for ever.
    needs_optimizer_step = True

    def __init__(self, process_group, peer_selection_mode: str = "all", sync_interval_ms: int = 500,
                 warmup_steps: int = 0):
        super().__init__(process_group)
        self.peer_selection_mode = peer_selection_mode
        self.sync_interval_ms = sync_interval_ms
        self.warmup_steps = warmup_steps
        self.step_id = 0  # need_reset() calls, i.e. training forwards
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="bagua-async")
        self._future = None
        self._exit_hook_registered = False
        self.rounds = 0
        # The background thread's collectives go through a group of their own.
        self.thread_group = comm.new_group(comm.group_ranks(process_group))

    # Steps 1..warmup_steps allreduce gradients; the buckets are rebuilt for the
    # asynchronous phase at the forward of step warmup_steps + 1 (as in Bagua).
    @property
    def _warmup_buckets(self) -> bool:
        return self.step_id < self.warmup_steps

    @property
    def _warming_up(self) -> bool:
        return self.step_id <= self.warmup_steps

    def need_reset(self) -> bool:
        self.step_id += 1
        return self.warmup_steps > 0 and self.step_id == self.warmup_steps + 1

    def init_tensors(self, bagua_ddp: BaguaDistributedDataParallel) -> list:
        if self._warmup_buckets:
            return AlgorithmImpl.init_tensors(self, bagua_ddp)  # the gradients
        return super().init_tensors(bagua_ddp)  # the parameters

    def tensors_to_buckets(self, tensors: list, do_flatten: bool) -> list[BaguaBucket]:
        if not any(tensors):
            raise ValueError(
                "AsyncModelAverageAlgorithm: the module has no parameter that requires grad, so there are "
                "no weights to average; wrap a module with trainable parameters"
            )
        if not do_flatten:
            raise ValueError("AsyncModelAverageAlgorithm needs do_flatten=True (it averages one flat buffer)")
        if self._warmup_buckets:
            return super().tensors_to_buckets(tensors, do_flatten)
        return [BaguaBucket([t for group in tensors for t in group], flatten=True, name="0")]

    def init_operations(self, bagua_ddp: BaguaDistributedDataParallel, bucket: BaguaBucket) -> None:
        bucket.clear_ops()
        if self._warmup_buckets:
            bucket.append_centralized_synchronous_op(average=True, group=self.process_group)
        else:
            bucket._async_op = bucket.append_asynchronous_model_average_op(
                peer_selection_mode=self.peer_selection_mode, group=self.thread_group
            )

    # --- hooks ----------------------------------------------------------------------
    def init_forward_pre_hook(self, bagua_ddp: BaguaDistributedDataParallel) -> ForwardPreHook:
        def hook(inputs):
            if self._warming_up:
                return
            if self._future is None and self.sync_interval_ms > 0:
                self._start(bagua_ddp)
            self._lock(bagua_ddp)

        return hook

    def init_backward_hook(self, bagua_ddp: BaguaDistributedDataParallel) -> BackwardHook:
        def hook(name, parameter):
            if self._warming_up:
                parameter.bagua_mark_communication_ready()

        return hook

    def init_post_backward_hook(self, bagua_ddp: BaguaDistributedDataParallel) -> PostBackwardHook:
        def hook():
            if self._warming_up:
                bagua_ddp._bagua_backend.wait_pending_comm_ops()

        return hook

    def init_post_optimizer_step_hook(self, bagua_ddp: BaguaDistributedDataParallel) -> PostOptimizerStepHook:
        def hook(optimizer):
            if not self._warming_up:
                self._unlock(bagua_ddp)

        return hook

    # --- the background loop ----------------------------------------------------------
    def _ops(self, bagua_ddp):
        return [bucket._async_op for bucket in bagua_ddp.bagua_buckets if hasattr(bucket, "_async_op")]

    def _lock(self, bagua_ddp) -> None:
        for op in self._ops(bagua_ddp):
            op.lock_weight()

    def _unlock(self, bagua_ddp) -> None:
        for op in self._ops(bagua_ddp):
            op.unlock_weight()

    def _start(self, bagua_ddp) -> None:
        for op in self._ops(bagua_ddp):
            op.reset()
        self._future = self._executor.submit(self._loop, bagua_ddp)
        if not self._exit_hook_registered:
            # The executor's own exit hook joins its thread, which loops until aborted:
            # a script that never calls abort() would hang at exit. Ours is registered
            # later, so it runs first (they run in reverse order) and ends the loop.
            threading._register_atexit(lambda: self._stop_at_exit(bagua_ddp))
            self._exit_hook_registered = True

    def _stop_rounds(self, bagua_ddp, timeout_s: float | None = None) -> None:
        """Ask every worker to stop after the next round (the stop flag travels in that
        round's allreduce) and wait for this worker's loop to end; re-raises what the
        loop raised. No final average: the other workers may still be training. Without
        ``timeout_s`` the wait is bounded by the thread group's timeout, which ends a
        round whose peers are gone."""
        future = self._future
        if future is None:
            return
        self._unlock(bagua_ddp)
        for op in self._ops(bagua_ddp):
            op.abort()
        try:
            future.result(timeout=timeout_s)
        finally:
            self._future = None

    def _stop_at_exit(self, bagua_ddp, timeout_s: float = 60.0) -> None:
        """At interpreter exit without abort() or detach(): stop the rounds, warn if
        they do not end cleanly."""
        try:
            self._stop_rounds(bagua_ddp, timeout_s)
        except BaseException as error:  # noqa: BLE001 — at exit, report and let the process end
            warnings.warn(f"AsyncModelAverageAlgorithm: the background averaging did not stop cleanly at exit ({error!r}); "
                          "call model.bagua_algorithm.abort(model) on every worker before exiting", RuntimeWarning)

    def on_detach(self, bagua_ddp) -> None:
        """``detach()`` stops the background rounds (every worker's, after the same
        round), so that no thread goes on writing a detached model or using the
        process group; the parameters keep their values (no final average: that is
        :meth:`abort`)."""
        self._stop_rounds(bagua_ddp)

    def _loop(self, bagua_ddp) -> None:
        ops = self._ops(bagua_ddp)
        while all(op.get_status() for op in ops):
            for bucket in bagua_ddp.bagua_buckets:
                for tensor in bucket.tensors:
                    tensor.bagua_mark_communication_ready_without_synchronization()
            bagua_ddp._bagua_backend.wait_pending_comm_ops()
            self.rounds += 1
            time.sleep(self.sync_interval_ms / 1000)

    def abort(self, module) -> None:
        """Stop the background rounds on every worker, then average the models once,
        synchronously (collective: call it on every worker)."""
        bagua_ddp = _bagua_ddp_of(module)
        if self._future is None:
            return
        self._unlock(bagua_ddp)
        comm.barrier(group=self.process_group)
        self._stop_rounds(bagua_ddp)
        for bucket in bagua_ddp.bagua_buckets:
            flat = bucket.flat_view()
            comm.allreduce_inplace(flat, comm.ReduceOp.AVG, group=self.process_group)
            bucket.write_flat(flat)

    def resume(self, module) -> None:
        """Start the background rounds again after :meth:`abort` (on every worker)."""
        bagua_ddp = _bagua_ddp_of(module)
        if self._future is not None or self._warming_up:
            return
        comm.barrier(group=self.process_group)
        self._start(bagua_ddp)

    def state_dict(self) -> dict:
        return {"step_id": self.step_id}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.step_id = int(state["step_id"])


def _bagua_ddp_of(module):
    bagua_ddp = module.__dict__.get("bagua_ddp") if hasattr(module, "__dict__") else None
    if bagua_ddp is None and hasattr(module, "bagua_buckets") and hasattr(module, "_bagua_backend"):
        bagua_ddp = module  # already the BaguaDistributedDataParallel
    if bagua_ddp is None:
        raise TypeError(f"abort()/resume() take the module given to with_bagua, got {type(module).__name__}")
    return bagua_ddp


class AsyncModelAverageAlgorithm(Algorithm):
    """Bagua's asynchronous model averaging.

    Args:
        peer_selection_mode: ``"all"`` (every worker's model is averaged in each round).
        sync_interval_ms: milliseconds between background rounds (0 disables them).
        warmup_steps: synchronous gradient-allreduce steps before the asynchronous phase.
    """

    #: Why the one-process engine refuses it (engine/runtime.py asks before training).
    ENGINE_REFUSAL = (
        "its workers average on a background thread every sync_interval_ms of wall-clock time while "
        "training goes on, so which steps an average sees depends on each process's speed and has no "
        "deterministic stacked form")

    def __init__(self, peer_selection_mode: str = "all", sync_interval_ms: int = 500, warmup_steps: int = 0):
        self.peer_selection_mode = check_choice("peer_selection_mode", peer_selection_mode, ("all",))
        self.sync_interval_ms = check_int("sync_interval_ms", sync_interval_ms, 0)
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 0)

    def reify(self, process_group) -> AsyncModelAverageAlgorithmImpl:
        return AsyncModelAverageAlgorithmImpl(
            process_group, self.peer_selection_mode, self.sync_interval_ms, self.warmup_steps
        )


register_algorithm(
    "async", AsyncModelAverageAlgorithm, "average the models in the background while training goes on",
    rows=[(370, AlgorithmConfig("async", "async", {"sync_interval_ms": 5}, replicas="drift", background_rounds=True,
                                exact_alone=True))],
)
