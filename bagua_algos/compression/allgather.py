"""The step shared by the compressors aggregated with an allgather (Top K, Sign+Norm,
Signum, Spectral Atomo; seed 001 Appendix G): pure tensor math, the allgather passed in.

These compressors are not linear (a top-K selection, a sign, a sampled SVD of a sum is
not the sum of theirs), so the workers' messages cannot be summed on the way as an
allreduce sums; every worker receives every message and decodes and combines them
itself (seed 001 §3, "Gather"). One step of a bucket, for worker w (seed 001
Algorithm 2, lines 7–11, with the error buffer optional):

1. a_w: the worker's contribution (the caller forms it: g_w + e_w with error feedback,
   Signum's momentum, or g_w);
2. c_w = C(a_w), a byte message of a length fixed by the bucket's layout;
3. with error feedback e_w ← a_w − D(c_w), what this worker's message lost;
4. c_1 … c_W ← allgather(c_w);
5. the update is AGG(c_1 … c_W) (an average of the decoded messages, or Signum's vote).

A codec works on a leading worker dimension: ``encode`` takes ``[W, N]`` contributions
and returns ``[W, B]`` uint8 messages, row by row (row w's bytes depend on row w only),
``decode`` turns ``[W, B]`` messages back into each sender's ``[W, N]`` approximation and
``aggregate`` combines ``[W, B]`` messages into the ``[N]`` update. A process calls them
with W = 1 for its own message and with the allgather's ``[W, B]``; on the one-process
engine the same op calls them with every worker's rows at once (the stacked allgather
returns the rows themselves); the same bytes go into the same ``aggregate``.

The bytes a worker sends are its message's, ``codec.message_bytes`` (what it hands to
the allgather, as PowerSGD counts what it hands to its allreduces).
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol, Sequence

import torch

from ..arguments import check_int

__all__ = ["AllgatherCodec", "compress_aggregate", "as_bytes", "from_bytes",
           "check_numels"]


class AllgatherCodec(Protocol):
    message_bytes: int  # B, the length of one worker's message

    def encode(self, contributions: torch.Tensor, generators=None) -> torch.Tensor: ...

    def decode(self, messages: torch.Tensor) -> torch.Tensor: ...

    def aggregate(self, messages: torch.Tensor) -> torch.Tensor: ...


def check_numels(numels: Sequence[int]) -> tuple:
    """A bucket's tensor sizes, each an int >= 1, at least one."""
    numels = tuple(check_int("numels[i]", n, 1, what="a tensor size >= 1") for n in numels)
    if not numels:
        raise ValueError("numels must name at least one tensor")
    return numels


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``[W, k]`` values as ``[W, k·itemsize]`` uint8 (their bytes, no conversion)."""
    return t.contiguous().view(torch.uint8).reshape(t.shape[0], -1)


def from_bytes(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of :func:`as_bytes`: ``[W, k·itemsize]`` uint8 read as ``[W, k]`` of ``dtype``
    (copied first: a slice of a message need not start at a multiple of the itemsize)."""
    return b.clone(memory_format=torch.contiguous_format).view(dtype).reshape(b.shape[0], -1)


def compress_aggregate(codec: AllgatherCodec, contribution: torch.Tensor,
                       allgather: Callable[[torch.Tensor], torch.Tensor],
                       error: Optional[torch.Tensor] = None, generator=None) -> tuple[torch.Tensor, int]:
    """The workers' step (the module's steps 2–5) on their flat contributions.

    ``contribution``: one worker's ``[N]`` (a job), or W workers' ``[W, N]`` (the
    one-process engine, a row each). ``allgather(messages)`` takes the ``[W, B]`` uint8
    messages and returns every worker's, ``[n, B]`` in rank order. ``error`` (shaped as
    ``contribution``, optional) is overwritten with contribution − D(own message).
    ``generator``: a worker's random stream (a sequence of one per row for ``[W, N]``),
    for a codec that samples (Atomo). Returns the update ``[N]`` (the same for every
    worker, in the contribution's dtype) and the bytes a worker sent."""
    rows = contribution.unsqueeze(0) if contribution.dim() == 1 else contribution
    generators = None if generator is None else (list(generator) if contribution.dim() == 2 else [generator])
    message = codec.encode(rows, generators)
    if error is not None:
        error.copy_((rows - codec.decode(message)).view(error.shape))
    messages = allgather(message)
    return codec.aggregate(messages).to(contribution.dtype), message.shape[-1]
