"""Row gathers of the stacked state as a few strided slices, prepared as calls.

The engine's neighbour allreduce (:class:`~.gossip.StackedMix`), relay's
messages on the engine and the stacked neighbour exchange combine rows of ``[rows, L]``
matrices by index: ``out[r] += src[index[r]]``. ``index_select`` then ``add_`` costs two passes over the
rows and a buffer; but the indices of the usual topologies are made of arithmetic runs
(a ring's neighbour of i is i + 1 mod n: two runs; a chain's relayed message comes from
the previous edge of its direction), and a run ``out[r0::s] += src[i0::t]`` is one pass
over views, with no buffer. :class:`RowGather` splits an index into such runs, and falls
back to ``index_select`` into a reused buffer when it has too many (an irregular graph).

Both ways compute the same sums, term by term, so a form's rounding does not depend on
which way ran. A row whose index is ``None`` takes nothing (its term is an exact zero
in the per-rank code).

The ``*_calls`` methods return the passes as ``(function, args)`` pairs on given
tensors, so that a form prepares its step once (the views, the weights in the right
dtype) and a step is one Python call per pass (:func:`run_calls`).

Not done, because it measured slower: running all of a step's passes column block by
column block so that each block stays in cache (measured on the engine's 64-worker step). On this
CPU a pass over a block in L2 was no faster than over the whole matrix, and the calls
per block cost more than the cache saved, at every block size tried. A compiled sweep
pays no call per block: where cuda_ext's CPU module is loaded, the gossip mix is one
(:func:`engine_cpu_passes`, csrc/engine_cpu.cpp).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Optional, Sequence

import torch

__all__ = ["RowGather", "arithmetic_runs", "engine_cpu_passes", "run_calls", "torch_passes_only"]

MAX_RUNS = 8
"""More runs than this and one ``index_select`` is cheaper than the slices' launches."""


_torch_passes_only = False


@contextlib.contextmanager
def torch_passes_only():
    """Within this block the gossip mix takes the torch passes even where cuda_ext's CPU
    module is loaded (for comparisons: the benchmark's baseline, the tests)."""
    global _torch_passes_only
    before, _torch_passes_only = _torch_passes_only, True
    try:
        yield
    finally:
        _torch_passes_only = before


def engine_cpu_passes(x: torch.Tensor):
    """cuda_ext's compiled CPU module, when it is loaded in this process
    (``cuda_ext.load_cpu_passes()``) and ``x`` is a float32 or float64 CPU tensor: its
    ``engine_gossip_mix_`` does a gossip mix in one sweep, in place, where the row
    gathers take a pass a term (csrc/engine_cpu.cpp; the same terms in the same order,
    rounded alike). Else None. Never builds it (a first build takes about a minute)."""
    if _torch_passes_only or x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64):
        return None
    try:
        import cuda_ext  # a top-level package of this project
    except ImportError:
        return None
    return cuda_ext.loaded_cpu_passes("engine_gossip_mix_")


def run_calls(calls: Sequence[tuple]) -> None:
    """Run prepared ``(function, args)`` pairs in order."""
    for function, args in calls:
        function(*args)


def arithmetic_runs(index: Sequence, lookahead: int = 8) -> list:
    """``index`` as runs ``(r0, s, i0, t, m)``: rows ``r0 + k·s`` take source rows
    ``i0 + k·t`` for k < m (s, t ≥ 1; m = 1 for a single row); rows whose index is None
    take nothing. Greedy: the first row not yet taken starts a run, paired with whichever
    of the next ``lookahead`` free rows makes the longest one (so a chain's messages,
    whose directions alternate row by row, make two runs of step 2, not pairs).

    An entry may be a tuple of source rows (one per source read together); ``i0`` and
    ``t`` are then tuples, every component stepping with the run (each t ≥ 1)."""
    scalar = all(i is None or not isinstance(i, tuple) for i in index)
    free = {r: (i if isinstance(i, tuple) else (i,)) for r, i in enumerate(index) if i is not None}
    runs = []
    while free:
        r0 = min(free)
        i0 = free.pop(r0)
        best = (1, 1, (1,) * len(i0))  # (m, s, t)
        for r1 in sorted(r for r in free if r > r0)[:lookahead]:
            s, t = r1 - r0, tuple(b - a for a, b in zip(i0, free[r1]))
            if min(t) < 1:
                continue
            m = 2
            while free.get(r0 + m * s) == tuple(a + m * u for a, u in zip(i0, t)):
                m += 1
            if m > best[0]:
                best = (m, s, t)
        m, s, t = best
        for k in range(1, m):
            del free[r0 + k * s]
        runs.append((r0, s, i0[0], t[0], m) if scalar else (r0, s, i0, t, m))
    return runs


def _view(x: torch.Tensor, start: int, step: int, count: int) -> torch.Tensor:
    return x[start:start + (count - 1) * step + 1:step]


def _gather_add(out, src, index, buffer, absent, weight):
    gathered = torch.index_select(src, 0, index, out=buffer)
    if absent is not None:
        gathered.masked_fill_(absent, 0)
    if weight is None:
        out.add_(gathered)
    else:
        out.addcmul_(gathered, weight)


