"""PowerSGD (seed 001) as a Bagua gradient algorithm, with the thesis's variants (seed 000).

Each bucket gets one op, run by the communication thread as soon as the bucket's
gradients are ready, so a bucket's compression overlaps the rest of backward:

1. the uncompressed tensors (vectors, 0-dim tensors, matrices compressing less than
   ``min_compression_rate``) start one packed allreduce-mean;
2. A_i = G_i + λ·e_i, P_i = A_i Q_i for every compressed tensor, written into one
   packed buffer, one allreduce-mean of all P's;
3. orthogonalize the P's, one batch per matrix shape;
4. Q_i = A_iᵀ P_i into one packed buffer, one allreduce-mean of all Q's;
5. G_i ← P_i Q_iᵀ, e_i ← A_i − P_i Q_iᵀ; Q kept for the warm start.

With ``power_iterations=k`` steps 2–4 run k times, each from the last Q (seed 001's
best-approximation PowerSGD, Table 2 and Appendix G.7).

The math is :mod:`bagua_algos.compression.powersgd`; this file only wires it to the
runtime. Steps with ``bagua_train_step_counter ≤ start_iter`` (the counter is 1 on
the first training forward) allreduce the gradients uncompressed, so ``start_iter=0``
compresses from the first step.

Per-bucket state (Q's, error buffer, generator state, counts) is in ``bucket.state``
and so in ``module.bagua_state_dict()``: a resumed run continues bit for bit.

Variants (seed 000 §3.4, §4.1.2):

- ``error_decay=λ``: A = G + λ·e (decaying error feedback).
- ``nesterov=λ_n``: before each forward the compressed weights move to w − λ_n·e;
  after backward they are restored (from a copy, so every worker holds the same w).
- ``async_error="full"`` / ``"adaptive"``: after compressing, the error buffer (all of
  it, or a slice) is averaged over the workers by an asynchronous allreduce that runs
  during the next forward/backward; the next step's op waits for it before using e.
  The adaptive slice halves when the previous transfer had not finished on some worker
  when the op began (every worker learns it through one extra element of the P
  allreduce, so all agree on the size) and shifts by its length every step, so the
  whole buffer is covered.
- ``error_in_grad=True`` (DALL-E, seed 000 §3.4): no error buffer. Between steps
  ``p.grad`` of each compressed parameter holds λ·e, so backward accumulates
  A = G + λ·e in place. The op writes the update P Qᵀ into a buffer that exists only
  from the op to the end of ``optimizer.step()`` (``p.grad`` points to it meanwhile)
  and leaves e = A − P Qᵀ in the gradient buffer, where the post-step hook points
  ``p.grad`` back (uncompressed gradients are zeroed there). **Do not call
  ``optimizer.zero_grad()``** in this mode: it would erase the error. The algorithm
  checks before each forward and raises if the gradients were set to None or zeroed.

On CUDA no hook and no op waits for the GPU, with two exceptions that need a value on
the host: ``async_error="adaptive"`` reads the agreed "late" flag (the slice length is
a Python int that slices the error buffer), waiting for the P allreduce only, not for
the rest of the bucket's work queued behind it; and ``error_in_grad``'s zero_grad
guard reads one probed gradient entry, copied asynchronously before the forward and
read after backward (so on CUDA a zeroed gradient is reported at the end of that
backward, before ``optimizer.step()``; on CPU before the forward, as the check runs).
The orthogonalization's compiled module is loaded (on a GPU built, the first time)
when the buckets are set up, not in the first step.
"""

from __future__ import annotations

import math

import torch

from ..compression import orthogonalization
from ..compression import powersgd as psgd
from ..compression.orthogonalization import METHODS as ORTHOGONALIZATION_METHODS
from ..compression.orthogonalization import DEFAULT_EPSILON
from ..arguments import check_choice, check_flag, check_int, check_real, check_seed
from ..runtime import comm
from .byte_counts import CountsBytes
from ..runtime.algorithm import Algorithm, AlgorithmImpl
from .table import AlgorithmConfig, register_algorithm

__all__ = ["PowerSGDAlgorithm", "PowerSGDAlgorithmImpl", "ASYNC_ERROR_MODES"]

