"""Orthogonalization of tall-skinny matrices: the step PowerSGD runs on its P factors.

Pure tensor math on the input's device; no communication. Every method takes matrices
A (m × r, r ≤ m) and returns Q (m × r) whose columns span the column space of A and,
where A has full column rank, are orthonormal: QᵀQ = I.

Methods (``METHODS``):

- ``"gram_schmidt"``: column-by-column Gram–Schmidt, batched over matrices of one
  shape, as torch's ``powerSGD_hook`` does it, with the projection done twice:

      a_i ← a_i − Q_{<i}(Q_{<i}ᵀ a_i)  (twice)      q_i ← a_i / max(‖a_i‖, ε·max|A|)

  ``epsilon`` clamps the norm, relative to the matrix's largest entry (ε alone for a
  zero matrix), so the result does not depend on A's scale: a zero (or linearly
  dependent) column becomes a (near-)zero column instead of NaN, so a zero gradient
  compresses to zero.
- ``"cholesky_qr2"``: two passes of Cholesky QR (G = AᵀA = LLᵀ, Q = A L⁻ᵀ), batched;
  the first pass has a small shift s·I (s ∝ m·r·u·‖A‖²_F, Fukaya et al.'s shifted
  CholeskyQR) so an ill-conditioned A still factors. Matrices where a pass fails, or
  whose result is not orthonormal to 1e-5 in float32, 1e-12 in float64 (rank-deficient input), are redone with
  Gram–Schmidt, so the contract above holds.
- ``"torch_qr"``: ``torch.linalg.qr`` (Householder), batched; always orthonormal
  columns (an arbitrary unit column where A is rank deficient).
- ``"householder"``: the compiled batched Householder QR of ``cuda_ext`` (one call for
  all shapes: one CUDA kernel launch, or one parallel loop on CPU), with LAPACK's sign
  convention, so Q matches ``"torch_qr"`` up to rounding. Here ``epsilon`` is relative
  to the matrix's largest entry: a column whose remaining norm is below it gets a unit
  column orthogonal to the others (not a zero column as in Gram–Schmidt). When the
  extension cannot be built or loaded, the same algorithm in torch is used instead,
  with one warning: ``torch.linalg.qr`` on CPU, and on GPUs :func:`householder_torch`
  (the extension's math step for step, batched over every matrix of a call, so it
  agrees with the extension to rounding, zero columns included; a column dependent
  only up to rounding becomes some unit column in both, not necessarily the same).
- ``"auto"``: ``"householder"`` wherever the extension is loaded: on GPUs it is one
  launch for all matrices, and on CPU, once built, it takes 0.05–0.40× the time of
  torch's per-layer loop on PowerSGD's P factors (docs/benchmarks.md, Orthogonalization).
  On GPUs :func:`prepare` loads it, building it the first time, and PowerSGD calls
  :func:`prepare` when it sets up its buckets, so a step never waits for a compiler. On
  CPU "auto" never builds it (its first build takes 70–170 s on a 2-core machine, more
  than a small run takes): it is used once something has loaded it (``"householder"``
  asked for explicitly, or ``prepare("householder", "cpu")``).
  Where it is not loaded (it cannot be built, or nothing prepared it): on GPUs the
  batched torch twin (never a loop over matrices); on CPU ``"torch_qr"`` for r ≥ 2 and
  ``"gram_schmidt"`` for r = 1, the fastest torch methods there (measured). From r ≥
  ``WIDE_RANK`` ``"torch_qr"`` on every device.

:func:`orthogonalize_batches_` orthogonalizes several batches of different shapes in
place in one call (what PowerSGD does with the P factors of a bucket): one kernel
launch for all of them with the extension on CUDA.

On GPUs nothing here makes the host wait for the device (no ``.item()``, no Python
branch on a tensor's values): there ``"cholesky_qr2"`` computes its Gram–Schmidt
fallback for every matrix and keeps it where Cholesky failed, instead of picking the
failed matrices out on the host as it does on CPU.

fp16 and bf16 inputs are computed in float32 and returned in their own dtype.
Newton–Schulz iterations are not offered: they do not give orthonormal columns.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from typing import Dict, List, Sequence, Tuple

import torch

from ..arguments import check_real

__all__ = [
    "METHODS",
    "DEFAULT_EPSILON",
    "check_method",
    "orthogonalize",
    "orthogonalize_batch",
    "gram_schmidt",
    "cholesky_qr2",
    "torch_qr",
    "householder_torch",
    "orthogonalize_batches_",
]

METHODS = ("auto", "gram_schmidt", "cholesky_qr2", "torch_qr", "householder")
DEFAULT_EPSILON = 1e-8
# cholesky_qr2 falls back to Gram–Schmidt above this |QᵀQ − I|. It is the module's
# contract (1e-5 in float32): a looser bound (it was 1e-3) let rank-deficient inputs
# through with Q's span missing up to ~1e-4 of A (84 of 300 random rank-1 7×3 inputs).
_ORTHONORMALITY_TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12}


def check_method(method) -> str:
    if method not in METHODS:
        raise ValueError(f"orthogonalization must be one of {list(METHODS)}, got {method!r}")
    return method


def _check_epsilon(epsilon) -> float:
    return check_real("epsilon", epsilon, 0)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# --- the methods, on a batch (b, m, r) --------------------------------------------------
def gram_schmidt(batch: torch.Tensor, epsilon: float = DEFAULT_EPSILON) -> torch.Tensor:
    """Gram–Schmidt on each matrix of ``batch`` (b × m × r); a new tensor.

    Each column is projected off the columns before it twice ("twice is enough",
    CGS2): with one pass the rounding residue of a dependent column, normalized, would
    not be orthogonal to the others.
    """
    q = batch.to(_compute_dtype(batch.dtype), copy=True)
    # The clamp is relative to each matrix's largest entry (ε itself for a zero
    # matrix), so Q does not depend on A's scale: Q(cA) = Q(A) for c > 0.
    largest = q.abs().amax(dim=(-2, -1), keepdim=True)
    floor = torch.where(largest > 0, largest * epsilon, torch.full_like(largest, epsilon))
    # A column whose remainder after projection is at rounding level (≤ m·u·‖a_i‖) is
    # numerically dependent: its remainder is noise, which CGS2 cannot make orthogonal
    # to the others (4.5e-5 off for a rank-1 7×3 float32 input), so it becomes zero.
    dependent_below = torch.linalg.vector_norm(q, dim=-2, keepdim=True) * (q.shape[-2] * torch.finfo(q.dtype).eps)
    for i in range(q.shape[-1]):
        col = q[..., i : i + 1]
        if i:
            done = q[..., :i]
            for _ in range(2):
                col.sub_(done @ (done.transpose(-2, -1) @ col))  # a_i −= Q (Qᵀ a_i)
        norm = torch.linalg.vector_norm(col, dim=-2, keepdim=True)
        col.div_(torch.maximum(norm, floor))
        if i:
            col.masked_fill_(norm <= dependent_below[..., i : i + 1], 0.0)
    return q


def _cholesky_pass(a: torch.Tensor, shift: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Q = A L⁻ᵀ with LLᵀ = AᵀA + shift·I; also whether each matrix factored."""
    gram = a.transpose(-2, -1) @ a
    gram.diagonal(dim1=-2, dim2=-1).add_(shift.unsqueeze(-1))
    lower, info = torch.linalg.cholesky_ex(gram)
    # Q Lᵀ = A  ⇔  L Qᵀ = Aᵀ: one triangular solve.
    q = torch.linalg.solve_triangular(lower, a.transpose(-2, -1), upper=False).transpose(-2, -1)
    return q, info == 0


