"""PowerSGD: rank-r gradient compression by one step of subspace iteration.

Pure tensor math, no communication: the collectives are injected as callables
(``allreduce_mean(tensor)`` averages a tensor over the workers, in place), so the same
code runs inside the Bagua algorithm, inside the torch DDP hook, and in one process
in tests (where ``allreduce_mean`` is the identity).

Seed 001 (Vogels et al., PowerSGD), Algorithm 1, per gradient tensor G viewed as the
matrix M = G.view(shape[0], -1) ∈ R^{n×m}, with a Q ∈ R^{m×r} kept between steps:

    P ← M Q                 (n × r)
    P ← mean_w P            one packed allreduce for all P's of a bucket
    P ← orthogonalize(P)    orthonormal columns (batched over matrices of one shape)
    Q ← Mᵀ P                (m × r)
    Q ← mean_w Q            one packed allreduce for all Q's of a bucket
    M̃ ← P Qᵀ                the update every worker applies

Both products are linear and the means are means, so M̃ = P Pᵀ mean_w(M) with P an
orthonormal basis of span(mean_w(M) Q): W workers with batch B give the update of one
worker with batch W·B (Lemma 3, "linearity"). ``warm_start`` keeps Q for the next step
(Theorem I: on a fixed M, repeated steps converge to the best rank-r approximation);
without it Q is redrawn from N(0, 1) each step.

Error feedback (Algorithm 2, with the thesis's decay λ ∈ [0, 1]): each worker adds
λ·e to its gradient, A = G + λe, compresses A, and keeps what the aggregated update
missed, e ← A − M̃. Summed over steps, Σ_t M̃_t = Σ_t mean_w(G_t) + mean_w(e_0) −
mean_w(e_T) when λ = 1: the updates track the gradients up to the last error.

Vectors, 0-dim tensors, and matrices where (n + m)·r·``min_compression_rate`` >
n·m (compression would save less than that rate) are averaged uncompressed, in one
packed allreduce per bucket.

fp16 and bf16 gradients are computed in float32 (float64 stays float64); P and Q
travel in that compute dtype, and results are written back in the gradient's dtype.

At the GPU's pace: a bucket's matrices of one shape are one b × n × m batch, so each
product (P = A·Q, Q = Aᵀ·P, the reconstruction P·Qᵀ, the error update) is one
``torch.bmm``/``baddbmm`` per shape group, as epfml/powersgd does; the error buffer is
laid out group by group so a group's A is one view of it; gradients that lie equally
spaced in one buffer (a flattened bucket) are read and written through one strided
view, else through ``torch._foreach_*`` ops; the P's of all groups are orthogonalized
in one call (one kernel launch with cuda_ext on CUDA). Nothing in a step waits for the
GPU: no ``.item()``, no branch on a tensor's values, no blocking host copy.

Random draws (the initial Q's; every Q without warm start) come from a CPU generator
seeded with ``seed`` and are then moved to the gradients' device, so one seed gives the
same Q's, and the same training up to rounding, on CPU and CUDA.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..arguments import check_int, check_real
from .orthogonalization import DEFAULT_EPSILON, orthogonalize_batches_

__all__ = [
    "DEFAULT_EPSILON",
    "BucketPlan",
    "ShapeGroup",
    "PowerSGDOptions",
    "StepBytes",
    "compute_dtype",
    "matrix_shape",
    "should_compress",
    "make_plan",
    "init_state",
    "compress_aggregate",
    "compression_summary",
    "stable_seed",
]


# --- which tensors are compressed, and how they are laid out -----------------------------
def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; every other floating dtype is computed in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def matrix_shape(shape: Sequence[int]) -> Optional[Tuple[int, int]]:
    """(n, m) of ``view(shape[0], -1)`` for a tensor of ≥ 2 dimensions, else None."""
    shape = tuple(int(s) for s in shape)
    if len(shape) < 2:
        return None
    return shape[0], math.prod(shape[1:])


def should_compress(shape: Sequence[int], rank: int, min_compression_rate: float) -> bool:
    """True if the rank-r factors of ``shape``'s matrix view are at least
    ``min_compression_rate`` times smaller than the matrix: n·m ≥ rate·(n + m)·r'
    with r' = min(r, n, m). Vectors and 0-dim tensors are never compressed."""
    nm = matrix_shape(shape)
    if nm is None:
        return False
    n, m = nm
    if n * m == 0:
        return False
    r = min(rank, n, m)
    return n * m >= min_compression_rate * (n + m) * r


