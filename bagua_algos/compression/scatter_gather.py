"""Bagua's compressed scatter-gather: a reduction over n workers through the min-max
codec (:mod:`.minmax`), and the mark protocol by which every worker of a collective
learns that one of them could not encode. Pure tensor math, the collectives passed
in (as :func:`.allgather.compress_aggregate` takes its allgather): the runtime binds
them to a process group (``bagua_algos.runtime.ops.compressed_scatter_gather``).
"""

from __future__ import annotations

from typing import Callable, Sequence, Union

import torch

from . import minmax

__all__ = ["scatter_gather", "encode_rows", "reduce_chunks", "raise_if_marked"]

# a Sequence of global ranks, or a function returning it (called only to word an error)
Ranks = Union[Sequence[int], Callable[[], Sequence[int]]]


def scatter_gather(
    flat: torch.Tensor,
    bits: int,
    average: bool,
    *,
    n: int,
    alltoall: Callable[[torch.Tensor, torch.Tensor], object],
    allgather: Callable[[torch.Tensor, torch.Tensor], object],
    ranks: Ranks,
    stochastic: bool = False,
    generator=None,
) -> torch.Tensor:
    """Reduce ``flat`` over the ``n`` members of a group in place through the min-max
    codec, returning the decoded values of what this worker sent in the first stage,
    D(Q(c_j)) (for error feedback), shaped as ``flat``.

    With ``flat`` padded with zeros to n equal chunks c_0 .. c_{n-1}:

    1. each worker encodes every chunk (one header each): Q(c_j), j = 0 .. n-1;
    2. all-to-all: worker k receives Q(c_k) of every worker i;
    3. worker k decodes them and reduces its chunk: r_k = Σ_i D(Q(c_k^i)) (/ n with
       ``average``, :func:`reduce_chunks`), then encodes it again: Q(r_k);
    4. all-gather of the Q(r_k); every worker decodes all n chunks into ``flat``.

    Each value is quantized twice, so with nearest rounding the result differs from
    the exact reduction by at most mean_i(gap_i)/2 + gap_r/2 per chunk (the gaps of
    the first encodings and of the reduced chunk's; sums: n times the first term);
    with stochastic rounding by at most one gap each, and it is unbiased.

    Written once for a leading worker dimension W: ``flat`` is ``[W, m]``, a row per
    worker (W = 1 in a job; on the one-process engine the n rows, the collectives then
    the engine's transport's row moves), or a lone worker's 1-D ``[m]``; every stage
    is one batched codec call over the W·n chunks. ``generator``: the stochastic
    rounding's generators, a sequence of one per row (a lone torch.Generator for W = 1;
    worker i draws from its own what its process draws, in its order: its n chunks,
    then the chunk it reduced).

    ``alltoall(send, recv)`` and ``allgather(send, recv)`` are the group's collectives
    on uint8 buffers; ``ranks`` the group's global ranks, which name the workers whose
    values were not finite (:func:`raise_if_marked`).
    """
    x = flat.detach().reshape(flat.shape[0] if flat.dim() > 1 else 1, -1)  # [W, m]
    width, numel = x.shape
    generators = None
    if stochastic:
        generators = list(generator) if isinstance(generator, (list, tuple)) else [generator]
        if len(generators) != width or any(g is None for g in generators):
            raise ValueError(f"stochastic rounding needs one generator per worker ({width}), got {generator!r}")
    chunk = -(-numel // n) if numel else 0
    padded = x
    if chunk * n != numel:
        padded = torch.cat([x, x.new_zeros(width, chunk * n - numel)], dim=1)
    # NaN/inf anywhere: every chunk is the mark, so every receiver sees it (see below).
    sent = encode_rows(padded.reshape(width, n, chunk), bits, generators)  # worker i's chunk j: row i·n + j
    received = torch.empty_like(sent)
    alltoall(sent.view(width, -1), received.view(width, -1))
    # which senders' values were not finite: read from the marks; but a batched encode of
    # several workers' rows marks every row for one bad row, and those rows are then every
    # sender's (the one-process engine's), so they are named from the values
    senders = (~torch.isfinite(x).all(dim=1)) if width > 1 else minmax.marked(received, n)
    # a marked chunk decodes to NaN, so the reduced chunk is marked in turn
    mine = reduce_chunks(minmax.decode_chunks(received, width * n, bits=bits, numel=chunk).view(width, n, chunk),
                         average)
    # the sum may overflow: then the reduced chunk is marked too
    own = encode_rows(mine.unsqueeze(1), bits, generators)
    gathered = own.new_empty(own.numel() // width * n)  # the same on every worker
    allgather(own.view(width, -1), gathered)
    result = minmax.decode_chunks(gathered, n, bits=bits, numel=chunk).reshape(-1)[:numel]
    raise_if_marked([(senders, "the bucket's values"), (minmax.marked(gathered, n), "the reduced chunk")], ranks)
    with torch.no_grad():
        flat.copy_(result.view(1, -1).expand(width, -1).reshape(flat.shape))
    sent_values = minmax.decode_chunks(sent, width * n, bits=bits, numel=chunk).view(width, n * chunk)[:, :numel]
    return sent_values.reshape(flat.shape)


def encode_rows(rows: torch.Tensor, bits: int, generators) -> torch.Tensor:
    """The encodings of ``rows`` (``[W, k, chunk]``: worker w's k chunks), one header a
    chunk, concatenated worker by worker; NaN/inf rows marked. Nearest rounding
    (``generators`` None): one batched call. Stochastic: worker w draws from
    ``generators[w]`` what one ``encode_chunks`` of its ``[k, chunk]`` would (on the CPU
    the uniforms drawn first, worker by worker, then one batched call; elsewhere one
    call per worker, as the Triton kernels draw their own)."""
    width, k, chunk = rows.shape
    flat_rows = rows.reshape(width * k, chunk)
    if generators is None:
        return minmax.encode_chunks(flat_rows, bits, non_finite="mark")
    if width == 1:
        return minmax.encode_chunks(flat_rows, bits, stochastic=True, generator=generators[0], non_finite="mark")
    if rows.device.type == "cpu":
        uniforms = _uniforms(generators, (k, chunk), rows.device).view(width * k, chunk)
        return minmax.encode_chunks(flat_rows, bits, stochastic=True, non_finite="mark", uniforms=uniforms)
    return torch.cat([minmax.encode_chunks(rows[w], bits, stochastic=True, generator=generators[w], non_finite="mark")
                      for w in range(width)])


def reduce_chunks(decoded: torch.Tensor, average: bool) -> torch.Tensor:
    """The reduction step of the compressed scatter-gather: ``decoded[..., i, :]`` is
    the chunk sender i sent; returns Σ_i of them (÷ the number of senders with
    ``average``), a new tensor (``[W, n, chunk]`` → ``[W, chunk]``)."""
    total = decoded.sum(dim=-2)
    if average:
        total.div_(decoded.shape[-2])
    return total


def _uniforms(generators, shape: tuple, device) -> torch.Tensor:
    """``[len(generators), *shape]`` float32: row i drawn from ``generators[i]``, as one
    ``torch.rand(shape, generator=generators[i])`` (what the codec would draw for an
    encode of that shape)."""
    out = torch.empty((len(generators), *shape), dtype=torch.float32, device=device)
    for row, generator in zip(out, generators):
        torch.rand(shape, generator=generator, dtype=torch.float32, device=device, out=row)
    return out


# A worker whose values are not finite cannot encode them, and raising alone would leave
# its peers waiting in the collective until the timeout. It sends the codec's mark
# instead (``non_finite="mark"``: every chunk's bit width byte 0); every receiver then
# raises, after the same collectives. The encodes and decodes never wait for the device:
# the marks are read back once per op, after its last collective, where every worker
# holds the same marks (the all-to-all delivers each sender's, the all-gather each
# reducer's, a gossip step each neighbour's and the own) and so raises together.
def raise_if_marked(checks, ranks: Ranks) -> None:
    """``checks``: (marks, what) pairs, ``marks`` a bool tensor with one entry per sender
    (``ranks[i]`` its global rank; ``ranks`` may be a function returning them, called
    only when one is marked); raise for the first pair with a marked sender. The op's
    one host synchronisation."""
    flags = torch.cat([marks for marks, _ in checks]).tolist()
    offset = 0
    for marks, what in checks:
        marked = [i for i, flag in enumerate(flags[offset : offset + marks.numel()]) if flag]
        offset += marks.numel()
        if marked:
            known = ranks() if callable(ranks) else ranks
            raise ValueError(
                f"{what} of rank(s) {sorted({known[i] for i in marked})} has NaN/inf values, which the min-max codec "
                "cannot encode; every worker of the collective stops here (look for a diverging loss or a "
                "learning rate that is too high)"
            )
