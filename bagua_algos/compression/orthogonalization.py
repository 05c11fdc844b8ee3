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
  extension cannot be built or loaded, ``"torch_qr"`` (the same algorithm in torch) is
  used instead, with one warning.
- ``"auto"``: ``"householder"`` when the extension is already loaded (it is never
  built just for "auto"); else on CPU ``"torch_qr"`` for r ≥ 2 and ``"gram_schmidt"``
  for r = 1, and ``"gram_schmidt"`` on GPUs (measured: docs/benchmarks.md, issue 9).

fp16 and bf16 inputs are computed in float32 and returned in their own dtype.
Newton–Schulz iterations are not offered: they do not give orthonormal columns.
"""

from __future__ import annotations

import math
import warnings
from collections import defaultdict
from typing import Dict, List, Sequence, Tuple

import torch

__all__ = [
    "METHODS",
    "DEFAULT_EPSILON",
    "check_method",
    "orthogonalize",
    "orthogonalize_batch",
    "gram_schmidt",
    "cholesky_qr2",
    "torch_qr",
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
    if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or not (0 <= epsilon < math.inf):
        raise ValueError(f"epsilon must be a finite number >= 0, got {epsilon!r}")
    return float(epsilon)


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
    if not bool(good.all()):
        bad = (~good).nonzero().flatten()
        q[bad] = gram_schmidt(a[bad], epsilon)
    return q


def torch_qr(batch: torch.Tensor, epsilon: float = DEFAULT_EPSILON) -> torch.Tensor:
    """``torch.linalg.qr`` (reduced) on each matrix of ``batch``; ``epsilon`` unused."""
    del epsilon
    return torch.linalg.qr(batch.to(_compute_dtype(batch.dtype)), mode="reduced").Q


_BATCH_METHODS = {"gram_schmidt": gram_schmidt, "cholesky_qr2": cholesky_qr2, "torch_qr": torch_qr}


# --- the compiled extension ------------------------------------------------------------
_extension_failure_warned = False


def _householder_or_none(devices):
    """``cuda_ext.orthogonalize`` if the extension builds and loads for every device of
    ``devices``, else None (warned once per process)."""
    global _extension_failure_warned
    try:
        import cuda_ext  # a top-level package of this project

        householder = None
        for device in devices:
            householder = cuda_ext.load_orthogonalize(device)
        return householder
    except Exception as error:  # noqa: BLE001 — any build or load failure means: fall back
        if not _extension_failure_warned:
            _extension_failure_warned = True
            warnings.warn(
                f"orthogonalization='householder': the cuda_ext extension is not available ({error}); "
                "using torch.linalg.qr (the same Householder QR, in torch) instead",
                RuntimeWarning,
                stacklevel=3,
            )
        return None


def _householder_loaded(devices) -> bool:
    try:
        import cuda_ext

        return all(cuda_ext.is_loaded(device) for device in devices)
    except Exception:  # noqa: BLE001
        return False


def _resolve(method: str, devices, rank=None) -> str:
    """The method "auto" stands for, measured (docs/benchmarks.md, issue 9): the
    extension when it is loaded; else, on CPU, batched ``torch.linalg.qr`` for r ≥ 2
    (0.1–1.0× torch's per-layer loop on ResNet-18's P factors, where Gram–Schmidt was
    0.5–5.5×) and Gram–Schmidt for r = 1 and on GPUs (where batched QR is slow)."""
    check_method(method)
    if method == "auto":
        if devices and _householder_loaded(devices):
            return "householder"
        if rank is not None and rank >= 2 and all(torch.device(d).type == "cpu" for d in devices):
            return "torch_qr"
        return "gram_schmidt"
    return method


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


def orthogonalize_batch(batch: torch.Tensor, method: str = "auto", epsilon: float = DEFAULT_EPSILON) -> torch.Tensor:
    """Orthogonalize every matrix of ``batch`` (b × m × r); a new tensor in ``batch``'s dtype."""
    epsilon = _check_epsilon(epsilon)
    if not torch.is_tensor(batch) or batch.dim() != 3 or not batch.is_floating_point():
        raise ValueError(f"batch must be a 3-D floating-point tensor (b × m × r), got {_describe(batch)}")
    if batch.shape[2] > batch.shape[1]:
        raise ValueError(f"batch must hold m × r matrices with r ≤ m, got shape {tuple(batch.shape)}")
    method = _resolve(method, {batch.device}, batch.shape[2])
    if batch.numel() == 0:
        return batch.clone()
    if method == "householder":
        householder = _householder_or_none({batch.device})
        if householder is not None:
            return torch.stack(householder(list(batch.unbind(0)), epsilon=epsilon))
        method = "torch_qr"
    return _BATCH_METHODS[method](batch, epsilon).to(batch.dtype)


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
    if method == "householder":
        householder = _householder_or_none(devices)
        if householder is not None:
            return list(householder(matrices, epsilon=epsilon))
        method = "torch_qr"
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