@dataclass(frozen=True)
class ShapeGroup:
    """Compressed tensors whose matrices share one shape n × m (rank r = min(rank, n, m)).

    Their P's lie one after the other from ``p_offset`` in the packed P buffer, so the
    group's P's are one b × n × r batch (likewise Q's: b × m × r from ``q_offset``)."""

    key: str
    n: int
    m: int
    r: int
    members: Tuple[int, ...]  # indices into the bucket's tensors
    p_offset: int
    q_offset: int
    e_offset: int = 0  # the group's b × n × m block in the error buffer starts here

    @property
    def e_numel(self) -> int:
        return len(self.members) * self.n * self.m

    @property
    def p_numel(self) -> int:
        return len(self.members) * self.n * self.r

    @property
    def q_numel(self) -> int:
        return len(self.members) * self.m * self.r


@dataclass(frozen=True)
class BucketPlan:
    """How one bucket of tensors is compressed: shape groups, uncompressed indices,
    where each compressed tensor's error lies in the bucket's error buffer (group by
    group, members in bucket order: a group's errors are one b × n × m block)."""

    shapes: Tuple[Tuple[int, ...], ...]
    rank: int
    groups: Tuple[ShapeGroup, ...]
    uncompressed: Tuple[int, ...]
    error_offsets: Dict[int, int] = field(default_factory=dict)  # tensor index → offset
    error_numel: int = 0
    p_numel: int = 0
    q_numel: int = 0

    @property
    def compressed(self) -> Tuple[int, ...]:
        return tuple(sorted(i for g in self.groups for i in g.members))

    def numel(self, index: int) -> int:
        return math.prod(self.shapes[index])


def make_plan(shapes: Sequence[Sequence[int]], rank: int, min_compression_rate: float) -> BucketPlan:
    """The plan for a bucket holding tensors of ``shapes`` (in bucket order)."""
    shapes = tuple(tuple(int(s) for s in shape) for shape in shapes)
    by_shape: Dict[Tuple[int, int], List[int]] = {}
    uncompressed: List[int] = []
    for index, shape in enumerate(shapes):
        if should_compress(shape, rank, min_compression_rate):
            by_shape.setdefault(matrix_shape(shape), []).append(index)
        else:
            uncompressed.append(index)
    groups = []
    p_offset = q_offset = e_offset = 0
    error_offsets = {}
    for (n, m), members in by_shape.items():
        r = min(rank, n, m)
        group = ShapeGroup(f"{n}x{m}", n, m, r, tuple(members), p_offset, q_offset, e_offset)
        groups.append(group)
        for j, index in enumerate(members):
            error_offsets[index] = e_offset + j * n * m
        p_offset += group.p_numel
        q_offset += group.q_numel
        e_offset += group.e_numel
    return BucketPlan(shapes, rank, tuple(groups), tuple(uncompressed), error_offsets, e_offset, p_offset, q_offset)


def stable_seed(seed: int, name: str) -> int:
    """A 63-bit seed from the algorithm's ``seed`` and a name (the bucket's tensor
    names), identical on every worker and every run (no Python hash randomization)."""
    return (int(seed) * 0x9E3779B1 + zlib.crc32(name.encode())) % (2**63)


