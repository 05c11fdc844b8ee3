"""The base the three random linear sketches share (``unbiased_low_rank``,
``random_block``, ``random_k``; seed 001 Tables 1 and 4): their Bagua
``AlgorithmImpl`` and the checks of their common arguments. Each algorithm's own file
declares its arguments and registers its name; the math is
:mod:`bagua_algos.compression.random_sketch`.

Each bucket gets one op, run by the communication thread when the bucket's gradients are
ready: draw this step's sketch (the same on every worker), pack the sketches, one
allreduce-mean, decompress into the gradients; with error feedback each worker keeps its
residual A − D(C(A)) in ``bucket.state["error"]``. The generator's state is in
``bucket.state`` too, so ``module.bagua_state_dict()`` resumes a run bit for bit.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..arguments import check_flag, check_real, check_seed
from ..compression import powersgd as psgd
from ..compression import random_sketch as sketch
from ..runtime import comm
from .byte_counts import CountsBytes
from ..runtime.algorithm import Algorithm, AlgorithmImpl

__all__ = ["RandomSketchAlgorithm", "RandomSelectionAlgorithm", "RandomSketchAlgorithmImpl"]


class RandomSketchAlgorithm(Algorithm):
    """Settings every sketch has; a subclass sets ``method`` and its size arguments and
    implements :meth:`plan`."""

    method = ""
    error_feedback: bool
    seed: int

    def plan(self, shapes: Sequence[Sequence[int]]) -> sketch.SketchPlan:
        raise NotImplementedError

    def reify(self, process_group) -> "RandomSketchAlgorithmImpl":
        return RandomSketchAlgorithmImpl(process_group, self)


class RandomSelectionAlgorithm(RandomSketchAlgorithm):
    """The arguments Random Block and Random K share (a subclass sets ``method``).

    Args:
        powersgd_rank: send per tensor what rank-r PowerSGD sends (int ≥ 1; the default,
            1, when ``compression_ratio`` is not given either).
        compression_ratio: send ceil(numel / ratio) entries of every tensor instead
            (a finite number ≥ 1); give one of the two.
        min_compression_rate: with ``powersgd_rank``, PowerSGD's rule for which matrices
            it compresses (≥ 1); the others are sent whole.
        error_feedback: keep each worker's unsent entries and add them to the next
            gradient (True, as in the seed).
        seed: the entries sent (the same on every worker).
    """

    def __init__(self, powersgd_rank=None, compression_ratio=None, min_compression_rate: float = 2.0,
                 error_feedback: bool = True, seed: int = 0):
        self.powersgd_rank, self.compression_ratio = sketch.selection_size_arguments(powersgd_rank, compression_ratio)
        self.min_compression_rate = check_real("min_compression_rate", min_compression_rate, 1.0)
        self.error_feedback = check_flag("error_feedback", error_feedback)
        self.seed = check_seed(seed)

    def plan(self, shapes):
        return sketch.make_plan(self.method, shapes, min_compression_rate=self.min_compression_rate,
                                compression_ratio=self.compression_ratio, powersgd_rank=self.powersgd_rank)


class RandomSketchAlgorithmImpl(CountsBytes, AlgorithmImpl):
    # At another world size every rank loads the first rank's file: its residual, loaded
    # by all n, would be sent n times, so each worker's own residual starts again at 0.
    WORLD_SIZE_RULE = {"step counter, the shared sketch's generator": "carried over",
                       "error-feedback residuals": "reset to zero (each worker's own residual)"}
    RESET_BUCKET_KEYS = frozenset({"error"})

    def __init__(self, process_group, settings: RandomSketchAlgorithm):
        super().__init__(process_group)
        self.settings = settings
        self._plans: dict = {}
        """bucket name → its ``SketchPlan``."""
        self.init_byte_counts()  # bytes_last_step, bytes_total, uncompressed_bytes_last_step

    def init_operations(self, bagua_ddp, bucket) -> None:
        bucket.clear_ops()
        shapes = bucket.shapes  # a worker's
        plan = self._plans[bucket.name] = self.settings.plan(shapes)
        if bucket.state.get("plan_shapes") != [list(s) for s in shapes]:
            names = ",".join(t.bagua_tensor_name for t in bucket.tensors)
            bucket.state.clear()
            bucket.state.update(sketch.init_state(psgd.stable_seed(self.settings.seed, names)))
            if self.settings.error_feedback:
                bucket.state["error"] = bucket.flat_zeros()  # [W, N], a row per worker
            bucket.state["plan_shapes"] = [list(s) for s in shapes]
        bucket.append_python_op(lambda name, b=bucket: self._run(bagua_ddp, b), group=self.process_group)

    def _run(self, bagua_ddp, bucket) -> None:
        plan = self._plans[bucket.name]
        with torch.no_grad():
            flat = bucket.flat_view()
            tensors = sketch.split(flat, plan.numels)
            error = bucket.state.get("error")
            errors = None if error is None else sketch.split(error, plan.numels)

            def allreduce_mean(t):
                comm.allreduce_inplace(t, comm.ReduceOp.AVG, group=self.process_group)

            draws = sketch.draw(plan, bucket.state, flat.device, flat.dtype)
            sent = sketch.compress_aggregate(plan, draws, tensors, errors, allreduce_mean)
            bucket.write_flat(flat)
        self.count_bytes(bagua_ddp.bagua_train_step_counter, sent, sum(plan.numels) * flat.element_size())


    def state_dict(self) -> dict:
        return {"bytes_total": self.bytes_total}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.bytes_total = int(state.get("bytes_total", 0))