def cholesky_qr2(batch: torch.Tensor, epsilon: float = DEFAULT_EPSILON) -> torch.Tensor:
    """Shifted Cholesky QR, twice, on each matrix of ``batch``; a new tensor."""
    a = batch.to(_compute_dtype(batch.dtype), copy=True)
    b, m, r = a.shape
    unit = torch.finfo(a.dtype).eps
    norms = torch.linalg.matrix_norm(a).square()  # ‖A‖²_F per matrix
    shift = 11.0 * (m * r + r * (r + 1)) * unit * norms
    q, ok1 = _cholesky_pass(a, shift)
    q, ok2 = _cholesky_pass(q, torch.zeros_like(shift))
    eye = torch.eye(r, dtype=a.dtype, device=a.device)
    error = (q.transpose(-2, -1) @ q - eye).abs().amax(dim=(-2, -1))
    good = ok1 & ok2 & (error <= _ORTHONORMALITY_TOLERANCE[a.dtype]) & torch.isfinite(error)
    if a.device.type != "cpu":
        # No host round trip on GPUs: Gram–Schmidt for all, kept where Cholesky failed.
        return torch.where(good.view(-1, 1, 1), q, gram_schmidt(a, epsilon))
    if not bool(good.all()):
        bad = (~good).nonzero().flatten()
        q[bad] = gram_schmidt(a[bad], epsilon)
    return q