# --- state ---------------------------------------------------------------------------------
def _new_generator(seed: int) -> torch.Generator:
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed)
    return generator


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on ``device`` without making the host wait for the GPU (pinned
    memory, asynchronous copy; torch keeps the pinned block until the copy ran)."""
    if device.type == "cpu":
        return tensor
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def _draw_qs(plan: BucketPlan, generator: torch.Generator, dtype, device) -> Dict[str, torch.Tensor]:
    """Every group's Q (b × m × r), i.i.d. N(0, 1) from the CPU ``generator``, one group
    after the other (the draws of the CPU path, whatever ``device`` is), then moved to
    ``device`` in one transfer."""
    device = torch.device(device)
    drawn = {g.key: torch.randn(len(g.members), g.m, g.r, generator=generator, dtype=dtype) for g in plan.groups}
    if device.type == "cpu" or not drawn:
        return drawn
    flat = _to_device(torch.cat([q.reshape(-1) for q in drawn.values()]), device)
    out, offset = {}, 0
    for key, q in drawn.items():
        out[key] = flat[offset : offset + q.numel()].view(q.shape)
        offset += q.numel()
    return out


def init_state(plan: BucketPlan, seed: int, dtype: torch.dtype, device, error_feedback: bool) -> dict:
    """A bucket's PowerSGD state: the Q's (one b × m × r batch per shape group, i.i.d.
    N(0, 1) from a CPU generator seeded with ``seed``, then moved to ``device``, so
    identical on every worker and on every device), the generator's state, and the
    error buffer (zeros, the gradients' dtype; absent without error feedback). Plain
    tensors and dicts: checkpointable as is."""
    device = torch.device(device)
    cdtype = compute_dtype(dtype)
    generator = _new_generator(seed)
    q = _draw_qs(plan, generator, cdtype, device)
    state = {"q": q, "rng_state": generator.get_state(), "compressed_steps": 0}
    if error_feedback:
        state["error"] = torch.zeros(plan.error_numel, dtype=dtype, device=device)
    return state


def _generator_from(state: dict) -> torch.Generator:
    generator = torch.Generator(device="cpu")
    saved = state["rng_state"]
    try:
        generator.set_state(saved)
    except RuntimeError as error:
        raise ValueError(
            f"the PowerSGD state's rng_state is not a CPU generator state ({tuple(saved.shape)} bytes on "
            f"{saved.device}): it was saved by a version that drew the Q's on the GPU; it cannot be resumed "
            "bit for bit (start the PowerSGD state afresh)"
        ) from error
    return generator


# --- one step --------------------------------------------------------------------------------
@dataclass(frozen=True)
class PowerSGDOptions:
    warm_start: bool = True
    error_feedback: bool = True
    error_decay: float = 1.0  # λ: A = G + λ·e
    orthogonalization: str = "auto"
    epsilon: float = DEFAULT_EPSILON
    error_in_grad: bool = False  # the error lives in the gradient tensors themselves


@dataclass
class StepBytes:
    """Bytes handed to collectives by one call (payloads only). ``p_extra_on_host``,
    when a ``p_extra`` rode along, gives its averaged value as a CPU tensor, waiting
    only for the P allreduce (on CUDA: a copy to pinned memory queued right after it,
    so the products and the orthogonalization queued since keep the GPU busy)."""

    p: int = 0
    q: int = 0
    uncompressed: int = 0
    p_extra_on_host: Optional[Callable[[], torch.Tensor]] = field(default=None, repr=False, compare=False)

    @property
    def total(self) -> int:
        return self.p + self.q + self.uncompressed


def _identity_start(tensor: torch.Tensor):
    class _Done:
        def wait(self):
            return None

    return _Done()


def compress_aggregate(
    plan: BucketPlan,
    grads: Sequence[torch.Tensor],
    state: dict,
    options: PowerSGDOptions,
    allreduce_mean: Callable[[torch.Tensor], None],
    start_allreduce_mean: Optional[Callable[[torch.Tensor], object]] = None,
    out: Optional[Sequence[torch.Tensor]] = None,
    p_extra: Optional[torch.Tensor] = None,
) -> StepBytes:
    """One PowerSGD step on a bucket's gradients ``grads`` (shapes of ``plan``), in place.

    Afterwards every compressed ``grads[i]`` holds the aggregated rank-r update M̃_i,
    every uncompressed one the plain mean over workers, and ``state`` the new Q's and
    error. ``allreduce_mean`` averages a tensor in place; ``start_allreduce_mean``
    starts one and returns a handle with ``wait()`` (the uncompressed tensors travel
    while P's are computed; default: synchronous). ``p_extra`` (a small 1-D tensor)
    rides along with the P allreduce and is averaged too.

    With ``options.error_in_grad`` the gradient tensors *are* the error buffers: on
    entry ``grads[i]`` holds A_i (the gradient accumulated onto λ·e), on return it holds
    the new error A_i − M̃_i, and M̃_i is written to ``out[i]`` instead.

    Kernels: per shape group one product for P, one for Q, one or two for the update
    and the error (plus a copy or a ``_foreach`` op where the group's gradients are
    not one strided view), three for the warm start's zero-column guard; per bucket
    one orthogonalization call, the packing of the uncompressed tensors and the
    collectives. The host never waits for the device here.
    """
    if start_allreduce_mean is None:
        def start_allreduce_mean(tensor):
            allreduce_mean(tensor)
            return _identity_start(tensor)

    bytes_sent = StepBytes()
    device = grads[0].device if grads else torch.device("cpu")

    # Uncompressed tensors: one packed allreduce, started first so it overlaps the P's.
    pending = packed = None
    if plan.uncompressed:
        packed = torch.cat([grads[i].reshape(-1) for i in plan.uncompressed])
        bytes_sent.uncompressed = packed.numel() * packed.element_size()
        pending = start_allreduce_mean(packed)
    if not plan.groups:
        _unpack_uncompressed(plan, grads, pending, packed)
        return bytes_sent

    gdtype = grads[plan.groups[0].members[0]].dtype
    cdtype = compute_dtype(gdtype)
    in_place = gdtype == cdtype
    error = state.get("error") if options.error_feedback and not options.error_in_grad else None
    decay = options.error_decay

    # Per group: the gradients as a list of n × m views and, where they lie equally
    # spaced in one buffer, as one b × n × m strided view; A = G + λe as one batch.
    g_lists: Dict[str, List[torch.Tensor]] = {}
    g_views: Dict[str, Optional[torch.Tensor]] = {}
    a_batches: Dict[str, torch.Tensor] = {}
    for group in plan.groups:
        g_list = [grads[i].view(group.n, group.m) for i in group.members]
        g_view = _batch_view(g_list, group.n, group.m)
        g_lists[group.key], g_views[group.key] = g_list, g_view
        if error is not None:
            e = _group_error(error, group)
            if in_place:
                # A is formed in the error buffer (one pass); it becomes the new error in place.
                if g_view is not None:
                    torch.add(g_view, e, alpha=decay, out=e)
                else:
                    _foreach_add_scaled_(list(e.unbind(0)), g_list, decay)
                a = e
            else:
                a = _gather(g_list, g_view, cdtype, group)
                if decay != 0.0:
                    a.add_(e.to(cdtype), alpha=decay)
        elif in_place and g_view is not None:
            a = g_view
        else:
            a = _gather(g_list, g_view, cdtype, group)
        a_batches[group.key] = a

    if not options.warm_start:
        generator = _generator_from(state)
        state["q"].update(_draw_qs(plan, generator, cdtype, device))
        state["rng_state"] = generator.get_state()

    # P = A Q, packed by shape group (a group's P's are one b × n × r batch).
    extra = 0 if p_extra is None else p_extra.numel()
    p_flat = torch.empty(plan.p_numel + extra, dtype=cdtype, device=device)
    p_batches = []
    for group in plan.groups:
        batch = p_flat[group.p_offset : group.p_offset + group.p_numel].view(len(group.members), group.n, group.r)
        _bmm(a_batches[group.key], state["q"][group.key], out=batch)
        p_batches.append(batch)
    if extra:
        p_flat[plan.p_numel :].copy_(p_extra)
    allreduce_mean(p_flat)
    bytes_sent.p = p_flat.numel() * p_flat.element_size()
    if extra:
        p_extra.copy_(p_flat[plan.p_numel :])
        bytes_sent.p_extra_on_host = _host_copy(p_extra)

    # Orthonormal columns: every group's P's in one call, in place.
    orthogonalize_batches_(p_batches, options.orthogonalization, options.epsilon)

    # Q = Aᵀ P, packed; its mean is the new Q (kept for the warm start).
    q_flat = torch.empty(plan.q_numel, dtype=cdtype, device=device)
    q_batches = []
    for group, p in zip(plan.groups, p_batches):
        batch = q_flat[group.q_offset : group.q_offset + group.q_numel].view(len(group.members), group.m, group.r)
        _bmm(a_batches[group.key].transpose(1, 2), p, out=batch)
        q_batches.append(batch)
    allreduce_mean(q_flat)
    bytes_sent.q = q_flat.numel() * q_flat.element_size()

    # M̃ = P Qᵀ; the error keeps what it missed: e = A − M̃.
    for group, p, q in zip(plan.groups, p_batches, q_batches):
        qt = q.transpose(1, 2)
        a = a_batches[group.key]
        g_list, g_view = g_lists[group.key], g_views[group.key]
        if options.error_in_grad:
            out_list = [out[i].view(group.n, group.m) for i in group.members]
            out_view = _batch_view(out_list, group.n, group.m)
            if out_view is not None and out_view.dtype == cdtype:
                _bmm(p, qt, out=out_view)
            else:
                _write(out_view, out_list, _bmm(p, qt))
            if options.error_feedback:
                _subtract_product_(a, p, qt)  # the new error (in the gradients when A is their view)
                if a is not g_view:
                    _write(g_view, g_list, a)
            elif g_view is not None:
                g_view.zero_()
            else:
                torch._foreach_zero_(g_list)
            continue
        if error is not None:
            e = _group_error(error, group)
            if in_place:  # A is e's storage: e = A − P Qᵀ in place, then G = P Qᵀ
                _subtract_product_(e, p, qt)
                if g_view is not None:
                    _bmm(p, qt, out=g_view)
                elif not _batched(p):
                    for j, g in enumerate(g_list):
                        torch.mm(p[j], qt[j], out=g)
                else:
                    _write(None, g_list, torch.bmm(p, qt))
            else:
                approx = _bmm(p, qt)
                e.copy_(a.sub_(approx))
                _write(g_view, g_list, approx)
        elif in_place and g_view is not None:
            _bmm(p, qt, out=g_view)
        else:
            _write(g_view, g_list, _bmm(p, qt))

    if options.warm_start:
        # A Q column that became exactly zero (zero or rank-deficient gradient) would stay
        # zero forever: such a column keeps its previous value instead (never zero: the
        # initial Q's are random and each step keeps this so). Every worker holds the same
        # Q's, so every worker keeps the same columns; no draw, no host round trip.
        for group, q in zip(plan.groups, q_batches):
            dead = torch.linalg.vector_norm(q, dim=-2, keepdim=True) == 0
            state["q"][group.key] = torch.where(dead, state["q"][group.key], q)
    state["compressed_steps"] = int(state.get("compressed_steps", 0)) + 1

    _unpack_uncompressed(plan, grads, pending, packed)
    return bytes_sent


BATCHED_ON_CPU = False
"""Run the GPU's batched products on CPU tensors too (tests set it to check that path
on machines without a GPU; on CPU the per-matrix products are faster)."""


def _batched(tensor: torch.Tensor) -> bool:
    return tensor.device.type != "cpu" or BATCHED_ON_CPU


def _bmm(a: torch.Tensor, b: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """a[j] @ b[j] for every j: one ``torch.bmm`` on GPUs (one launch); on CPU one
    product per matrix, which is as fast at r ≥ 4 and 4–17× faster at r = 1 (torch's
    CPU bmm has no matrix-vector path). On CPU a result with 2 to 64 columns (P = A·Q,
    Q = Aᵀ·P at r ≥ 2) is computed transposed, (bᵀ aᵀ)ᵀ, and copied into place: MKL's
    GEMM is 2–10× faster that way round for these skinny products (ResNet-18's layers,
    one thread; measured for issue 19)."""
    if _batched(a):
        return torch.bmm(a, b, out=out)
    if out is None:
        out = torch.empty(a.shape[0], a.shape[1], b.shape[2], dtype=a.dtype, device=a.device)
    transposed = 2 <= b.shape[2] <= 64
    for j in range(a.shape[0]):
        if transposed:
            out[j].copy_(torch.mm(b[j].t(), a[j].t()).t())
        else:
            torch.mm(a[j], b[j], out=out[j])
    return out


def _subtract_product_(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """c[j] ← c[j] − a[j] @ b[j] in place (``baddbmm_`` on GPUs, ``addmm_`` per matrix on CPU)."""
    if _batched(c):
        c.baddbmm_(a, b, alpha=-1.0)
        return
    for j in range(c.shape[0]):
        c[j].addmm_(a[j], b[j], alpha=-1.0)


def _host_copy(tensor: torch.Tensor) -> Callable[[], torch.Tensor]:
    """A function giving ``tensor``'s current value on the host; on CUDA the copy is
    queued now and the function waits for it alone (an event), not for the stream."""
    if tensor.device.type != "cuda":
        return lambda: tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(tensor.device))

    def value() -> torch.Tensor:
        done.synchronize()
        return host

    return value


def _batch_view(matrices: Sequence[torch.Tensor], n: int, m: int) -> Optional[torch.Tensor]:
    """``matrices`` (n × m, contiguous) as one b × n × m tensor without a copy, when they
    are views of one base tensor lying at equal distances (a flattened bucket's
    gradients of one shape usually are); else None."""
    first = matrices[0]
    if not first.is_contiguous():
        return None
    if len(matrices) == 1:
        return first.unsqueeze(0)
    base = first._base
    if base is None:
        return None
    start = first.data_ptr()
    step = matrices[1].data_ptr() - start
    size = first.element_size()
    if step < n * m * size or step % size:
        return None
    for k, matrix in enumerate(matrices):
        if matrix._base is not base or matrix.data_ptr() != start + k * step or not matrix.is_contiguous() \
                or matrix.dtype != first.dtype:
            return None
    return first.as_strided((len(matrices), n, m), (step // size, m, 1))


def _group_error(error: torch.Tensor, group: ShapeGroup) -> torch.Tensor:
    return error[group.e_offset : group.e_offset + group.e_numel].view(len(group.members), group.n, group.m)


def _gather(g_list: Sequence[torch.Tensor], g_view: Optional[torch.Tensor], dtype, group: ShapeGroup) -> torch.Tensor:
    """A new b × n × m batch in ``dtype`` holding the group's gradients."""
    batch = torch.empty(len(group.members), group.n, group.m, dtype=dtype, device=g_list[0].device)
    if g_view is not None:
        batch.copy_(g_view)
    else:
        torch._foreach_copy_(list(batch.unbind(0)), list(g_list))
    return batch


def _write(view: Optional[torch.Tensor], targets: Sequence[torch.Tensor], batch: torch.Tensor) -> None:
    """targets ← batch (one copy through ``view`` when there is one, else one _foreach op)."""
    if view is not None:
        view.copy_(batch)
    else:
        torch._foreach_copy_(list(targets), list(batch.unbind(0)))


def _foreach_add_scaled_(errors: List[torch.Tensor], grads: Sequence[torch.Tensor], decay: float) -> None:
    """e ← G + λ·e for every pair, as _foreach ops."""
    if decay == 0.0:
        torch._foreach_copy_(errors, list(grads))
        return
    if decay != 1.0:
        torch._foreach_mul_(errors, decay)
    torch._foreach_add_(errors, list(grads))


def _unpack_uncompressed(plan: BucketPlan, grads, pending, packed) -> None:
    if pending is None:
        return
    pending.wait()
    targets, sources, offset = [], [], 0
    for i in plan.uncompressed:
        n = grads[i].numel()
        targets.append(grads[i])
        sources.append(packed[offset : offset + n].view_as(grads[i]))
        offset += n
    torch._foreach_copy_(targets, sources)


# --- sizes -------------------------------------------------------------------------------------
def compression_summary(module: torch.nn.Module, rank: int, min_compression_rate: float = 2.0) -> dict:
    """Bytes one PowerSGD step sends for ``module``'s trainable parameters.

    Per layer (parameter name): its shape, matrix shape, whether it is compressed,
    ``uncompressed_bytes`` (n·m elements in its dtype), ``compressed_bytes`` ((n + m)·r'
    elements of P and Q in the compute dtype, or the uncompressed bytes) and ``ratio``.
    Totals: ``total_uncompressed_bytes``, ``total_compressed_bytes`` and ``total_ratio``.
    These count payloads as the algorithm's live counters do (``bytes_last_step``).
    """
    rank = check_int("rank", rank, 1)
    min_compression_rate = check_real("min_compression_rate", min_compression_rate, 1)
    layers = []
    seen = set()
    for name, param in module.named_parameters():
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        shape = tuple(param.shape)
        size = param.element_size()
        uncompressed = param.numel() * size
        nm = matrix_shape(shape)
        compressed_flag = should_compress(shape, rank, min_compression_rate)
        if compressed_flag:
            n, m = nm
            factor_size = torch.empty((), dtype=compute_dtype(param.dtype)).element_size()
            compressed = (n + m) * min(rank, n, m) * factor_size
        else:
            compressed = uncompressed
        layers.append({
            "name": name,
            "shape": shape,
            "matrix_shape": nm,
            "compressed": compressed_flag,
            "uncompressed_bytes": uncompressed,
            "compressed_bytes": compressed,
            "ratio": uncompressed / compressed if compressed else 1.0,
        })
    total_u = sum(layer["uncompressed_bytes"] for layer in layers)
    total_c = sum(layer["compressed_bytes"] for layer in layers)
    return {
        "rank": rank,
        "min_compression_rate": float(min_compression_rate),
        "layers": layers,
        "total_uncompressed_bytes": total_u,
        "total_compressed_bytes": total_c,
        "total_ratio": total_u / total_c if total_c else 1.0,
    }