ASYNC_ERROR_MODES = (None, "full", "adaptive")


class PowerSGDAlgorithmImpl(CountsBytes, AlgorithmImpl):
    WORLD_SIZE_RULE = {
        "step counter, Q factors, their generator, counts": "carried over (the same on every rank, whatever n)",
        "error buffers": "reset to zero (each rank's own residual: the new ranks have none of the old ones)",
    }
    RESET_BUCKET_KEYS = frozenset({"error"})

    def __init__(self, process_group, settings: "PowerSGDAlgorithm"):
        super().__init__(process_group)

        # --- settings (fixed for the algorithm's life) -------------------------------------
        self.settings = settings
        """The validated constructor arguments (``PowerSGDAlgorithm``)."""
        self.options = psgd.PowerSGDOptions(
            warm_start=settings.warm_start,
            error_feedback=settings.error_feedback,
            error_decay=settings.error_decay,
            orthogonalization=settings.orthogonalization,
            epsilon=settings.epsilon,
            error_in_grad=settings.error_in_grad,
            power_iterations=settings.power_iterations,
        )
        """What ``compression.powersgd.compress_aggregate`` needs of the settings."""

        # --- per bucket, set by init_operations (the state proper is in bucket.state) ------
        self._plans: dict = {}
        """bucket name → ``BucketPlan``: which tensors are compressed, shape groups, offsets."""
        self._compressed_params: dict = {}
        """bucket name → [(tensor index in the bucket, parameter)] of the compressed tensors."""

        # --- async_error: error averages in flight ------------------------------------------
        self._async_handles: dict = {}
        """bucket name → handle of the error (slice) allreduce started by the last op;
        the next op, a checkpoint or Nesterov's move waits for it first."""

        # --- nesterov: weights moved to w − λ_n·e for the forward, restored after backward -
        self._nesterov_backup: dict = {}
        """id(parameter) → the copy of w taken before the move."""
        self._nesterov_moved = False
        """Whether the parameters are moved now (so post-backward restores them)."""

        # --- error_in_grad: the error lives in p.grad between steps -------------------------
        self._approx_buffers: dict = {}
        """bucket name → (flat buffer, {tensor index: view}) holding the update P·Qᵀ from
        the op until optimizer.step() has read it (p.grad points to it meanwhile)."""
        self._probes: dict = {}
        """bucket name → (tensor index, entry position, "was it nonzero"): one error entry
        watched to catch a zero_grad between steps (kept on the device)."""
        self._erased_checks: list = []
        """(name, pinned host flag, CUDA event) of probe reads queued before a forward,
        read after backward (CUDA only)."""
        self._error_held = False
        """Whether p.grad holds the error now (set after the first optimizer step)."""

        # --- byte counters (read by users and benchmarks) -----------------------------------
        self.init_byte_counts()  # bytes_last_step, bytes_total, uncompressed_bytes_last_step

    @property
    def gradients_accumulate(self) -> bool:
        """With ``error_in_grad`` the error waits in p.grad for backward to add G to it."""
        return self.options.error_in_grad

    @property
    def matrix_approximation_rank(self) -> int:
        """r, the rank of each compressed gradient matrix's approximation (``settings.rank``;
        a matrix with fewer rows or columns than r gets that smaller rank)."""
        return self.settings.rank

    # --- set-up -------------------------------------------------------------------------
    def init_operations(self, bagua_ddp, bucket) -> None:
        bucket.clear_ops()
        if self.settings.error_in_grad and not bucket.flatten:
            raise ValueError(
                "PowerSGDAlgorithm(error_in_grad=True) keeps the error in the bucket's gradient buffer; "
                "wrap with do_flatten=True"
            )
        shapes = bucket.shapes  # a worker's
        plan = psgd.make_plan(shapes, self.matrix_approximation_rank, self.settings.min_compression_rate)
        if plan.groups:
            orthogonalization.prepare(self.options.orthogonalization, bucket.device)
        self._plans[bucket.name] = plan
        self._compressed_params[bucket.name] = [(i, bucket.tensors[i]) for i in plan.compressed]
        if bucket.state.get("plan_shapes") != [list(s) for s in shapes]:
            names = ",".join(t.bagua_tensor_name for t in bucket.tensors)
            seed = psgd.stable_seed(self.settings.seed, names)
            error_buffer = self.options.error_feedback and not self.options.error_in_grad
            bucket.state.clear()
            bucket.state.update(psgd.init_state(plan, seed, bucket.dtype, bucket.device, error_buffer,
                                                lead=self._lead(bucket)))
            bucket.state["plan_shapes"] = [list(s) for s in shapes]
            if self.settings.async_error is not None:
                bucket.state["async_offset"] = 0
                bucket.state["async_length"] = plan.error_numel
        bucket.append_python_op(lambda name, b=bucket: self._run(bagua_ddp, b), group=self.process_group)

    @staticmethod
    def _lead(bucket) -> tuple:
        """The leading worker dimension the compression sees: ``(W,)`` for the W > 1 rows
        of the bucket's ``[W, L]`` flat tensor, none for one row (W = 1: a job's worker),
        whose matrices take the fused per-matrix CPU passes (and whose error buffer is
        ``[error_numel]``). A property of the data: an engine of one worker is alike."""
        return () if bucket.workers == 1 else (bucket.workers,)

    def _grads(self, bucket, flat):
        lead, out, offset = self._lead(bucket), [], 0
        for shape in bucket.shapes:
            n = math.prod(shape)
            out.append(flat[..., offset : offset + n].view(*lead, *shape))
            offset += n
        return out

    # --- the op (communication thread) --------------------------------------------------
    def _run(self, bagua_ddp, bucket) -> None:
        step = bagua_ddp.bagua_train_step_counter
        flat = bucket.flat_view()
        sent = 0
        grad_bytes = bucket.bytes()  # a worker's
        if step <= self.settings.start_iter:
            comm.allreduce_inplace(flat, comm.ReduceOp.AVG, group=self.process_group)
            bucket.write_flat(flat)
            self.count_bytes(step, bucket.numel * flat.element_size(), grad_bytes)
            return
        plan = self._plans[bucket.name]
        state = bucket.state
        late = None
        if self.settings.async_error is not None:
            handle = self._async_handles.pop(bucket.name, None)
            if self.settings.async_error == "adaptive":
                # Whether this worker's last transfer had not finished (a host-side query,
                # no wait); it rides the P allreduce, so every worker learns whether any was.
                is_late = handle is not None and not handle.is_completed()
                late = torch.full((*self._lead(bucket), 1), 1.0 if is_late else 0.0, dtype=torch.float32,
                                  device=flat.device)
            if handle is not None:
                handle.wait()
        grads = self._grads(bucket, flat)
        out = None
        if self.options.error_in_grad:
            approx = torch.empty(*self._lead(bucket), plan.error_numel, dtype=flat.dtype, device=flat.device)
            out = {}
            for i in plan.compressed:
                offset = plan.error_offsets[i]
                out[i] = approx[..., offset : offset + plan.numel(i)].view(grads[i].shape)
            self._approx_buffers[bucket.name] = (approx, out)

        rows = flat.shape[0]  # W: comm takes [W, ...] (a view of the compression's contiguous buffers)

        def allreduce_mean(t):
            comm.allreduce_inplace(t.view(rows, -1), comm.ReduceOp.AVG, group=self.process_group)

        def start_allreduce_mean(t):
            return comm.allreduce_inplace(t.view(rows, -1), comm.ReduceOp.AVG, group=self.process_group,
                                          async_op=True)

        result = psgd.compress_aggregate(plan, grads, state, self.options, allreduce_mean, start_allreduce_mean,
                                         out=out, p_extra=late)
        sent += result.total
        if not self.options.error_in_grad:
            bucket.write_flat(flat)
        if self.settings.async_error is not None and plan.error_numel:
            # adaptive: the slice length is a Python int, so the agreed flag is read on the
            # host; on CUDA this waits for the P allreduce (an event), not for the whole step.
            someone_late = late is not None and float(result.p_extra_on_host()[0]) > 0
            sent += self._start_error_average(bucket, someone_late)
        self.count_bytes(step, sent, grad_bytes)

    def _start_error_average(self, bucket, someone_late: bool) -> int:
        state = bucket.state
        error = state["error"]
        total = error.shape[-1]  # a worker's

        def start_mean(t):  # (comm takes [W, ...]: the error is [error_numel] for one row)
            return comm.allreduce_inplace(t.view(bucket.workers, -1), comm.ReduceOp.AVG, group=self.process_group,
                                          async_op=True)

        if self.settings.async_error == "full":
            piece = error
        else:
            if someone_late:
                state["async_length"] = max(1, state["async_length"] // 2)
            length = min(state["async_length"], total)
            start = state["async_offset"] % total
            end = start + length
            if end <= total:
                piece = error[..., start:end]
            else:  # wraps around: average a contiguous copy, then write it back
                piece = None
                idx = torch.arange(start, end, device=error.device) % total
                copy = error.index_select(-1, idx).contiguous()
                handle = start_mean(copy)
                handle.then(lambda: error.index_copy_(error.dim() - 1, idx, copy))
                self._async_handles[bucket.name] = handle
                state["async_offset"] = end % total
                return copy.shape[-1] * copy.element_size()
            state["async_offset"] = end % total
        if not piece.is_contiguous():  # (a slice of every worker's row: the engine)
            whole, piece = piece, piece.contiguous()
            handle = start_mean(piece)
            handle.then(lambda: whole.copy_(piece))
        else:
            handle = start_mean(piece)
        self._async_handles[bucket.name] = handle
        return piece.shape[-1] * piece.element_size()


    def wait_async_error(self) -> None:
        """Wait for the error averages still in flight (before reading the errors)."""
        for name in list(self._async_handles):
            self._async_handles.pop(name).wait()

    # --- hooks (training thread) --------------------------------------------------------
    def _compressing(self, bagua_ddp) -> bool:
        return bagua_ddp.bagua_train_step_counter > self.settings.start_iter

    def _error_of(self, bucket, index: int, param) -> torch.Tensor:
        if self.options.error_in_grad:
            return param.grad
        plan = self._plans[bucket.name]
        offset = plan.error_offsets[index]
        numel = plan.numel(index)  # a worker's
        return bucket.state["error"][..., offset : offset + numel].view(param.shape)

    def init_forward_pre_hook(self, bagua_ddp):
        def hook(inputs):
            if self.options.error_in_grad and self._error_held:
                self._check_error_kept(bagua_ddp)
            if self.settings.nesterov and self._compressing(bagua_ddp) and self.options.error_feedback:
                self.wait_async_error()
                params, backups, errors = [], [], []
                for bucket in bagua_ddp.bagua_buckets:
                    for index, param in self._compressed_params[bucket.name]:
                        backup = self._nesterov_backup.get(id(param))
                        if backup is None or backup.shape != param.shape:
                            backup = self._nesterov_backup[id(param)] = torch.empty_like(param)
                        params.append(param)
                        backups.append(backup)
                        errors.append(self._error_of(bucket, index, param))
                if params:
                    with torch.no_grad():  # w ← w − λ_n·e, a copy of w kept (one _foreach op each)
                        torch._foreach_copy_(backups, params)
                        torch._foreach_sub_(params, errors, alpha=self.settings.nesterov)
                self._nesterov_moved = True

        return hook

    def init_post_backward_hook(self, bagua_ddp):
        def hook():
            try:
                bagua_ddp._bagua_backend.wait_pending_comm_ops()
            finally:
                if getattr(self, "_nesterov_moved", False):
                    self._nesterov_moved = False
                    params = [param for bucket in bagua_ddp.bagua_buckets
                              for _, param in self._compressed_params[bucket.name]]
                    if params:
                        with torch.no_grad():
                            torch._foreach_copy_(params, [self._nesterov_backup[id(p)] for p in params])
            if self.options.error_in_grad:
                self._report_erased_error()
            if self.options.error_in_grad and self._compressing(bagua_ddp):
                for bucket in bagua_ddp.bagua_buckets:
                    entry = self._approx_buffers.get(bucket.name)
                    if entry is None:
                        continue
                    _, out = entry
                    for index, param in self._compressed_params[bucket.name]:
                        param.grad = out[index]

        return hook

    def init_post_optimizer_step_hook(self, bagua_ddp):
        def hook(optimizer):
            if not self.options.error_in_grad:
                return
            if not self._approx_buffers:  # an uncompressed step: the user does not zero gradients
                with torch.no_grad():
                    for bucket in bagua_ddp.bagua_buckets:
                        for tensor, grad in zip(bucket.tensors, self._grads(bucket, bucket.backend_tensor)):
                            tensor.bagua_setter_closure(grad.zero_())
                self._probes.clear()
                self._error_held = True
                return
            # p.grad ← λ·e (in the bucket's buffer); uncompressed gradients ← 0.
            with torch.no_grad():
                for bucket in bagua_ddp.bagua_buckets:
                    if self._approx_buffers.pop(bucket.name, None) is None:
                        continue
                    grads = self._grads(bucket, bucket.backend_tensor)
                    plan = self._plans[bucket.name]
                    for tensor, grad in zip(bucket.tensors, grads):
                        tensor.bagua_setter_closure(grad)
                    if plan.uncompressed:
                        torch._foreach_zero_([grads[i] for i in plan.uncompressed])
                    if self.options.error_decay != 1.0 and plan.compressed:
                        torch._foreach_mul_([grads[i] for i in plan.compressed], self.options.error_decay)
                    if plan.compressed:
                        # The probe: the largest error entry of the first compressed tensor
                        # (position and "was it nonzero" stay on the device: no host wait).
                        first = grads[plan.compressed[0]].reshape(-1)
                        k = first.abs().argmax().view(1)
                        self._probes[bucket.name] = (plan.compressed[0], k, first.index_select(0, k) != 0)
            self._error_held = True

        return hook

    def _check_error_kept(self, bagua_ddp) -> None:
        """error_in_grad: the gradients hold the error; refuse to go on if it was erased.
        A gradient set to None is seen at once. Whether the probed entry was zeroed is a
        value on the device: on CPU it is read here; on CUDA it is copied to the host
        asynchronously and read after backward (:meth:`_report_erased_error`)."""
        for bucket in bagua_ddp.bagua_buckets:
            probe = self._probes.get(bucket.name)
            for index, param in self._compressed_params[bucket.name]:
                if param.grad is None:
                    raise RuntimeError(f"parameter {param.bagua_tensor_name!r} has grad None: {self._ERASED_FIX}")
            if probe is None:
                continue
            index, k, was_nonzero = probe
            grad = bucket.tensors[index].grad
            name = bucket.tensors[index].bagua_tensor_name
            if grad.data_ptr() == 0:
                raise RuntimeError(f"the gradient of {name!r} was zeroed: {self._ERASED_FIX}")
            erased = (was_nonzero & (grad.reshape(-1).index_select(0, k) == 0)).view(())
            if erased.device.type == "cuda":
                host = torch.empty((), dtype=torch.bool, pin_memory=True)
                host.copy_(erased, non_blocking=True)
                done = torch.cuda.Event()
                done.record(torch.cuda.current_stream(erased.device))
                self._erased_checks.append((name, host, done))
            elif bool(erased):
                raise RuntimeError(f"the gradient of {name!r} was zeroed: {self._ERASED_FIX}")

    def _report_erased_error(self) -> None:
        """Raise for a zeroed gradient found by a check queued before this backward (CUDA)."""
        checks, self._erased_checks = self._erased_checks, []
        for name, host, done in checks:
            done.synchronize()  # queued before the forward: long done by now
            if bool(host):
                raise RuntimeError(f"the gradient of {name!r} was zeroed: {self._ERASED_FIX}")

    _ERASED_FIX = ("PowerSGDAlgorithm(error_in_grad=True) keeps the compression error in p.grad between steps; "
                   "remove optimizer.zero_grad() / module.zero_grad() from the training loop (the algorithm resets "
                   "the gradients itself after optimizer.step()), or use error_in_grad=False")

    # --- checkpointing --------------------------------------------------------------------
    def state_dict(self) -> dict:
        self.wait_async_error()  # the error buffers must be final before they are copied
        return {"bytes_total": self.bytes_total}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.wait_async_error()
        self.bytes_total = int(state.get("bytes_total", 0))


class PowerSGDAlgorithm(Algorithm):
    """PowerSGD gradient compression (Vogels et al.), registered as ``"powersgd"``.

    Args:
        rank: r, the rank of each gradient matrix's approximation (int ≥ 1).
        start_iter: steps with ``bagua_train_step_counter ≤ start_iter`` allreduce
            uncompressed (int ≥ 0; 0 compresses from the first step).
        min_compression_rate: compress a matrix only if n·m ≥ rate·(n + m)·r (≥ 1).
        warm_start: keep Q from step to step (True) or redraw it every step.
        error_feedback: keep each worker's compression error and add it back.
        error_decay: λ ∈ [0, 1], A = G + λ·e (1: the paper's error feedback).
        orthogonalization: one of ``compression.orthogonalization.METHODS``.
        epsilon: norms are clamped to ≥ epsilon when orthogonalizing, so zero and
            rank-deficient gradients give zeros (0 turns the clamp off, as torch's
            hook: a zero gradient then gives NaN).
        seed: the initial Q's (identical on every worker).
        nesterov: λ_n ≥ 0; > 0 enables Nesterov error feedback (0: off).
        async_error: None, ``"full"`` or ``"adaptive"`` (asynchronous error averaging).
        error_in_grad: keep the error in the gradient buffer (no extra buffer).
        power_iterations: k ≥ 1 steps of subspace iteration per training step, each
            from the last Q (P and Q averaged k times: k times the bytes). Seed 001's
            "best approximation" (Table 2, Appendix G.7) is ``power_iterations=4,
            warm_start=False``; 1 is PowerSGD.
    """

    def __init__(self, rank: int = 1, start_iter: int = 0, min_compression_rate: float = 2.0,
                 warm_start: bool = True, error_feedback: bool = True, error_decay: float = 1.0,
                 orthogonalization: str = "auto", epsilon: float = DEFAULT_EPSILON, seed: int = 0,
                 nesterov: float = 0.0, async_error=None, error_in_grad: bool = False, power_iterations: int = 1):
        self.rank = check_int("rank", rank, 1)
        self.start_iter = check_int("start_iter", start_iter, 0)
        self.min_compression_rate = check_real("min_compression_rate", min_compression_rate, 1.0)
        self.warm_start = check_flag("warm_start", warm_start)
        self.error_feedback = check_flag("error_feedback", error_feedback)
        self.error_decay = check_real("error_decay", error_decay, 0.0, 1.0)
        self.orthogonalization = check_choice("orthogonalization", orthogonalization, ORTHOGONALIZATION_METHODS)
        self.epsilon = check_real("epsilon", epsilon, 0.0)
        self.seed = check_seed(seed)
        self.nesterov = check_real("nesterov", nesterov, 0.0)
        self.async_error = async_error = check_choice("async_error", async_error, ASYNC_ERROR_MODES)
        self.error_in_grad = check_flag("error_in_grad", error_in_grad)
        self.power_iterations = check_int("power_iterations", power_iterations, 1)
        needs_error = [n for n, on in (("nesterov", self.nesterov > 0), ("async_error", async_error is not None),
                                        ("error_in_grad", self.error_in_grad)) if on]
        if needs_error and not self.error_feedback:
            raise ValueError(f"{needs_error[0]} works on the error-feedback buffer; it needs error_feedback=True")
        if self.error_in_grad and async_error is not None:
            raise ValueError(
                "error_in_grad=True and async_error cannot be combined: the error would be averaged in the "
                "background while backward accumulates into the same buffer"
            )

    def reify(self, process_group) -> PowerSGDAlgorithmImpl:
        return PowerSGDAlgorithmImpl(process_group, self)


register_algorithm(
    "powersgd", PowerSGDAlgorithm, "PowerSGD: rank-r gradient compression with error feedback",
    # Gradient compression, synchronous: every worker holds the same model.
    rows=[(200, AlgorithmConfig("powersgd", "powersgd", {"rank": 2}, in_sweep=True))],
)