def torch_qr(batch: torch.Tensor, epsilon: float = DEFAULT_EPSILON) -> torch.Tensor:
    """``torch.linalg.qr`` (reduced) on each matrix of ``batch``; ``epsilon`` unused."""
    del epsilon
    return torch.linalg.qr(batch.to(_compute_dtype(batch.dtype)), mode="reduced").Q


def _reflect_(block: torch.Tensor, v: torch.Tensor) -> None:
    """block ← (I − 2 v vᵀ) block for each matrix: block (b × k × c), v (b × k)."""
    dots = torch.bmm(v.unsqueeze(1), block)  # vᵀ block, b × 1 × c
    block.baddbmm_(v.unsqueeze(2), dots, alpha=-2.0)


def householder_torch(batch: torch.Tensor, epsilon: float = DEFAULT_EPSILON) -> torch.Tensor:
    """cuda_ext's Householder QR (``cuda_ext/csrc/householder.h``) in torch, batched over
    the matrices of ``batch`` (b × m × r); a new tensor.

    The same steps: scale each matrix by the power of two that brings its largest
    entry into [0.5, 1); reflection j sends the remaining column x to −sign(x₀)·|x|·e₀
    (LAPACK's sign convention) and is skipped (H_j = I) when x has nothing below its
    first entry or |x| ≤ ``epsilon``; then Q = H₀⋯H_{r−1}[I; 0] formed in place
    (as LAPACK's orgqr). So Q equals the extension's to rounding, unit columns for
    zero and dependent columns included. About 20·r kernels for the whole batch,
    whatever b is, and no host synchronization.
    """
    w = batch.to(_compute_dtype(batch.dtype), copy=True)
    b, m, r = w.shape
    if w.numel() == 0:
        return w.to(batch.dtype)
    largest = w.abs().amax(dim=(-2, -1))
    _, exponent = torch.frexp(largest)
    one = torch.ones_like(largest)
    scale = torch.where((largest > 0) & torch.isfinite(largest), torch.ldexp(one, -exponent), one)
    w.mul_(scale.view(b, 1, 1))
    for j in range(r):  # the reflections; v_j is kept in W[j:, j]
        x = w[:, j:, j]
        x0 = x[:, 0]
        below = torch.linalg.vector_norm(x[:, 1:], dim=-1)  # √σ
        alpha = torch.hypot(x0, below)
        v0 = torch.where(x0 >= 0, x0 + alpha, x0 - alpha)
        keep = (below > 0) & (alpha > epsilon)
        inv_norm = torch.where(keep, torch.hypot(v0, below).reciprocal(), torch.zeros_like(alpha))
        v0 = v0 * inv_norm
        x.mul_(inv_norm.unsqueeze(-1))
        x[:, 0] = v0
        if j + 1 < r:
            _reflect_(w[:, j:, j + 1 :], x)
    for j in reversed(range(r)):  # Q = H_0 ⋯ H_{r−1} [I; 0], in place
        v = w[:, j:, j]
        if j + 1 < r:
            _reflect_(w[:, j:, j + 1 :], v)
        v0 = v[:, :1] * -2.0
        v.mul_(v0)  # −2 v v₀ ...
        w[:, j, j] += 1.0  # ... + e_j
        if j:
            w[:, :j, j] = 0.0
    return w.to(batch.dtype)


_BATCH_METHODS = {"gram_schmidt": gram_schmidt, "cholesky_qr2": cholesky_qr2, "torch_qr": torch_qr}


# --- the compiled extension ------------------------------------------------------------
_extension_failure_warned = False