def _gather_copy(out, src, rows, sources):
    out.index_copy_(0, rows, torch.index_select(src, 0, sources))


def _gather_sum(out, a, b, rows, a_sources, b_sources):
    out.index_copy_(0, rows, torch.add(torch.index_select(a, 0, a_sources), torch.index_select(b, 0, b_sources)))


class RowGather:
    """``out[r] (op)= src[index[r]]`` for every row r whose index is not None.

    ``weight`` (optional, ``[rows, 1]``) multiplies each gathered row: ``out[r] +=
    w[r]·src[index[r]]``. The ``*_calls`` methods return the passes as ``(function,
    args)`` pairs on the given tensors, for :func:`run_calls`; ``add_`` and ``copy_``
    run them at once.

    An index of pairs ``(a_row, b_row)`` serves :meth:`sum_calls` alone: ``out[r] =
    a[a_row] + b[b_row]`` (two sources read at rows of their own)."""

    def __init__(self, index: Sequence, device):
        self.rows = len(index)
        self.pairs = any(isinstance(i, tuple) for i in index)
        if self.pairs and not all(i is None or (isinstance(i, tuple) and len(i) == 2) for i in index):
            raise ValueError("an index of pairs must hold (a_row, b_row) pairs or None only")
        runs = arithmetic_runs(index)
        self.runs = runs if len(runs) <= MAX_RUNS else None
        if self.runs is None:
            present = [r for r, i in enumerate(index) if i is not None]
            self.present_rows = torch.tensor(present, dtype=torch.long, device=device)
            sources = [index[r] if self.pairs else (index[r], index[r]) for r in present]
            self.present_sources = tuple(torch.tensor([pair[k] for pair in sources], dtype=torch.long, device=device)
                                         for k in range(2))
            if not self.pairs:
                # a row with no index gathers row 0, then is zeroed: the term is an exact zero
                self.index = torch.tensor([0 if i is None else i for i in index], dtype=torch.long, device=device)
                absent = torch.tensor([i is None for i in index], device=device).unsqueeze(1)
                self.absent = absent if bool(absent.any()) else None
        self._buffer = None

    def _single(self, what: str) -> None:
        if self.pairs:
            raise ValueError(f"{what} takes an index of rows, not of pairs (pairs serve sum_calls)")

    def _buffer_for(self, src: torch.Tensor) -> torch.Tensor:
        """A contiguous ``[rows, width]`` scratch for the fallback's gather (one storage,
        grown to the widest source it has gathered from)."""
        width = src.shape[1]
        size = self.rows * width
        if self._buffer is None or self._buffer.numel() < size or self._buffer.dtype != src.dtype \
                or self._buffer.device != src.device:
            self._buffer = torch.empty(size, dtype=src.dtype, device=src.device)
        return self._buffer[:size].view(self.rows, width)

    def add_calls(self, out: torch.Tensor, src: torch.Tensor, weight: Optional[torch.Tensor] = None) -> list:
        """``out[r] += src[index[r]]`` (times ``weight[r]`` if given)."""
        self._single("add_calls")
        if self.runs is None:
            return [(_gather_add, (out, src, self.index, self._buffer_for(src), self.absent, weight))]
        calls = []
        for r0, s, i0, t, m in self.runs:
            target, source = _view(out, r0, s, m), _view(src, i0, t, m)
            if weight is None:
                calls.append((torch.Tensor.add_, (target, source)))
            else:
                calls.append((torch.Tensor.addcmul_, (target, source, _view(weight, r0, s, m))))
        return calls

    def copy_calls(self, out: torch.Tensor, src: torch.Tensor) -> list:
        """``out[r] = src[index[r]]``; rows with no index are left as they are."""
        self._single("copy_calls")
        if self.runs is None:
            return [(_gather_copy, (out, src, self.present_rows, self.present_sources[0]))]
        return [(torch.Tensor.copy_, (_view(out, r0, s, m), _view(src, i0, t, m))) for r0, s, i0, t, m in self.runs]

    def sum_calls(self, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> list:
        """``out[r] = a[index[r]] + b[index[r]]`` (one add a row, as ``torch.add``), or for
        an index of pairs ``out[r] = a[index[r][0]] + b[index[r][1]]``; rows with no index
        are left as they are."""
        if self.runs is None:
            return [(_gather_sum, (out, a, b, self.present_rows, *self.present_sources))]
        calls = []
        for r0, s, i0, t, m in self.runs:
            (ia, ib), (ta, tb) = (i0, t) if self.pairs else ((i0, i0), (t, t))
            calls.append((functools.partial(torch.add, out=_view(out, r0, s, m)),
                          (_view(a, ia, ta, m), _view(b, ib, tb, m))))
        return calls

    def add_(self, out: torch.Tensor, src: torch.Tensor, weight: Optional[torch.Tensor] = None) -> torch.Tensor:
        run_calls(self.add_calls(out, src, weight))
        return out

    def copy_(self, out: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        run_calls(self.copy_calls(out, src))
        return out
