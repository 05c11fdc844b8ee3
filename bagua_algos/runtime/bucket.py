"""Tensors grouped into buckets; a flattened bucket owns one buffer for the parameters
and one for their gradients, and each parameter (and gradient) is a view into them.

With flattening, a collective or a send runs on ``bucket.flat_params()`` /
``bucket.flat_grads()`` directly: they *are* the parameters, no copy in or out. Without
it, those methods pack a copy and ``set_params_from_flat`` / ``set_grads_from_flat``
unpack it, so an algorithm is written once for both cases.
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["BaguaTensor", "BaguaBucket", "split_into_buckets", "DEFAULT_BUCKET_SIZE"]

DEFAULT_BUCKET_SIZE = 10 * 1024 * 1024  # bytes, as Bagua's default
FIRST_BUCKET_SIZE = 1024 * 1024  # a small first bucket starts communication early (as DDP)


class BaguaTensor:
    """A named parameter taking part in communication."""

    __slots__ = ("name", "param", "grad_view")

    def __init__(self, name: str, param: torch.nn.Parameter):
        self.name = name
        self.param = param
        self.grad_view: torch.Tensor | None = None

    @property
    def numel(self) -> int:
        return self.param.numel()

    @property
    def nbytes(self) -> int:
        return self.param.numel() * self.param.element_size()

    def __repr__(self) -> str:
        return f"BaguaTensor({self.name!r}, shape={tuple(self.param.shape)})"


class BaguaBucket:
    """Tensors communicated together, with the operations run once all are ready."""

    def __init__(self, tensors: list[BaguaTensor], name: str, flatten: bool = True):
        if not tensors:
            raise ValueError("a bucket needs at least one tensor")
        first = tensors[0].param
        for t in tensors:
            if t.param.dtype != first.dtype or t.param.device != first.device:
                raise ValueError(
                    f"bucket {name!r}: all tensors must share dtype and device; {t.name} is "
                    f"{t.param.dtype} on {t.param.device}, {tensors[0].name} is {first.dtype} on {first.device}"
                )
        self.tensors = tensors
        self.name = name
        self.dtype = first.dtype
        self.device = first.device
        self.numel = sum(t.numel for t in tensors)
        self.flattened = flatten
        self.param_buffer: torch.Tensor | None = None
        self.grad_buffer: torch.Tensor | None = None
        self._ops: list[Callable[["BaguaBucket"], object]] = []
        self._ready = [False] * len(tensors)
        self._ready_count = 0
        if flatten:
            self._flatten()

    # --- flattening -----------------------------------------------------------------
    def _flatten(self) -> None:
        params = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        grads = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
        offset = 0
        with torch.no_grad():
            for t in self.tensors:
                p, n = t.param, t.numel
                params[offset:offset + n].copy_(p.data.reshape(-1))
                if p.grad is not None:
                    grads[offset:offset + n].copy_(p.grad.reshape(-1))
                p.data = params[offset:offset + n].view_as(p)
                t.grad_view = grads[offset:offset + n].view_as(p)
                offset += n
        self.param_buffer, self.grad_buffer = params, grads
        for t in self.tensors:
            if t.param.grad is not None:
                t.param.grad = t.grad_view

    def attach_grads(self) -> None:
        """Make every ``param.grad`` the bucket's view again.

        A gradient set to ``None`` (``zero_grad(set_to_none=True)``) is zero, so its view
        is zeroed and attached; autograd then accumulates into the view in place. A
        gradient replaced by another tensor is copied into its view.
        """
        if not self.flattened:
            return
        with torch.no_grad():
            for t in self.tensors:
                p, view = t.param, t.grad_view
                if p.grad is view:
                    continue
                if p.grad is None:
                    view.zero_()
                else:
                    view.copy_(p.grad)
                p.grad = view

    def check_views(self) -> bool:
        """True if every parameter and gradient is still a view into the buffers."""
        if not self.flattened:
            return False
        base_p, base_g = self.param_buffer.data_ptr(), self.grad_buffer.data_ptr()
        item = self.param_buffer.element_size()
        offset = 0
        for t in self.tensors:
            p = t.param
            if p.data.data_ptr() != base_p + offset * item:
                return False
            if p.grad is not None and p.grad.data_ptr() != base_g + offset * item:
                return False
            offset += t.numel
        return True

    # --- flat access for algorithms ---------------------------------------------------
    def flat_params(self) -> torch.Tensor:
        """All parameters as one 1-D tensor: the buffer itself when flattened, else a copy."""
        if self.flattened:
            return self.param_buffer
        return torch.cat([t.param.data.reshape(-1) for t in self.tensors])

    def set_params_from_flat(self, flat: torch.Tensor) -> None:
        """Parameters ← ``flat`` (a no-op when ``flat`` is the buffer)."""
        if self.flattened and flat.data_ptr() == self.param_buffer.data_ptr():
            return
        with torch.no_grad():
            for t, chunk in self._chunks(flat):
                t.param.data.copy_(chunk)

    def flat_grads(self) -> torch.Tensor:
        """All gradients as one 1-D tensor (missing gradients count as zero)."""
        if self.flattened:
            self.attach_grads()
            return self.grad_buffer
        return torch.cat([
            (t.param.grad if t.param.grad is not None else torch.zeros_like(t.param)).reshape(-1)
            for t in self.tensors
        ])

    def set_grads_from_flat(self, flat: torch.Tensor) -> None:
        if self.flattened and flat.data_ptr() == self.grad_buffer.data_ptr():
            return
        with torch.no_grad():
            for t, chunk in self._chunks(flat):
                if t.param.grad is None:
                    t.param.grad = chunk.clone()
                else:
                    t.param.grad.copy_(chunk)

    def _chunks(self, flat: torch.Tensor):
        """Each tensor with its slice of ``flat``, shaped like it."""
        offset = 0
        for t in self.tensors:
            yield t, flat[offset:offset + t.numel].view_as(t.param)
            offset += t.numel

    # --- operations and readiness ---------------------------------------------------------
    def append_op(self, op: Callable[["BaguaBucket"], object]) -> "BaguaBucket":
        """Run ``op(bucket)`` when all tensors are ready; it may return a handle to wait on."""
        self._ops.append(op)
        return self

    def clear_ops(self) -> "BaguaBucket":
        self._ops.clear()
        return self

    @property
    def ops(self) -> tuple:
        return tuple(self._ops)

    def mark_ready(self, index: int) -> bool:
        """Mark tensor ``index`` ready; True when the whole bucket is ready."""
        if not self._ready[index]:
            self._ready[index] = True
            self._ready_count += 1
        return self._ready_count == len(self.tensors)

    @property
    def is_ready(self) -> bool:
        return self._ready_count == len(self.tensors)

    def reset_ready(self) -> None:
        self._ready = [False] * len(self.tensors)
        self._ready_count = 0

    def run_ops(self) -> list:
        handles = []
        for op in self._ops:
            handle = op(self)
            if handle is not None:
                handles.append(handle)
        return handles

    def __repr__(self) -> str:
        return f"BaguaBucket({self.name!r}, tensors={len(self.tensors)}, numel={self.numel}, flattened={self.flattened})"


def split_into_buckets(
    tensors: list[BaguaTensor],
    do_flatten: bool = True,
    bucket_size: int = DEFAULT_BUCKET_SIZE,
    first_bucket_size: int = FIRST_BUCKET_SIZE,
) -> list[BaguaBucket]:
    """Consecutive runs of ``tensors``: a bucket closes once it holds ``bucket_size``
    bytes (the first one at ``first_bucket_size``, so communication starts early in
    backward, as in torch DDP); a dtype or device change starts a new bucket."""
    if bucket_size <= 0:
        raise ValueError(f"bucket_size must be a positive number of bytes, got {bucket_size}")
    groups: list[list[BaguaTensor]] = []
    size = 0
    closed = True
    for t in tensors:
        current = groups[-1] if groups else None
        if closed or t.param.dtype != current[0].param.dtype or t.param.device != current[0].param.device:
            groups.append([t])
            size = t.nbytes
        else:
            current.append(t)
            size += t.nbytes
        cap = min(first_bucket_size, bucket_size) if len(groups) == 1 else bucket_size
        closed = size >= cap
    return [BaguaBucket(g, name=f"bucket_{i}", flatten=do_flatten) for i, g in enumerate(groups)]
