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
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .orthogonalization import DEFAULT_EPSILON, orthogonalize_batch

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

    @property
    def p_numel(self) -> int:
        return len(self.members) * self.n * self.r

    @property
    def q_numel(self) -> int:
        return len(self.members) * self.m * self.r


@dataclass(frozen=True)
class BucketPlan:
    """How one bucket of tensors is compressed: shape groups, uncompressed indices,
    where each compressed tensor's error lies in the bucket's error buffer."""

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
    p_offset = q_offset = 0
    for (n, m), members in by_shape.items():
        r = min(rank, n, m)
        group = ShapeGroup(f"{n}x{m}", n, m, r, tuple(members), p_offset, q_offset)
        groups.append(group)
        p_offset += group.p_numel
        q_offset += group.q_numel
    error_offsets = {}
    offset = 0
    for index in sorted(i for g in groups for i in g.members):
        error_offsets[index] = offset
        offset += math.prod(shapes[index])
    return BucketPlan(shapes, rank, tuple(groups), tuple(uncompressed), error_offsets, offset, p_offset, q_offset)


def stable_seed(seed: int, name: str) -> int:
    """A 63-bit seed from the algorithm's ``seed`` and a name (the bucket's tensor
    names), identical on every worker and every run (no Python hash randomization)."""
    return (int(seed) * 0x9E3779B1 + zlib.crc32(name.encode())) % (2**63)


# --- state ---------------------------------------------------------------------------------
def _new_generator(device: torch.device, seed: int) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def _draw_q(group: ShapeGroup, generator: torch.Generator, dtype, device) -> torch.Tensor:
    return torch.randn(len(group.members), group.m, group.r, generator=generator, dtype=dtype, device=device)


def init_state(plan: BucketPlan, seed: int, dtype: torch.dtype, device, error_feedback: bool) -> dict:
    """A bucket's PowerSGD state: the Q's (one b × m × r batch per shape group, i.i.d.
    N(0, 1) from a generator on ``device`` seeded with ``seed``, so identical on every
    worker), the generator's state, and the error buffer (zeros, the gradients' dtype;
    absent without error feedback). Plain tensors and dicts: checkpointable as is."""
    device = torch.device(device)
    cdtype = compute_dtype(dtype)
    generator = _new_generator(device, seed)
    q = {g.key: _draw_q(g, generator, cdtype, device) for g in plan.groups}
    state = {"q": q, "rng_state": generator.get_state(), "compressed_steps": 0}
    if error_feedback:
        state["error"] = torch.zeros(plan.error_numel, dtype=dtype, device=device)
    return state


