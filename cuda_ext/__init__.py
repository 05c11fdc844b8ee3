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
    "orthogonalize_batches_",
    "load_orthogonalize",
    "load_cpu_passes",
    "loaded_cpu_passes",
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


# The checks of the compiled modules (csrc/bindings.cpp), word for word: a bad input is
# the same ValueError whichever device it is on and whether or not a module is built.
def _check_tensors(tensors, what: str, dims: int) -> None:
    layout = "(m x r)" if dims == 2 else "(b x m x r)"
    for index, a in enumerate(tensors):
        name = f"{what}[{index}]"
        if not torch.is_tensor(a):
            raise ValueError(f"{name} must be a {dims}-D tensor {layout}, got {a!r}")
        if a.dim() != dims:
            raise ValueError(f"{name} must be a {dims}-D tensor {layout}, got a {a.dim()}-D tensor")
        if a.dtype not in _DTYPES:
            raise ValueError(f"{name} must be float32, float64, float16 or bfloat16, got {a.dtype}")
        if a.shape[-1] > a.shape[-2]:
            raise ValueError(f"{name} must have no more columns than rows (r <= m), got shape {tuple(a.shape)}")


def _check_matrices(matrices) -> List[torch.Tensor]:
    if torch.is_tensor(matrices) or not isinstance(matrices, Sequence):
        raise ValueError(f"matrices must be a list of 2-D tensors, got {type(matrices).__name__}")
    matrices = list(matrices)
    _check_tensors(matrices, "matrices", 2)
    return matrices


def orthogonalize(matrices: Sequence[torch.Tensor], epsilon: float = DEFAULT_EPSILON) -> List[torch.Tensor]:
    """Q factors of ``matrices`` (see the module docstring), in order.

    Builds the extension for the matrices' devices on first use; raises
    :class:`ExtensionUnavailable` when it cannot. Matrices on several devices are
    processed one device at a time (one call each). Bad input is a ValueError naming
    the matrix, with the same words on every device.
    """
    epsilon = _check_epsilon(epsilon)
    if type(matrices) in (list, tuple) and matrices:
        # Fast path: CPU tensors, module loaded. The compiled module checks every
        # matrix (shape, dtype, all on matrices[0]'s device) before it runs anything, so
        # the per-matrix Python checks are skipped. When it refuses the call (a bad
        # matrix, or matrices on several devices, which the path below splits by
        # device), the path below runs instead and raises or splits as it always does.
        # Nothing on a GPU reaches a device path from here: a list led by a CPU tensor
        # with a GPU tensor in it is refused by the module's checks before it runs.
        module = _loader.loaded_module("cpu")
        first = matrices[0]
        if module is not None and isinstance(first, torch.Tensor) and first.is_cpu:
            try:
                return module.orthogonalize(list(matrices), epsilon)
            except (ValueError, TypeError):
                pass
    elif isinstance(matrices, (list, tuple)) and not matrices:
        return []
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


def orthogonalize_batches_(batches: Sequence[torch.Tensor], epsilon: float = DEFAULT_EPSILON) -> List[torch.Tensor]:
    """Replace every matrix of every batch (b_k × m_k × r_k, one device, any mix of
    shapes and dtypes) by its Q factor, in place: one kernel launch on CUDA for all of
    them, no tensor object per matrix. Returns ``batches``.

    A batch must not share memory with itself (e.g. an expanded tensor) or with another
    batch: the compiled module refuses that with a ValueError.
    """
    epsilon = _check_epsilon(epsilon)
    if torch.is_tensor(batches) or not isinstance(batches, Sequence):
        raise ValueError(f"batches must be a list of 3-D tensors, got {type(batches).__name__}")
    batches = list(batches)
    _check_tensors(batches, "batches", 3)
    if not batches:
        return batches
    device = batches[0].device
    for index, batch in enumerate(batches):
        if batch.device != device:
            raise ValueError(f"batches[{index}] is on {batch.device} but batches[0] is on {device}; "
                             "one call takes tensors of one device")
    module = _loader.load(_loader.kind_for(device))
    if hasattr(module, "orthogonalize_batches_"):
        module.orthogonalize_batches_(batches, epsilon)
        return batches
    # A module built before orthogonalize_batches_ existed (an old install-time build).
    views = [matrix for batch in batches for matrix in batch.unbind(0)]
    if views:
        torch._foreach_copy_(views, module.orthogonalize(views, epsilon))
    return batches


def load_orthogonalize(device="cpu") -> Callable[..., List[torch.Tensor]]:
    """Build (first time) or fetch the module for ``device`` and return :func:`orthogonalize`.

    Raises :class:`ExtensionUnavailable` if it cannot be built or loaded, so a caller
    can fall back before its first real call.
    """
    _loader.load(_loader.kind_for(device))
    return orthogonalize


def load_cpu_passes():
    """Build (first time: about a minute) or fetch the CPU module, and return it.

    Besides the orthogonalization it holds the fused CPU passes that the package takes
    wherever this module is loaded (:func:`loaded_cpu_passes`): PowerSGD's three
    (``csrc/powersgd_cpu.cpp``) and the one-process engine's D-PSGD mix
    (``csrc/engine_cpu.cpp``). Nothing in the package builds it by itself. Raises
    :class:`ExtensionUnavailable` if it cannot be built.

    Example::

        >>> import cuda_ext
        >>> module = cuda_ext.load_cpu_passes()
        >>> cuda_ext.loaded_cpu_passes("engine_gossip_mix_") is module
        True
    """
    return _loader.load("cpu")


def loaded_cpu_passes(*names: str):
    """The compiled module that serves CPU tensors when one is loaded in this process and
    has every pass in ``names``, else None (a module built before those passes existed,
    say at install time). Never builds: this is the callers' check on the hot path."""
    module = _loader.loaded_module("cpu")
    if module is None or not all(hasattr(module, name) for name in names):
        return None
    return module


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