def _load_extension(devices, requested: str = "householder"):
    """The ``cuda_ext`` package if its module builds and loads for every device of
    ``devices``, else None (warned once per process, naming what is used instead)."""
    global _extension_failure_warned
    try:
        import cuda_ext  # a top-level package of this project

        for device in devices:
            cuda_ext.load_orthogonalize(device)
        return cuda_ext
    except Exception as error:  # noqa: BLE001 — any build or load failure means: fall back
        if not _extension_failure_warned:
            _extension_failure_warned = True
            on_gpu = any(torch.device(d).type != "cpu" for d in devices)
            if on_gpu:
                instead = ("a batched Householder QR in torch (householder_torch: the same math, about 20·r "
                           "kernel launches per call instead of one)")
            elif requested == "auto":
                instead = "torch.linalg.qr for r >= 2 and Gram-Schmidt for r = 1"
            else:
                instead = "torch.linalg.qr (the same Householder QR, in torch)"
            warnings.warn(
                f"orthogonalization={requested!r}: the cuda_ext extension is not available ({error}); "
                f"using {instead} instead",
                RuntimeWarning,
                stacklevel=4,
            )
        return None


def _householder_or_none(devices, requested: str = "householder"):
    """``cuda_ext.orthogonalize`` if the extension builds and loads for every device of
    ``devices``, else None (warned once per process)."""
    extension = _load_extension(devices, requested)
    return None if extension is None else extension.orthogonalize


def _householder_loaded(devices) -> bool:
    try:
        import cuda_ext

        return all(cuda_ext.is_loaded(device) for device in devices)
    except Exception:  # noqa: BLE001
        return False


def _on_gpu(devices) -> bool:
    return bool(devices) and any(torch.device(d).type == "cuda" for d in devices)


# From this many columns on, "auto" runs torch.linalg.qr (LAPACK / cuSOLVER's blocked
# Householder) instead of the compiled per-matrix one: the extension's one block (CPU:
# one thread) per matrix and one column at a time is right for PowerSGD's thin P's
# (r <= 8) and falls behind there: on the CPU 0.96-1.23x linalg.qr at r = 16 and
# 1.6-2.4x at r = 128; on an H100 5x at 4096 x 32 and 23x at 4096 x 128.
WIDE_RANK = 16


def _resolve(method: str, devices, rank=None) -> str:
    """The method "auto" stands for (never builds anything). For r >= WIDE_RANK
    ``torch.linalg.qr`` on every device. Below it the compiled Householder QR on GPUs
    (where it cannot be built, its batched torch twin) and on CPU where it is loaded
    (:func:`prepare` loads it). On CPU without it, measured (docs/benchmarks.md,
    Orthogonalization): batched ``torch.linalg.qr`` for r ≥ 2 (0.1–1.0× torch's per-layer loop on
    ResNet-18's P factors, where Gram–Schmidt was 0.5–5.5×) and Gram–Schmidt for r = 1."""
    check_method(method)
    if method == "auto":
        if rank is not None and rank >= WIDE_RANK:
            return "torch_qr"
        if _on_gpu(devices) or (devices and _householder_loaded(devices)):
            return "householder"
        if rank is not None and rank >= 2 and all(torch.device(d).type == "cpu" for d in devices):
            return "torch_qr"
        return "gram_schmidt"
    return method


def prepare(method: str, device) -> str:
    """Load what ``method`` needs on ``device`` before the first step, building the
    extension the first time for ``"householder"`` (and for ``"auto"`` on GPUs; on CPU
    "auto" never builds it, see the module's notes), so a training step never waits for
    a compiler; where it cannot be built, warn once and leave the torch fallback.
    Returns the method "auto" then stands for there (for 2 ≤ r < WIDE_RANK)."""
    device = torch.device(device)
    check_method(method)
    if method == "householder" or (method == "auto" and device.type != "cpu"):
        _load_extension({device}, method)
    return _resolve(method, {device}, 2)


# --- entry points ------------------------------------------------------------------------
def _check_matrix(index: int, matrix) -> None:
    if not torch.is_tensor(matrix) or matrix.dim() != 2 or not matrix.is_floating_point():
        raise ValueError(f"matrices[{index}] must be a 2-D floating-point tensor, got {_describe(matrix)}")
    if matrix.shape[1] > matrix.shape[0]:
        raise ValueError(f"matrices[{index}] must have no more columns than rows (m × r, r ≤ m), got shape {tuple(matrix.shape)}")


