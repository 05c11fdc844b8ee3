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
without it Q is redrawn from N(0, 1) each step. ``power_iterations=k`` runs the three
middle lines k times per step, each from the last Q (:func:`subspace_iteration`; seed 001
Table 2's "best approximation" is k = 4 without warm start, Appendix G.7), sending k P's
and k Q's.

Error feedback (Algorithm 2, with the thesis's decay λ ∈ [0, 1]): each worker adds
λ·e to its gradient, A = G + λe, compresses A, and keeps what the aggregated update
missed, e ← A − M̃. Summed over steps, Σ_t M̃_t = Σ_t mean_w(G_t) + mean_w(e_0) −
mean_w(e_T) when λ = 1: the updates track the gradients up to the last error.

Vectors, 0-dim tensors, and matrices where (n + m)·r·``min_compression_rate`` >
n·m (compression would save less than that rate) are averaged uncompressed, in one
packed allreduce per bucket.

The module has three layers, each usable on its own:

- the plan and state of a bucket (:func:`make_plan`, :func:`init_state`): which tensors
  are compressed, grouped by matrix shape, and where their P's, Q's and errors lie;
- the step's math on plain tensors, batches [..., b, n, m] with any leading dimensions
  and the averaging passed in (:func:`compute_p`, :func:`compute_q`,
  :func:`reconstruct`, :func:`subtract_reconstruction_`, :func:`keep_nonzero_columns`,
  and :func:`power_iteration`, the three middle lines above on packed buffers): a form
  of the algorithm that stacks the workers' states along a leading dimension imports
  these rather than restating them;
- one step on a bucket (:func:`compress_aggregate`), which lays a bucket's gradients,
  errors and outputs out as those batches and calls the math in the numbered order of
  its docstring.

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

On CPU (one thread, memory-bound): the products are one ``torch.mm`` per matrix; A is
formed matrix by matrix just before its P = A·Q, which then reads it from cache; and at
r ≥ 2 the update is written to G first and subtracted from e, where MKL's small-k GEMM
is the slow part. Where cuda_ext's CPU module is loaded (it is never built here:
``orthogonalization.prepare("householder", "cpu")`` builds and loads it), forming A with
P = A·Q (r ≤ ``FUSED_FORM_MAX_RANK``) and the update G ← P·Qᵀ, e ← e − P·Qᵀ
(r ≤ ``FUSED_UPDATE_MAX_RANK``) each run as one sweep over a matrix's rows, so the
gradients' size crosses the memory bus fewer times; results agree with the torch ops to
rounding (see :func:`_matmul`, :func:`_form_a_and_p`, :func:`_updates_matrix_by_matrix`,
:func:`_fused_cpu_passes`; figures in docs/benchmarks.md, PowerSGD).

Random draws (the initial Q's; every Q without warm start) come from a CPU generator
seeded with ``seed`` and are then moved to the gradients' device, so one seed gives the
same Q's, and the same training up to rounding, on CPU and CUDA.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

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
    "compute_p",
    "compute_q",
    "reconstruct",
    "subtract_reconstruction_",
    "keep_nonzero_columns",
    "power_iteration",
    "subspace_iteration",
    "p_buffer",
    "Factors",
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


def init_state(plan: BucketPlan, seed: int, dtype: torch.dtype, device, error_feedback: bool,
               lead: Tuple[int, ...] = ()) -> dict:
    """A bucket's PowerSGD state: the Q's (one b × m × r batch per shape group, i.i.d.
    N(0, 1) from a CPU generator seeded with ``seed``, then moved to ``device``, so
    identical on every worker and on every device), the generator's state, and the
    error buffer (zeros, the gradients' dtype, ``[*lead, error_numel]``: one per worker
    of a leading worker dimension; absent without error feedback). Plain tensors and
    dicts: checkpointable as is."""
    device = torch.device(device)
    cdtype = compute_dtype(dtype)
    generator = _new_generator(seed)
    q = _draw_qs(plan, generator, cdtype, device)
    state = {"q": q, "rng_state": generator.get_state(), "compressed_steps": 0}
    if error_feedback:
        state["error"] = torch.zeros(*lead, plan.error_numel, dtype=dtype, device=device)
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


# --- the step's math on plain tensors ---------------------------------------------------------
# Each function below is the one home of one formula. They take batches of matrices with
# any leading dimensions ([..., b, n, m]; a bucket's shape group is [b, n, m], a form that
# stacks the workers' states adds a leading [W]) and never communicate: the averaging is
# the caller's ``allreduce_mean``. On GPUs a product is one batched call; on CPU one
# ``torch.mm`` per matrix (see :func:`_matmul`).

BATCHED_ON_CPU = False
"""Run the GPU's batched products on CPU tensors too (tests set it to check that path
on machines without a GPU; on CPU the per-matrix products are faster)."""


def compute_p(a: torch.Tensor, q: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """P = A·Q: ``a`` [..., n, m], ``q`` [..., m, r] → [..., n, r] (into ``out`` if given)."""
    return _matmul(a, q, out)


def compute_q(a: torch.Tensor, p: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Q = Aᵀ·P: ``a`` [..., n, m], ``p`` [..., n, r] → [..., m, r] (into ``out`` if given).
    On CPU, where cuda_ext's module is loaded and r ≤ ``FUSED_Q_MAX_RANK``, each matrix's
    product is its fused pass (Qᵀ = Pᵀ·A over blocks of columns, :func:`_fused_cpu_passes`)."""
    fused = None if _batched(a) else _fused_cpu_passes()
    if fused is None or p.shape[-1] > FUSED_Q_MAX_RANK or a.dtype not in (torch.float32, torch.float64):
        return _matmul(a.transpose(-2, -1), p, out)
    if out is None:
        out = torch.empty(*a.shape[:-2], a.shape[-1], p.shape[-1], dtype=a.dtype)
    r, m = p.shape[-1], a.shape[-1]
    scratch = None  # Qᵀ of one matrix where Q's memory is not Qᵀ's (r ≥ 2)
    for a_j, p_j, q_j in zip(_each_matrix(a), _each_matrix(p), _each_matrix(out)):
        if not a_j.is_contiguous():
            torch.mm(a_j.t(), p_j, out=q_j)
        elif r == 1 and q_j.is_contiguous():
            fused.powersgd_transposed_product_(a_j, p_j, q_j.view(1, m))
        else:
            if scratch is None:
                scratch = torch.empty(r, m, dtype=a.dtype)
            fused.powersgd_transposed_product_(a_j, p_j, scratch)
            q_j.copy_(scratch.t())
    return out


def reconstruct(p: torch.Tensor, q: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """M̃ = P·Qᵀ, the rank-r update: [..., n, r] and [..., m, r] → [..., n, m]."""
    return _matmul(p, q.transpose(-2, -1), out)


def subtract_reconstruction_(e: torch.Tensor, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """e ← e − P·Qᵀ in place (what error feedback keeps: with e = A on entry, the part of
    A the update missed), without a temporary of e's size; returns ``e``."""
    qt = q.transpose(-2, -1)
    if _batched(e):
        if e.dim() == 3:
            e.baddbmm_(p, qt, alpha=-1.0)
        else:
            e.sub_(torch.matmul(p, qt))
        return e
    for e_j, p_j, qt_j in zip(_each_matrix(e), _each_matrix(p), _each_matrix(qt)):
        e_j.addmm_(p_j, qt_j, alpha=-1.0)
    return e


def keep_nonzero_columns(new_q: torch.Tensor, old_q: torch.Tensor) -> torch.Tensor:
    """The warm start's Q: ``new_q``, except that a column that came out exactly zero (a
    zero or rank-deficient A) keeps its value from ``old_q``: a zero column would stay zero
    forever. ``old_q`` is never zero there (the initial Q's are random and every step keeps
    this so), and every worker holds the same Q's, so all keep the same columns; no draw,
    no host round trip."""
    dead = torch.linalg.vector_norm(new_q, dim=-2, keepdim=True) == 0
    return torch.where(dead, old_q, new_q)


class Factors(NamedTuple):
    """What :func:`power_iteration` returns: the averaged P's (orthonormal columns) and Q's,
    one per input batch, as views into the two packed buffers that were averaged, and the
    bytes of those buffers."""

    p: List[torch.Tensor]
    q: List[torch.Tensor]
    p_bytes: int
    q_bytes: int
    p_extra_on_host: Optional[Callable[[], torch.Tensor]] = None  # see StepBytes


def power_iteration(
    a: Sequence[torch.Tensor],
    q: Sequence[torch.Tensor],
    allreduce_mean: Callable[[torch.Tensor], None],
    orthogonalization: str = "auto",
    epsilon: float = DEFAULT_EPSILON,
    p_extra: Optional[torch.Tensor] = None,
    products: Optional[Tuple[torch.Tensor, List[torch.Tensor]]] = None,
) -> Factors:
    """One step of subspace iteration on batches of matrices, averaged over the workers:

        P_k ← A_k·Q_k         all P's packed in one buffer, then allreduce_mean(buffer)
        P_k ← orthogonalize(P_k)   every batch in one call
        Q_k ← A_kᵀ·P_k        all Q's packed in one buffer, then allreduce_mean(buffer)

    ``a[k]`` is [..., b_k, n_k, m_k] in the compute dtype, ``q[k]`` [..., b_k, m_k, r_k];
    all share the leading dimensions "..." (none for a bucket; the workers for a form that
    stacks them), and each packed buffer is [..., total] in the batches' order, so
    ``allreduce_mean`` averages it over the workers in place. ``p_extra`` ([..., k])
    rides at the end of the P buffer and is overwritten with its average (and
    ``p_extra_on_host`` reads it on the host, waiting for the P allreduce only).
    ``products``, when given, is :func:`p_buffer`'s buffer and views already holding the
    products A_k·Q_k (a caller that computes each while it forms A_k, still in cache);
    else they are computed here. Neither ``a`` nor ``q`` is modified: keeping the new
    Q's is the caller's choice (warm start).
    """
    lead = a[0].shape[:-3]
    dtype, device = a[0].dtype, a[0].device
    extra = 0 if p_extra is None else p_extra.shape[-1]
    if products is None:
        products = p_buffer(a, q, extra)
        for a_k, q_k, p_k in zip(a, q, products[1]):
            compute_p(a_k, q_k, out=p_k)
    p_flat, ps = products
    if extra:
        p_flat[..., p_flat.shape[-1] - extra :].copy_(p_extra)
    allreduce_mean(p_flat)
    extra_on_host = None
    if extra:
        p_extra.copy_(p_flat[..., p_flat.shape[-1] - extra :])
        extra_on_host = _host_copy(p_extra)  # queued now: waits for the P allreduce only
    orthogonalize_batches_([m for p_k in ps for m in _each_batch(p_k)], orthogonalization, epsilon)
    q_shapes = [(batch.shape[-3], batch.shape[-1], q_k.shape[-1]) for batch, q_k in zip(a, q)]
    q_flat, qs = _packed(q_shapes, lead, 0, dtype, device)
    for a_k, p_k, q_k in zip(a, ps, qs):
        compute_q(a_k, p_k, out=q_k)
    allreduce_mean(q_flat)
    return Factors(ps, qs, p_flat.numel() * p_flat.element_size(), q_flat.numel() * q_flat.element_size(),
                   extra_on_host)


def subspace_iteration(
    a: Sequence[torch.Tensor],
    q: Sequence[torch.Tensor],
    allreduce_mean: Callable[[torch.Tensor], None],
    iterations: int = 1,
    orthogonalization: str = "auto",
    epsilon: float = DEFAULT_EPSILON,
    p_extra: Optional[torch.Tensor] = None,
    products: Optional[Tuple[torch.Tensor, List[torch.Tensor]]] = None,
) -> Factors:
    """``iterations`` steps of :func:`power_iteration`, each started from the Q's the
    previous one averaged (seed 001, Appendix G.7, "best-approximation PowerSGD": more
    steps of subspace iteration per gradient, P ← orth(mean_w A·Q), Q ← mean_w Aᵀ·P,
    repeated; 4 steps reach the best rank-r approximation's test accuracy there, and by
    Theorem I the iteration converges to it on a fixed A when σ_r > σ_{r+1}).

    Arguments as :func:`power_iteration`; ``p_extra`` rides the first P allreduce only
    and ``products`` are the first step's. Returns the last step's factors with the bytes
    of every step summed (each step averages one P and one Q buffer), so the bytes sent
    grow linearly with ``iterations``. ``iterations=1`` is :func:`power_iteration`."""
    first = factors = power_iteration(a, q, allreduce_mean, orthogonalization, epsilon, p_extra, products)
    p_bytes, q_bytes = factors.p_bytes, factors.q_bytes
    for _ in range(iterations - 1):
        factors = power_iteration(a, factors.q, allreduce_mean, orthogonalization, epsilon)
        p_bytes += factors.p_bytes
        q_bytes += factors.q_bytes
    return factors._replace(p_bytes=p_bytes, q_bytes=q_bytes, p_extra_on_host=first.p_extra_on_host)


def p_buffer(a: Sequence[torch.Tensor], q: Sequence[torch.Tensor], extra: int = 0
             ) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """The buffer :func:`power_iteration` averages the P's in, [..., Σ_k b_k·n_k·r_k +
    ``extra``] in A's dtype and device, and each P_k's [..., b_k, n_k, r_k] view of it
    (``a`` and ``q`` as there; only their shapes are read)."""
    shapes = [(*a_k.shape[-3:-1], q_k.shape[-1]) for a_k, q_k in zip(a, q)]
    return _packed(shapes, a[0].shape[:-3], extra, a[0].dtype, a[0].device)


def _packed(shapes, lead, extra: int, dtype, device) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """One buffer [*lead, Σ numel + extra] and, for each (b, n, r) of ``shapes``, its
    [*lead, b, n, r] view, one after the other."""
    sizes = [math.prod(shape) for shape in shapes]
    flat = torch.empty(*lead, sum(sizes) + extra, dtype=dtype, device=device)
    views, offset = [], 0
    for shape, size in zip(shapes, sizes):
        views.append(flat[..., offset : offset + size].view(*lead, *shape))
        offset += size
    return flat, views


def _batched(tensor: torch.Tensor) -> bool:
    return tensor.device.type != "cpu" or BATCHED_ON_CPU


def _each_matrix(tensor: torch.Tensor) -> List[torch.Tensor]:
    """The 2-D matrices of a [..., x, y] tensor, as views, in order (one ``unbind`` of a
    [-1, x, y] view where there is one; a dimension expanded from one, as the workers'
    shared Q, repeats the same views)."""
    if tensor.dim() == 2:
        return [tensor]
    if tensor.dim() == 3:
        return list(tensor.unbind(0))
    if tensor.stride(0) == 0:
        return _each_matrix(tensor[0]) * tensor.shape[0]
    try:
        return list(tensor.view(-1, *tensor.shape[-2:]).unbind(0))
    except RuntimeError:  # no such view (a strided batch): one level at a time
        return [matrix for sub in tensor.unbind(0) for matrix in _each_matrix(sub)]


def _each_batch(tensor: torch.Tensor) -> List[torch.Tensor]:
    """The 3-D batches of a [..., b, x, y] tensor, as views, in order."""
    if tensor.dim() == 3:
        return [tensor]
    return [batch for sub in tensor.unbind(0) for batch in _each_batch(sub)]


def _matmul(a: torch.Tensor, b: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """a[j] @ b[j] for every matrix j: one ``torch.bmm`` on GPUs (one launch); on CPU one
    product per matrix, which is as fast at r ≥ 4 and 4–17× faster at r = 1 (torch's
    CPU bmm has no matrix-vector path). On CPU a result with 2 to 64 columns (P = A·Q,
    Q = Aᵀ·P at r ≥ 2) is computed transposed, (bᵀ aᵀ)ᵀ with bᵀ made contiguous, and
    copied into place: MKL's GEMM is 2–10× faster that way round for these skinny
    products (ResNet-18's layers, one thread), and a contiguous
    Qᵀ makes P = A·Q 1.4× faster again at r = 2."""
    if _batched(a):
        if a.dim() == 3:
            return torch.bmm(a, b, out=out)
        return torch.matmul(a, b, out=out)
    if out is None:
        out = torch.empty(*a.shape[:-1], b.shape[-1], dtype=a.dtype, device=a.device)
    transposed = 2 <= b.shape[-1] <= 64
    if a.dim() == 2:  # the per-matrix loops' common case, without the loop's overhead
        pairs = ((a, b, out),)
    else:
        pairs = zip(_each_matrix(a), _each_matrix(b), _each_matrix(out))
    for a_j, b_j, out_j in pairs:
        if transposed:
            out_j.copy_(torch.mm(b_j.t().contiguous(), a_j.t()).t())
        else:
            torch.mm(a_j, b_j, out=out_j)
    return out


# --- one step on a bucket ---------------------------------------------------------------------
@dataclass(frozen=True)
class PowerSGDOptions:
    warm_start: bool = True
    error_feedback: bool = True
    error_decay: float = 1.0  # λ: A = G + λ·e
    orthogonalization: str = "auto"
    epsilon: float = DEFAULT_EPSILON
    error_in_grad: bool = False  # the error lives in the gradient tensors themselves
    power_iterations: int = 1  # steps of subspace iteration per step (subspace_iteration)


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
    """One PowerSGD step on a bucket's gradients ``grads`` (shapes of ``plan``), in place:

        1. start one packed allreduce-mean of the uncompressed tensors     _start_uncompressed
        2. without warm start: Q ← N(0, 1), from the generator in ``state``  _redraw_qs
        3. A ← G + λ·e and P ← A·Q for every compressed tensor              _form_a_and_p
        4. P ← mean_w P, orthogonalized; Q ← mean_w(Aᵀ·P)                   subspace_iteration
           (``options.power_iterations`` times, each from the last Q)
        5. e ← A − P·Qᵀ, G ← P·Qᵀ                                           _apply_update
        6. with warm start: keep Q (a zero column keeps its old value)      keep_nonzero_columns
        7. wait for step 1's allreduce and unpack it into ``grads``          _finish_uncompressed

    Afterwards every compressed ``grads[i]`` holds the aggregated rank-r update M̃_i,
    every uncompressed one the plain mean over workers, and ``state`` the new Q's and
    error. ``allreduce_mean`` averages a tensor in place; ``start_allreduce_mean``
    starts one and returns a handle with ``wait()`` (the uncompressed tensors travel
    while P's are computed; default: synchronous). ``p_extra`` (a small 1-D tensor)
    rides along with the P allreduce and is averaged too.

    With ``options.error_in_grad`` the gradient tensors *are* the error buffers: on
    entry ``grads[i]`` holds A_i (the gradient accumulated onto λ·e), on return it holds
    the new error A_i − M̃_i, and M̃_i is written to ``out[i]`` instead.

    Leading worker dimension: ``grads[i]`` may be ``[*lead, *plan.shapes[i]]`` (the
    one-process engine's W workers, a row each; ``state["error"]`` then ``[*lead,
    error_numel]``): every worker forms its own A and error, ``allreduce_mean``
    averages over the leading dimension, and the Q's stay one for all (they are
    averaged). A job's worker has no leading dimension. The bytes are a worker's.

    Kernels: per shape group one product for P, one for Q, one or two for the update
    and the error (plus a copy or a ``_foreach`` op where the group's gradients are
    not one strided view), three for the warm start's zero-column guard; per bucket
    one orthogonalization call, the packing of the uncompressed tensors and the
    collectives. The host never waits for the device here.
    """
    bytes_sent = StepBytes()
    lead = _lead(plan, grads)
    uncompressed = _start_uncompressed(plan, grads, allreduce_mean, start_allreduce_mean, lead)
    bytes_sent.uncompressed = uncompressed.bytes
    if plan.groups:
        if not options.warm_start:
            _redraw_qs(plan, state, grads)
        groups, products = _form_a_and_p(plan, grads, state, options, 0 if p_extra is None else p_extra.shape[-1],
                                         lead)
        qs = [state["q"][g.spec.key].expand(*lead, -1, -1, -1) for g in groups]
        factors = subspace_iteration([g.a for g in groups], qs, allreduce_mean, options.power_iterations,
                                     options.orthogonalization, options.epsilon, p_extra, products)
        workers = math.prod(lead)
        bytes_sent.p, bytes_sent.q = factors.p_bytes // workers, factors.q_bytes // workers
        bytes_sent.p_extra_on_host = factors.p_extra_on_host
        _apply_update(groups, factors, out, options, lead)
        if options.warm_start:
            for group, q in zip(groups, factors.q):  # (averaged: every worker's Q is the first's)
                state["q"][group.spec.key] = keep_nonzero_columns(q[(0,) * len(lead)], state["q"][group.spec.key])
        state["compressed_steps"] = int(state.get("compressed_steps", 0)) + 1
    _finish_uncompressed(plan, grads, uncompressed, lead)
    return bytes_sent


def _lead(plan: BucketPlan, grads) -> Tuple[int, ...]:
    """The leading (worker) dimensions of ``grads`` beyond the plan's shapes."""
    first = grads[0]
    return tuple(first.shape[: first.dim() - len(plan.shapes[0])])


class _Matrices:
    """A shape group's n × m matrices lying in some buffers (gradients, outputs, errors):
    ``list``, a view of each, and ``batch``, the same as one b × n × m tensor without a
    copy when they lie equally spaced in one buffer (else None)."""

    __slots__ = ("list", "batch", "lead")

    def __init__(self, matrices: List[torch.Tensor], batch: Optional[torch.Tensor], lead: Tuple[int, ...] = ()):
        self.list = matrices  # each [*lead, n, m]
        self.batch = batch  # [*lead, b, n, m] or None
        self.lead = lead

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor], group: "ShapeGroup", lead: Tuple[int, ...] = ()) -> "_Matrices":
        matrices = [tensors[i].view(*lead, group.n, group.m) for i in group.members]
        if not lead:
            return cls(matrices, _batch_view(matrices, group.n, group.m))
        return cls(matrices, _stacked_batch_view(matrices, group.n, group.m, lead), lead)

    @classmethod
    def from_batch(cls, batch: torch.Tensor, lead: Tuple[int, ...] = ()) -> "_Matrices":
        return cls(list(batch.unbind(len(lead))), batch, lead)

    def read(self, dtype: torch.dtype) -> torch.Tensor:
        """The matrices as one batch in ``dtype``: ``batch`` itself where it has that
        dtype (writes to it are writes to the matrices), else a new tensor."""
        if self.batch is not None and self.batch.dtype == dtype:
            return self.batch
        if self.lead:
            return torch.stack(self.list, dim=len(self.lead)).to(dtype)
        copy = torch.empty(len(self.list), *self.list[0].shape, dtype=dtype, device=self.list[0].device)
        if self.batch is not None:
            copy.copy_(self.batch)
        else:
            torch._foreach_copy_(list(copy.unbind(0)), self.list)
        return copy

    def write(self, batch: torch.Tensor) -> None:
        """matrices ← ``batch`` (one copy through ``batch``'s view when there is one, else one _foreach op)."""
        if self.batch is not None:
            self.batch.copy_(batch)
        else:
            torch._foreach_copy_(self.list, list(batch.unbind(len(self.lead))))

    def write_reconstruction(self, p: torch.Tensor, q: torch.Tensor) -> None:
        """matrices ← P·Qᵀ: straight into ``batch``, or on CPU into each matrix, where
        they have P's dtype; else computed in P's dtype and written (converted) by
        :meth:`write`. With a leading worker dimension P and Q are averaged, the same
        for every worker: P·Qᵀ is computed once and written to every worker's rows."""
        if self.lead:
            first = (0,) * len(self.lead)
            update = reconstruct(p[first], q[first])
            self.write(update.expand(*self.lead, *update.shape))
        elif self.batch is not None and self.batch.dtype == p.dtype:
            reconstruct(p, q, out=self.batch)
        elif not _batched(p) and self.list[0].dtype == p.dtype:  # CPU: each matrix, no temporary
            for matrix, p_j, q_j in zip(self.list, p.unbind(0), q.unbind(0)):
                reconstruct(p_j, q_j, out=matrix)
        else:
            self.write(reconstruct(p, q))

    def zero_(self) -> None:
        if self.batch is not None:
            self.batch.zero_()
        else:
            torch._foreach_zero_(self.list)


@dataclass
class _GroupStep:
    """One shape group during a step: its gradients, A (b × n × m in the compute dtype)
    and where the new error goes (None without error feedback). Where A lives decides how
    much is copied: in the error buffer (formed there, it becomes the new error in place),
    in the gradients (``error_in_grad``, or no error feedback: a view, no copy), or in a
    new tensor (fp16/bf16 gradients, or no strided view of them)."""

    spec: ShapeGroup
    grads: _Matrices
    a: torch.Tensor
    error: Optional[_Matrices]


def _start_uncompressed(plan: BucketPlan, grads, allreduce_mean, start_allreduce_mean,
                        lead: Tuple[int, ...] = ()) -> "_Pending":
    """Step 1: pack the uncompressed tensors into one buffer (``[*lead, total]``) and
    start its allreduce-mean (``start_allreduce_mean``, or ``allreduce_mean`` at once
    when that is None)."""
    if not plan.uncompressed:
        return _Pending(None, None)
    packed = torch.cat([grads[i].reshape(*lead, -1) for i in plan.uncompressed], dim=-1)
    if start_allreduce_mean is None:
        allreduce_mean(packed)
        return _Pending(packed, None)
    return _Pending(packed, start_allreduce_mean(packed))


@dataclass
class _Pending:
    packed: Optional[torch.Tensor]  # the uncompressed tensors, one after the other
    handle: object  # its allreduce in flight (``wait()``), or None when done or absent

    @property
    def bytes(self) -> int:
        """A worker's bytes."""
        return 0 if self.packed is None else self.packed.shape[-1] * self.packed.element_size()


def _finish_uncompressed(plan: BucketPlan, grads, pending: _Pending, lead: Tuple[int, ...] = ()) -> None:
    """Step 7: wait for the uncompressed tensors' allreduce and copy the means back."""
    if pending.packed is None:
        return
    if pending.handle is not None:
        pending.handle.wait()
    targets, sources, offset = [], [], 0
    for i in plan.uncompressed:
        n = plan.numel(i)
        targets.append(grads[i])
        sources.append(pending.packed[..., offset : offset + n].view_as(grads[i]))
        offset += n
    torch._foreach_copy_(targets, sources)


def _form_a_and_p(plan: BucketPlan, grads, state: dict, options: PowerSGDOptions, extra: int,
                  lead: Tuple[int, ...] = ()) -> Tuple[List[_GroupStep], Tuple[torch.Tensor, List[torch.Tensor]]]:
    """Step 3: A = G + λ·e for every shape group, in the compute dtype, and P = A·Q into
    a :func:`p_buffer` with ``extra`` free elements at its end (returned with the groups).

    Side effects: with a separate error buffer and gradients in the compute dtype, A is
    formed in the error buffer (``state["error"]`` holds A until step 5 makes it the new
    error): on CPU matrix by matrix, each product reading its A while it is still in
    cache (about 1 ms of a ResNet-18 step, one thread), on GPUs one kernel or _foreach op
    per group. With ``error_in_grad`` the gradients already hold A. Nothing else is
    written."""
    dtype = grads[plan.groups[0].members[0]].dtype
    cdtype = compute_dtype(dtype)
    error = state.get("error") if options.error_feedback and not options.error_in_grad else None
    decay = options.error_decay
    steps, addends = [], []  # addends: G where A = G + λ·e is still to be formed in e
    for spec in plan.groups:
        g = _Matrices.of(grads, spec, lead)
        if error is None:  # A is G (error_in_grad: G holds G + λe already)
            keeps_error = options.error_in_grad and options.error_feedback
            steps.append(_GroupStep(spec, g, g.read(cdtype), g if keeps_error else None))
            addends.append(None)
        elif dtype == cdtype:  # A formed in the error buffer, in one pass, below
            e = _group_error(error, spec)
            steps.append(_GroupStep(spec, g, e, _Matrices.from_batch(e, lead)))
            addends.append(g)
        else:
            e = _group_error(error, spec)
            a = g.read(cdtype)
            if decay != 0.0:
                a.add_(e.to(cdtype), alpha=decay)
            steps.append(_GroupStep(spec, g, a, _Matrices.from_batch(e, lead)))
            addends.append(None)
    qs = [state["q"][step.spec.key].expand(*lead, -1, -1, -1) for step in steps]
    products = p_buffer([step.a for step in steps], qs, extra)
    fused = _fused_cpu_passes()
    for step, g, q, p in zip(steps, addends, qs, products[1]):
        if g is not None and not _batched(step.a) and not lead:
            for a_j, g_j, q_j, p_j in zip(step.error.list, g.list, q.unbind(0), p.unbind(0)):
                if fused is not None and q_j.shape[-1] <= FUSED_FORM_MAX_RANK and g_j.is_contiguous():
                    fused.powersgd_form_a_and_p_(a_j, g_j, q_j.t().contiguous(), p_j, decay)
                    continue
                torch.add(g_j, a_j, alpha=decay, out=a_j)
                compute_p(a_j, q_j, out=p_j)
            continue
        if g is not None:
            if g.batch is not None:
                torch.add(g.batch, step.a, alpha=decay, out=step.a)
            else:
                _foreach_add_scaled_(step.error.list, g.list, decay)
        compute_p(step.a, q, out=p)
    return steps, products


def redraw_qs(plan: BucketPlan, state: dict, dtype: torch.dtype, device) -> None:
    """Step 2 (no warm start): every Q redrawn from N(0, 1) with the generator saved in
    ``state`` (whose new state is saved back), in ``dtype`` on ``device``. One draw per
    bucket, the same on every worker (a stacked form draws it once for all)."""
    generator = _generator_from(state)
    state["q"].update(_draw_qs(plan, generator, dtype, device))
    state["rng_state"] = generator.get_state()


def _redraw_qs(plan: BucketPlan, state: dict, grads) -> None:
    """:func:`redraw_qs` in the gradients' compute dtype, on their device."""
    first = grads[plan.groups[0].members[0]]
    redraw_qs(plan, state, compute_dtype(first.dtype), first.device)


def _apply_update(groups: List[_GroupStep], factors: Factors, out, options: PowerSGDOptions,
                  lead: Tuple[int, ...] = ()) -> None:
    """Step 5: the error keeps what the update misses, e ← A − P·Qᵀ (in place where A is
    the error's storage, else computed in A and copied), and the update P·Qᵀ is written
    to the gradients, or with ``error_in_grad`` to ``out`` (the gradients then hold the
    error, or zeros without error feedback)."""
    fused = _fused_cpu_passes()
    for group, p, q in zip(groups, factors.p, factors.q):
        if _updates_matrix_by_matrix(group, p, options):
            for a_j, g_j, p_j, q_j in zip(group.a.unbind(0), group.grads.list, p.unbind(0), q.unbind(0)):
                if fused is not None and p_j.shape[-1] <= FUSED_UPDATE_MAX_RANK and g_j.is_contiguous():
                    # G ← P·Qᵀ and e ← e − P·Qᵀ in one sweep
                    fused.powersgd_apply_update_(a_j, g_j, p_j, q_j.t().contiguous())
                elif p_j.shape[-1] >= 2:  # G ← P·Qᵀ, then e ← e − G while G is still in cache
                    reconstruct(p_j, q_j, out=g_j)
                    a_j.sub_(g_j)
                else:  # r = 1: e ← e − P·Qᵀ in addmm_, then G ← P·Qᵀ
                    a_j.addmm_(p_j, q_j.t(), alpha=-1.0)
                    reconstruct(p_j, q_j, out=g_j)
            continue
        if group.error is not None:
            subtract_reconstruction_(group.a, p, q)
            if group.a is not group.error.batch:
                group.error.write(group.a)
        if options.error_in_grad:
            _Matrices.of(out, group.spec, lead).write_reconstruction(p, q)
            if not options.error_feedback:
                group.grads.zero_()
        else:
            group.grads.write_reconstruction(p, q)


def _updates_matrix_by_matrix(group: _GroupStep, p: torch.Tensor, options: PowerSGDOptions) -> bool:
    """Whether step 5 runs matrix by matrix on CPU, writing G ← P·Qᵀ and e ← A − P·Qᵀ
    with A in the error buffer (not ``error_in_grad``; gradients in the compute dtype,
    written directly): in one sweep of the rows where cuda_ext's CPU module is loaded
    (:func:`_fused_cpu_passes`) and r ≤ ``FUSED_UPDATE_MAX_RANK``; else at r ≥ 2 G first
    and then e ← e − G, where MKL's GEMM with so few inner terms is slower than reading G
    again (r = 4, 8: about 7 ms against 4.5 ms for ResNet-18's matrices, one thread), and
    at r = 1 ``addmm_`` into e and then G, the faster order there."""
    return (not _batched(p) and not options.error_in_grad and group.error is not None and not group.grads.lead
            and group.a is group.error.batch and group.grads.list[0].dtype == p.dtype)


FUSED_FORM_MAX_RANK = 16
"""The highest rank at which step 3 takes the fused CPU pass (A and P = A·Q in one sweep
of the rows, P in tiles of 3 rows × 4 columns); at r = 32 MKL's product, reading A again
from cache, is as fast (measured on ResNet-18's P factors, one thread)."""

FUSED_Q_MAX_RANK = 32
"""The highest rank at which Q = Aᵀ·P takes the fused CPU pass (:func:`compute_q`); it is
0.5–0.8× torch's product at every rank measured, 1 to 32 (ResNet-18's matrices, one
thread)."""

FUSED_UPDATE_MAX_RANK = 8
"""The highest rank at which step 5 takes the fused CPU pass (G ← P·Qᵀ and e ← e − P·Qᵀ
in one sweep of the rows); above it the pass sums P·Qᵀ in sweeps of 8 columns, each
after the first reading G again, and torch's product and subtraction are faster
(r = 16: 10.3 against 15.2 ms on ResNet-18's matrices, one thread)."""


def _fused_cpu_passes():
    """cuda_ext's compiled CPU module when something has loaded it in this process and it
    has PowerSGD's fused passes (``powersgd_form_a_and_p_``, ``powersgd_apply_update_``,
    cuda_ext/csrc/powersgd_cpu.cpp), else None. Never builds it: as for the
    orthogonalization (see :mod:`.orthogonalization`), a first build takes minutes, and
    ``orthogonalization.prepare("householder", "cpu")`` is how a user loads it."""
    try:
        import cuda_ext  # a top-level package of this project
    except ImportError:
        return None
    return cuda_ext.loaded_cpu_passes("powersgd_form_a_and_p_", "powersgd_apply_update_",
                                      "powersgd_transposed_product_")


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
    """The group's ``[*lead, b, n, m]`` block of the error buffer ``[*lead, error_numel]``."""
    block = error[..., group.e_offset : group.e_offset + group.e_numel]
    return block.view(*error.shape[:-1], len(group.members), group.n, group.m)


def _stacked_batch_view(matrices: Sequence[torch.Tensor], n: int, m: int, lead: Tuple[int, ...]
                        ) -> Optional[torch.Tensor]:
    """:func:`_batch_view` for matrices with one leading worker dimension (``[W, n, m]``
    each, every worker's rows laid out alike): one ``[W, b, n, m]`` view, or None."""
    if len(lead) != 1:
        return None
    rows = [matrix[0] for matrix in matrices]
    if any(matrix.stride(0) != matrices[0].stride(0) for matrix in matrices):
        return None
    first = rows[0]
    if not first.is_contiguous():
        return None
    if len(rows) == 1:
        return matrices[0].unsqueeze(1)
    size = first.element_size()
    step = rows[1].data_ptr() - first.data_ptr()
    if step < n * m * size or step % size:
        return None
    for k, row in enumerate(rows):
        if row.data_ptr() != first.data_ptr() + k * step or not row.is_contiguous() \
                or row.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
            return None
    return matrices[0].as_strided((lead[0], len(rows), n, m), (matrices[0].stride(0), step // size, m, 1))


def _foreach_add_scaled_(errors: List[torch.Tensor], grads: Sequence[torch.Tensor], decay: float) -> None:
    """e ← G + λ·e for every pair, as _foreach ops."""
    if decay == 0.0:
        torch._foreach_copy_(errors, list(grads))
        return
    if decay != 1.0:
        torch._foreach_mul_(errors, decay)
    torch._foreach_add_(errors, list(grads))


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
