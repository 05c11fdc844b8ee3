"""Host copies of CUDA tensors for gloo, which cannot read device memory."""

from __future__ import annotations

import torch

from .groups import BaguaCommunicator
from .handle import CommHandle


class _Staging:
    """Host copies of the CUDA tensors of one gloo call.

    gloo's point-to-point and most of its collectives cannot read device memory (handed
    a CUDA pointer, its socket writes abort the process), so a CUDA tensor that does not
    travel over NCCL is copied to host memory before the call and, if the call writes
    it, copied back when the handle completes, before any other finisher runs. Tensors
    on NCCL or on the CPU are used as they are (no copy). ``force`` stages every CUDA
    tensor (a call that mixes devices is posted on gloo alone)."""

    def __init__(self, c: BaguaCommunicator, force: bool = False):
        self._c = c
        self._force = force
        self._copy_back = []

    def needs_host(self, t: torch.Tensor) -> bool:
        """Whether ``t`` must go through host memory for this call."""
        return t.is_cuda and (self._force or not self._c.uses_nccl(t))

    def __call__(self, t: torch.Tensor, *, read: bool = True, write: bool = False) -> torch.Tensor:
        """``t`` itself, or its host copy (holding ``t``'s values if ``read``; copied
        back into ``t`` on completion if ``write``)."""
        if not self.needs_host(t):
            return t
        host = t.detach().to("cpu", copy=True) if read else torch.empty(t.shape, dtype=t.dtype)
        if write:
            self._copy_back.append(lambda: t.copy_(host))
        return host

    def handle(self, works, finishers=()) -> CommHandle:
        return CommHandle(works, self._copy_back + list(finishers))