def _generator_from(state: dict, device) -> torch.Generator:
    generator = torch.Generator(device=torch.device(device))
    generator.set_state(state["rng_state"])
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
    """Bytes handed to collectives by one call (payloads only)."""

    p: int = 0
    q: int = 0
    uncompressed: int = 0

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
    """
    if start_allreduce_mean is None:
        def start_allreduce_mean(tensor):
            allreduce_mean(tensor)
            return _identity_start(tensor)

    bytes_sent = StepBytes()
    device = grads[0].device if grads else torch.device("cpu")

    # Uncompressed tensors: one packed allreduce, started first so it overlaps the P's.
    pending = None
    if plan.uncompressed:
        packed = torch.cat([grads[i].reshape(-1) for i in plan.uncompressed])
        bytes_sent.uncompressed = packed.numel() * packed.element_size()
        pending = start_allreduce_mean(packed)
    if not plan.groups:
        _unpack_uncompressed(plan, grads, pending, packed if plan.uncompressed else None)
        return bytes_sent

    gdtype = grads[plan.groups[0].members[0]].dtype
    cdtype = compute_dtype(gdtype)
    in_place = gdtype == cdtype
    error = state.get("error") if options.error_feedback and not options.error_in_grad else None
    decay = options.error_decay

    # A_i = G_i + λ e_i as an n × m matrix (in the gradient itself when the dtype allows).
    matrices: Dict[int, torch.Tensor] = {}
    for group in plan.groups:
        for i in group.members:
            g = grads[i].view(group.n, group.m)
            if error is not None and in_place:
                # A is formed in the error buffer (one pass); it becomes the new error in place.
                e = _error_view(plan, error, i, group)
                a = torch.add(g, e, alpha=decay, out=e)
            else:
                a = g if in_place else g.to(cdtype)
                if error is not None and decay != 0.0:
                    a.add_(_error_view(plan, error, i, group).to(cdtype), alpha=decay)
            matrices[i] = a

    generator = None
    if not options.warm_start:
        generator = _generator_from(state, device)
        for group in plan.groups:
            state["q"][group.key] = _draw_q(group, generator, cdtype, device)

    # P = A Q, packed by shape group (a group's P's are one b × n × r batch).
    extra = 0 if p_extra is None else p_extra.numel()
    p_flat = torch.empty(plan.p_numel + extra, dtype=cdtype, device=device)
    p_batches = {}
    for group in plan.groups:
        batch = p_flat[group.p_offset : group.p_offset + group.p_numel].view(len(group.members), group.n, group.r)
        q = state["q"][group.key]
        for j, i in enumerate(group.members):
            torch.mm(matrices[i], q[j], out=batch[j])
        p_batches[group.key] = batch
    if extra:
        p_flat[plan.p_numel :].copy_(p_extra.to(cdtype))
    allreduce_mean(p_flat)
    bytes_sent.p = p_flat.numel() * p_flat.element_size()
    if extra:
        p_extra.copy_(p_flat[plan.p_numel :].to(p_extra.dtype))

    # Orthonormal columns, one batch per shape.
    for group in plan.groups:
        p_batches[group.key] = orthogonalize_batch(p_batches[group.key], options.orthogonalization, options.epsilon)

    # Q = Aᵀ P, packed; its mean is the new Q (kept for the warm start).
    q_flat = torch.empty(plan.q_numel, dtype=cdtype, device=device)
    q_batches = {}
    for group in plan.groups:
        batch = q_flat[group.q_offset : group.q_offset + group.q_numel].view(len(group.members), group.m, group.r)
        p = p_batches[group.key]
        for j, i in enumerate(group.members):
            torch.mm(matrices[i].t(), p[j], out=batch[j])
        q_batches[group.key] = batch
    allreduce_mean(q_flat)
    bytes_sent.q = q_flat.numel() * q_flat.element_size()

    # M̃ = P Qᵀ; the error keeps what it missed: e = A − M̃.
    for group in plan.groups:
        p, q = p_batches[group.key], q_batches[group.key]
        for j, i in enumerate(group.members):
            a = matrices[i]
            g = grads[i].view(group.n, group.m)
            if options.error_in_grad:
                target = out[i].view(group.n, group.m)
                if target.dtype == cdtype:
                    torch.mm(p[j], q[j].t(), out=target)
                else:
                    target.copy_(p[j] @ q[j].t())
                if options.error_feedback:
                    if in_place:
                        g.addmm_(p[j], q[j].t(), alpha=-1.0)
                    else:
                        g.copy_(a.addmm_(p[j], q[j].t(), alpha=-1.0))
                else:
                    g.zero_()
                continue
            if error is not None:
                e = _error_view(plan, error, i, group)
                if in_place:  # A is e's storage: e = A − P Qᵀ in place, then G = P Qᵀ
                    e.addmm_(p[j], q[j].t(), alpha=-1.0)
                    torch.mm(p[j], q[j].t(), out=g)
                else:
                    approx = p[j] @ q[j].t()
                    e.copy_(a - approx)
                    g.copy_(approx)
            elif in_place:
                torch.mm(p[j], q[j].t(), out=g)
            else:
                g.copy_(p[j] @ q[j].t())

    if options.warm_start:
        # A Q column that became exactly zero (zero or rank-deficient gradient) would stay
        # zero forever: redraw those columns. Every worker holds the same Q and the same
        # generator, so every worker redraws the same columns with the same values.
        generator = _generator_from(state, device)
        for group in plan.groups:
            q = q_batches[group.key]
            fresh = _draw_q(group, generator, cdtype, device)
            dead = torch.linalg.vector_norm(q, dim=-2, keepdim=True) == 0
            state["q"][group.key] = torch.where(dead, fresh, q)
    if generator is not None:
        state["rng_state"] = generator.get_state()
    state["compressed_steps"] = int(state.get("compressed_steps", 0)) + 1

    _unpack_uncompressed(plan, grads, pending, packed if plan.uncompressed else None)
    return bytes_sent


def _error_view(plan: BucketPlan, error: torch.Tensor, index: int, group: ShapeGroup) -> torch.Tensor:
    offset = plan.error_offsets[index]
    return error[offset : offset + group.n * group.m].view(group.n, group.m)


def _unpack_uncompressed(plan: BucketPlan, grads, pending, packed) -> None:
    if pending is None:
        return
    pending.wait()
    offset = 0
    for i in plan.uncompressed:
        n = grads[i].numel()
        grads[i].copy_(packed[offset : offset + n].view_as(grads[i]))
        offset += n


# --- sizes -------------------------------------------------------------------------------------
def compression_summary(module: torch.nn.Module, rank: int, min_compression_rate: float = 2.0) -> dict:
    """Bytes one PowerSGD step sends for ``module``'s trainable parameters.

    Per layer (parameter name): its shape, matrix shape, whether it is compressed,
    ``uncompressed_bytes`` (n·m elements in its dtype), ``compressed_bytes`` ((n + m)·r'
    elements of P and Q in the compute dtype, or the uncompressed bytes) and ``ratio``.
    Totals: ``total_uncompressed_bytes``, ``total_compressed_bytes`` and ``total_ratio``.
    These count payloads as the algorithm's live counters do (``bytes_last_step``).
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank must be an int >= 1, got {rank!r}")
    if isinstance(min_compression_rate, bool) or not isinstance(min_compression_rate, (int, float)) \
            or not (1 <= min_compression_rate < math.inf):
        raise ValueError(f"min_compression_rate must be a finite number >= 1, got {min_compression_rate!r}")
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