def _describe(value) -> str:
    if torch.is_tensor(value):
        return f"a {value.dim()}-D {value.dtype} tensor"
    return repr(value)


def _fallback(device) -> str:
    """What stands in for the extension on ``device``: the same Householder QR in torch."""
    return "torch_qr" if torch.device(device).type == "cpu" else "householder_torch"


def orthogonalize_batch(batch: torch.Tensor, method: str = "auto", epsilon: float = DEFAULT_EPSILON) -> torch.Tensor:
    """Orthogonalize every matrix of ``batch`` (b × m × r); a new tensor in ``batch``'s dtype."""
    epsilon = _check_epsilon(epsilon)
    if not torch.is_tensor(batch) or batch.dim() != 3 or not batch.is_floating_point():
        raise ValueError(f"batch must be a 3-D floating-point tensor (b × m × r), got {_describe(batch)}")
    if batch.shape[2] > batch.shape[1]:
        raise ValueError(f"batch must hold m × r matrices with r ≤ m, got shape {tuple(batch.shape)}")
    requested = method
    method = _resolve(method, {batch.device}, batch.shape[2])
    if batch.numel() == 0:
        return batch.clone()
    if method == "householder":
        extension = _load_extension({batch.device}, requested)
        if extension is not None:
            out = batch.clone(memory_format=torch.contiguous_format)
            extension.orthogonalize_batches_([out], epsilon=epsilon)
            return out
        method = _fallback(batch.device)
    if method == "householder_torch":
        return householder_torch(batch, epsilon)
    return _BATCH_METHODS[method](batch, epsilon).to(batch.dtype)


def _check_batches(batches) -> List[torch.Tensor]:
    if torch.is_tensor(batches) or not isinstance(batches, Sequence):
        raise ValueError(f"batches must be a list of 3-D tensors, got {type(batches).__name__}")
    batches = list(batches)
    for index, batch in enumerate(batches):
        if not torch.is_tensor(batch) or batch.dim() != 3 or not batch.is_floating_point():
            raise ValueError(f"batches[{index}] must be a 3-D floating-point tensor (b × m × r), got {_describe(batch)}")
        if batch.shape[2] > batch.shape[1]:
            raise ValueError(f"batches[{index}] must hold m × r matrices with r ≤ m, got shape {tuple(batch.shape)}")
        if batch.device != batches[0].device:
            raise ValueError(f"batches[{index}] is on {batch.device} but batches[0] is on {batches[0].device}; "
                             "one call takes tensors of one device")
    return batches


def _householder_torch_batches_(batches: Sequence[torch.Tensor], epsilon: float) -> None:
    """:func:`householder_torch` on several batches in one go: batches whose row counts
    round up to the same power of two (and with the same r and dtype) are zero-padded
    into one batch. Zero rows change no reflection (each v_j is zero there), so Q is
    the unpadded Q with zero rows below; padding at most doubles the rows."""
    classes: Dict[tuple, List[torch.Tensor]] = defaultdict(list)
    for batch in batches:
        b, m, r = batch.shape
        if batch.numel():
            classes[(1 << (m - 1).bit_length(), r, batch.dtype)].append(batch)
    for (rows, r, dtype), members in classes.items():
        if len(members) == 1:
            members[0].copy_(householder_torch(members[0], epsilon))
            continue
        total = sum(batch.shape[0] for batch in members)
        padded = torch.zeros(total, rows, r, dtype=_compute_dtype(dtype), device=members[0].device)
        offset = 0
        for batch in members:
            padded[offset : offset + batch.shape[0], : batch.shape[1]].copy_(batch)
            offset += batch.shape[0]
        q = householder_torch(padded, epsilon)
        offset = 0
        for batch in members:
            batch.copy_(q[offset : offset + batch.shape[0], : batch.shape[1]])
            offset += batch.shape[0]


