"""Compiled batched orthogonalization for PowerSGD: Householder QR of many small
tall-skinny matrices in one call (one CUDA kernel launch, or one parallel loop on CPU).

For matrices A_i (m_i × r_i, r_i ≤ m_i, any mix of shapes, any strides) it returns
Q_i (m_i × r_i, contiguous, A_i's dtype) with orthonormal columns, Q_iᵀQ_i = I, such
that A_i = Q_i R_i with R_i upper triangular:

    Q = H_0 H_1 ⋯ H_{r-1} [I_r; 0],   H_j = I − 2 v_j v_jᵀ  (|v_j| = 1, or v_j = 0)

R's diagonal has the opposite sign of the pivot entry (LAPACK's convention), so Q
agrees with ``torch.linalg.qr(A).Q`` up to rounding where A has full column rank.
A zero or dependent column (remaining norm ≤ ``epsilon`` × max|A|, relative because A
is first scaled by a power of two) skips its reflection (v_j = 0): its Q column is
still a unit vector orthogonal to the others, never NaN. fp16 and bf16 accumulate in
fp32, fp32 in fp32, fp64 in fp64. See ``csrc/householder.h`` for the algorithm,
shared by the CPU and CUDA paths.

The compiled module is built on first use (``_loader``); when it cannot be built,
:func:`load_orthogonalize` raises :class:`ExtensionUnavailable` and the caller
(``bagua_algos.compression.orthogonalization``) falls back to pure torch.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Callable, List, Sequence

import torch

from . import _loader
from ._loader import ExtensionUnavailable, cache_dir

__all__ = [
    "DEFAULT_EPSILON",
    "ExtensionUnavailable",
    "orthogonalize",
    "load_orthogonalize",
    "is_loaded",
    "is_available",
    "cache_dir",
]

DEFAULT_EPSILON = 1e-8
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _check_epsilon(epsilon) -> float:
    if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or not (0 <= epsilon < math.inf):
        raise ValueError(f"epsilon must be a finite number >= 0, got {epsilon!r}")
    return float(epsilon)


def _check_matrices(matrices) -> List[torch.Tensor]:
    if torch.is_tensor(matrices) or not isinstance(matrices, Sequence):
        raise ValueError(f"matrices must be a list of 2-D tensors, got {type(matrices).__name__}")
    matrices = list(matrices)
    for index, a in enumerate(matrices):
        if not torch.is_tensor(a) or a.dim() != 2:
            what = f"a {a.dim()}-D tensor" if torch.is_tensor(a) else repr(a)
            raise ValueError(f"matrices[{index}] must be a 2-D tensor (m × r), got {what}")
        if a.dtype not in _DTYPES:
            raise ValueError(f"matrices[{index}] must be float32, float64, float16 or bfloat16, got {a.dtype}")
        if a.shape[1] > a.shape[0]:
            raise ValueError(f"matrices[{index}] must have no more columns than rows (r ≤ m), got shape {tuple(a.shape)}")
    return matrices


def orthogonalize(matrices: Sequence[torch.Tensor], epsilon: float = DEFAULT_EPSILON) -> List[torch.Tensor]:
    """Q factors of ``matrices`` (see the module docstring), in order.

    Builds the extension for the matrices' devices on first use; raises
    :class:`ExtensionUnavailable` when it cannot. Matrices on several devices are
    processed one device at a time (one call each).
    """
    epsilon = _check_epsilon(epsilon)
    if isinstance(matrices, (list, tuple)):
        # Fast path: one device. The compiled module checks shapes and dtypes itself
        # (with the same messages), so the per-matrix Python checks are skipped here.
        try:
            devices = {a.device for a in matrices}
        except AttributeError:
            devices = None
        if devices is not None and not devices:
            return []
        if devices is not None and len(devices) == 1:
            kind = _loader.kind_for(next(iter(devices)))
            if _loader.loaded(kind):  # else: check in Python first, so bad input is a ValueError even if the build fails
                return _loader.load(kind).orthogonalize(list(matrices), epsilon)
    matrices = _check_matrices(matrices)
    by_device = defaultdict(list)
    for index, a in enumerate(matrices):
        by_device[a.device].append(index)
    out: List[torch.Tensor] = [None] * len(matrices)  # type: ignore[list-item]
    for device, indices in by_device.items():
        module = _loader.load(_loader.kind_for(device))
        for index, q in zip(indices, module.orthogonalize([matrices[i] for i in indices], epsilon)):
            out[index] = q
    return out


def load_orthogonalize(device="cpu") -> Callable[..., List[torch.Tensor]]:
    """Build (first time) or fetch the module for ``device`` and return :func:`orthogonalize`.

    Raises :class:`ExtensionUnavailable` if it cannot be built or loaded, so a caller
    can fall back before its first real call.
    """
    _loader.load(_loader.kind_for(device))
    return orthogonalize


def is_loaded(device=None) -> bool:
    """Whether the module for ``device`` (any device when None) is loaded, without building."""
    if device is None:
        return _loader.loaded()
    try:
        return _loader.loaded(_loader.kind_for(device))
    except ExtensionUnavailable:
        return False


def is_available(device="cpu") -> bool:
    """Whether the module for ``device`` can be loaded (builds it on first call)."""
    try:
        _loader.load(_loader.kind_for(device))
        return True
    except ExtensionUnavailable:
        return False