def orthogonalize_batches_(batches: Sequence[torch.Tensor], method: str = "auto",
                           epsilon: float = DEFAULT_EPSILON) -> List[torch.Tensor]:
    """Orthogonalize, in place, every matrix of every batch (b_k × m_k × r_k, r_k ≤ m_k,
    one device, any mix of shapes and floating dtypes); returns ``batches``.

    What PowerSGD does with a bucket's P factors (one batch per shape, views into the
    buffer that was allreduced). With the extension ("householder", or "auto" on GPUs)
    this is one call for all batches: one kernel launch on CUDA. Else each batch is
    done by the method "auto" picks for it (on CPU) or by the batched torch twin of the
    extension (on GPUs); results are written back into the batches.
    """
    epsilon = _check_epsilon(epsilon)
    batches = _check_batches(batches)
    check_method(method)
    work = [batch for batch in batches if batch.numel()]
    if not work:
        return batches
    device = work[0].device
    requested = method
    resolved = _resolve(method, {device}, None)
    if requested == "auto" and resolved == "householder":
        wide = [batch for batch in work if batch.shape[2] >= WIDE_RANK]
        for batch in wide:  # linalg.qr (see WIDE_RANK)
            batch.copy_(orthogonalize_batch(batch, "auto", epsilon))
        work = [batch for batch in work if batch.shape[2] < WIDE_RANK]
        if not work:
            return batches
    if requested == "auto" and resolved != "householder":
        for batch in work:  # on CPU each shape picks by its rank (orthogonalize_batch)
            batch.copy_(orthogonalize_batch(batch, "auto", epsilon))
        return batches
    if resolved == "householder":
        extension = _load_extension({device}, requested)
        if extension is not None:
            extension.orthogonalize_batches_(work, epsilon=epsilon)
            return batches
        resolved = _fallback(device)
    if resolved == "householder_torch":
        _householder_torch_batches_(work, epsilon)
        return batches
    for batch in work:
        batch.copy_(_BATCH_METHODS[resolved](batch, epsilon))
    return batches


def orthogonalize(
    matrices: Sequence[torch.Tensor], method: str = "auto", epsilon: float = DEFAULT_EPSILON
) -> List[torch.Tensor]:
    """Orthogonalize each matrix of ``matrices`` (any mix of shapes m_i × r_i, r_i ≤ m_i).

    Returns new tensors in the inputs' dtypes and order. Matrices of one shape, dtype
    and device are processed as one batch (the compiled method takes all at once).

    >>> import torch
    >>> q, = orthogonalize([torch.randn(6, 2)], "gram_schmidt")
    >>> bool(torch.allclose(q.T @ q, torch.eye(2), atol=1e-5))
    True
    """
    epsilon = _check_epsilon(epsilon)
    matrices = list(matrices)
    for index, matrix in enumerate(matrices):
        _check_matrix(index, matrix)
    if not matrices:
        return []
    devices = {matrix.device for matrix in matrices}
    requested, method = method, _resolve(method, devices)
    if requested == "auto" and method != "householder":
        method = "auto"  # each same-shape group picks by its rank (orthogonalize_batch)
    if method == "householder" and requested == "auto" and any(m.shape[1] >= WIDE_RANK for m in matrices):
        narrow = [i for i, m in enumerate(matrices) if m.shape[1] < WIDE_RANK]
        out = orthogonalize([m for m in matrices if m.shape[1] >= WIDE_RANK], "torch_qr", epsilon)
        merged = iter(orthogonalize([matrices[i] for i in narrow], "auto", epsilon))
        wide = iter(out)
        narrow_set = set(narrow)
        return [next(merged) if i in narrow_set else next(wide) for i in range(len(matrices))]
    if method == "householder":
        householder = _householder_or_none(devices, requested)
        if householder is not None:
            return list(householder(matrices, epsilon=epsilon))
        method = "torch_qr" if not _on_gpu(devices) else "householder"  # orthogonalize_batch falls back per device
    groups: Dict[tuple, List[int]] = defaultdict(list)
    for index, matrix in enumerate(matrices):
        groups[(tuple(matrix.shape), matrix.dtype, matrix.device)].append(index)
    out: List[torch.Tensor] = [None] * len(matrices)  # type: ignore[list-item]
    for indices in groups.values():
        batch = torch.stack([matrices[i] for i in indices])
        result = orthogonalize_batch(batch, method, epsilon)
        for i, q in zip(indices, result.unbind(0)):
            out[i] = q
    return out
