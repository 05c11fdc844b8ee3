"""Chunk-wise Top-k messages: DeMo's (a DCT per chunk, the k largest coefficients) and
SparseLoCo's (the k largest entries per chunk, quantized). Pure tensor math; the
allgather step is :mod:`bagua_algos.compression.allgather`'s.

**Chunks** (:class:`ChunkLayout`), as DeMo's demo.py (``TransformDCT``) and SparseLoCo's
reference code (``ChunkingTransform``) cut a parameter: each dimension of size s is cut
into pieces of ``chunk_side(s, chunk)`` values, the largest divisor of s that is at most
``chunk`` (their ``_get_smaller_split``; a prime s above ``chunk`` gives pieces of one
value). A matrix (rows × cols) becomes blocks of h × w = chunk_side(rows) ×
chunk_side(cols), block (y, x) holding rows y·h … y·h + h − 1 and columns x·w … x·w + w − 1,
flattened row by row into a chunk of h·w values; a vector becomes consecutive chunks of
s values. Where the references stop (demo.py's rearrange takes one or two dimensions), a
tensor of three or more dimensions is cut as the matrix shape[0] × (the rest), and a
scalar as a vector of one.

**DCT** (DeMo): each block is transformed by the orthonormal DCT-II along each of its
dimensions, C = D_h B D_wᵀ (a vector chunk: c = D_s b), and transformed back by the
transposes; demo.py builds the same matrices (its ``_dct(I, norm="ortho")``).

A bucket of tensors (a worker's ``[N]`` or the engine's ``[W, N]``, in bucket order)
sends, for each tensor t, k_t entries of each of its chunks: their values, and their
positions inside the chunk (int16 while a chunk has at most 2^15 values, else int32:
the references send torch.topk's int64; the same information in a quarter of the
bytes).

- :class:`DCTTopKCodec` (DeMo): the k largest DCT coefficients per chunk by magnitude,
  float values. ``aggregate`` is demo.py's: each coefficient is the mean of the values
  the senders that chose it sent (its ``scatter_reduce_(..., "mean", include_self=False)``
  over the gathered messages), the inverse DCT of that, and its sign.
- :class:`QuantizedTopKCodec` (SparseLoCo): the k largest entries per chunk, k_t =
  round(density · chunk length) (at least 1; the reference's round(len·top_k/chunk²)),
  their values quantized per tensor by the reference's statistical quantizer
  (:func:`quantize_values`) to ``bits`` bits, packed as min-max's payload
  (:func:`bagua_algos.compression.minmax.pack_levels`), with each tensor's shift and
  level table (1 + 2^bits float32). ``aggregate`` is the paper's (1/R) Σ_r of the
  senders' sparse values.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from ..arguments import check_choice, check_int, check_real
from . import minmax
from .allgather import as_bytes, from_bytes

__all__ = ["chunk_side", "dct_matrix", "ChunkLayout", "quantize_values", "dequantize_values", "DCTTopKCodec",
           "QuantizedTopKCodec"]

INT16_LIMIT = 2**15 - 1


def chunk_side(n: int, target: int) -> int:
    """The largest divisor of ``n`` that is at most ``target`` (demo.py's
    ``_get_smaller_split(n, target)`` for ``target`` >= 1)."""
    n = check_int("n", n, 1, what="a dimension size >= 1")
    target = check_int("target", target, 1, what="a chunk size >= 1")
    for d in range(min(n, target), 0, -1):
        if n % d == 0:
            return d
    return 1


_DCT: dict = {}


def dct_matrix(n: int, dtype: torch.dtype = torch.float32, device="cpu") -> torch.Tensor:
    """The orthonormal DCT-II matrix D (n × n): D[k, j] = a_k cos(π (2j + 1) k / (2n)),
    a_0 = √(1/n), a_k = √(2/n); computed in float64, then cast (cached)."""
    key = (n, dtype, str(device))
    if key not in _DCT:
        k = torch.arange(n, dtype=torch.float64)[:, None]
        j = torch.arange(n, dtype=torch.float64)[None, :]
        d = torch.cos(math.pi * (2 * j + 1) * k / (2 * n)) * math.sqrt(2.0 / n)
        d[0] = math.sqrt(1.0 / n)
        _DCT[key] = d.to(dtype=dtype, device=device)
    return _DCT[key]


class _Piece:
    """One tensor of a bucket, cut into chunks."""

    def __init__(self, shape, offset: int, chunk: int):
        self.shape = tuple(shape)
        self.numel = math.prod(self.shape)
        if self.numel < 1:
            raise ValueError(f"a tensor of shape {self.shape} has no values to cut into chunks")
        self.offset = offset
        if len(self.shape) >= 2:
            rows, cols = self.shape[0], self.numel // self.shape[0]
            self.h, self.w = chunk_side(rows, chunk), chunk_side(cols, chunk)
            self.blocks = (rows // self.h, cols // self.w)
            self.length = self.h * self.w
            self.cols = cols
        else:
            self.h, self.w = None, chunk_side(self.numel, chunk)
            self.blocks = (self.numel // self.w,)
            self.length = self.w
        self.count = math.prod(self.blocks)

    @property
    def matrix(self) -> bool:
        return self.h is not None

    def flat_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """``positions`` (``[..., count, k]`` places inside each chunk) as places in the
        tensor's flat values (row-major)."""
        chunk_ids = torch.arange(self.count, device=positions.device)[:, None]
        if not self.matrix:
            return chunk_ids * self.length + positions
        y, x = chunk_ids // self.blocks[1], chunk_ids % self.blocks[1]
        row, col = positions // self.w, positions % self.w
        return (y * self.h + row) * self.cols + x * self.w + col


class ChunkLayout:
    """The tensors of a bucket (``shapes``, in bucket order, one worker's) cut into chunks
    of at most ``chunk`` values a side (the module's notes)."""

    def __init__(self, shapes: Sequence, chunk: int):
        self.chunk = check_int("chunk", chunk, 1, what="a chunk side >= 1")
        self.pieces, offset = [], 0
        for shape in shapes:
            piece = _Piece(shape, offset, self.chunk)
            self.pieces.append(piece)
            offset += piece.numel
        if not self.pieces:
            raise ValueError("a chunk layout needs at least one tensor")
        self.numel = offset
        self.max_length = max(p.length for p in self.pieces)

    def _blocks(self, piece: _Piece, values: torch.Tensor) -> torch.Tensor:
        """A tensor's ``[W, numel]`` values as its blocks: ``[W, Y, X, h, w]`` or ``[W, C, s]``."""
        w = values.shape[0]
        if piece.matrix:
            return values.reshape(w, piece.blocks[0], piece.h, piece.blocks[1], piece.w).permute(0, 1, 3, 2, 4)
        return values.reshape(w, piece.count, piece.w)

    def split(self, rows: torch.Tensor, dct: bool = False) -> list:
        """``rows`` (``[W, N]``, the bucket's values) as one ``[W, count, length]`` tensor of
        chunks per tensor; with ``dct``, of each chunk's DCT coefficients."""
        out = []
        for piece in self.pieces:
            blocks = self._blocks(piece, rows[:, piece.offset:piece.offset + piece.numel])
            if dct:
                d = dct_matrix(piece.w, rows.dtype, rows.device)
                blocks = torch.matmul(blocks, d.T)
                if piece.matrix:
                    blocks = torch.matmul(dct_matrix(piece.h, rows.dtype, rows.device), blocks)
            out.append(blocks.reshape(rows.shape[0], piece.count, piece.length))
        return out

    def join(self, chunks: Sequence[torch.Tensor], dct: bool = False) -> torch.Tensor:
        """The inverse of :meth:`split`: per tensor ``[W, count, length]`` → ``[W, N]``."""
        parts = []
        for piece, c in zip(self.pieces, chunks):
            w = c.shape[0]
            if piece.matrix:
                blocks = c.reshape(w, *piece.blocks, piece.h, piece.w)
                if dct:
                    blocks = torch.matmul(dct_matrix(piece.h, c.dtype, c.device).T, blocks)
                    blocks = torch.matmul(blocks, dct_matrix(piece.w, c.dtype, c.device))
                parts.append(blocks.permute(0, 1, 3, 2, 4).reshape(w, piece.numel))
            else:
                blocks = c.reshape(w, piece.count, piece.w)
                if dct:
                    blocks = torch.matmul(blocks, dct_matrix(piece.w, c.dtype, c.device))
                parts.append(blocks.reshape(w, piece.numel))
        return torch.cat(parts, dim=1)

    def position_dtype(self) -> torch.dtype:
        """The dtype a position inside a chunk travels as: int16, or int32 past 2^15 values."""
        return torch.int16 if self.max_length <= INT16_LIMIT else torch.int32


def _select(chunks: torch.Tensor, k: int) -> tuple:
    """The ``k`` entries of largest magnitude of each chunk (``[W, C, L]``): values and
    positions, ``[W, C, k]`` each (torch.topk's order, as the references)."""
    positions = chunks.abs().topk(k, dim=-1, largest=True, sorted=False).indices
    return chunks.gather(-1, positions), positions


def quantize_values(values: torch.Tensor, bits: int, range_sigmas: float) -> tuple:
    """SparseLoCo's statistical quantizer (its reference ``TopKCompressor._quantize``)
    on each row of ``values`` (``[W, K]``, one tensor's selected values a row), with
    B = 2^bits bins:

    shift = mean; c = v − shift; σ = ‖c‖ / √(K − 1) (0 for K = 1); scale = range·σ / B
    (1 where that is 0 or not finite); level = clamp(round(c / scale + B // 2), 0, B − 1);
    a level's value is the mean of the c that fell into it (0 if none).

    Returns (levels as integral floats ``[W, K]``, shift ``[W, 1]``, level table ``[W, B]``)."""
    bins = 1 << bits
    shift = values.mean(-1, keepdim=True)
    centered = values - shift
    count = values.shape[-1]
    if count <= 1:
        sigma = torch.zeros_like(shift)
    else:
        sigma = torch.linalg.vector_norm(centered, dim=-1, keepdim=True) / math.sqrt(count - 1)
    scale = range_sigmas * sigma / bins
    scale = torch.where((scale == 0) | ~torch.isfinite(scale), torch.ones_like(scale), scale)
    levels = (centered / scale + bins // 2).round_().clamp_(0, bins - 1)
    index = torch.nan_to_num(levels, nan=0.0).long()  # (a NaN value: its shift is NaN, and so is what it sends)
    sums = torch.zeros(values.shape[0], bins, dtype=values.dtype, device=values.device)
    sums.scatter_add_(-1, index, centered)
    counts = torch.zeros_like(sums).scatter_add_(-1, index, torch.ones_like(centered))
    table = torch.where(counts > 0, sums / counts, torch.zeros_like(sums))
    return index.to(values.dtype), shift, table


def dequantize_values(levels: torch.Tensor, shift: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The values of ``levels`` (``[W, K]``, integers): table[level] + shift."""
    return table.gather(-1, levels.long()) + shift


class DCTTopKCodec:
    """DeMo's message of a bucket: per tensor and chunk, the ``topk`` largest DCT
    coefficients (at most the chunk's length), values of ``dtype`` then positions."""

    def __init__(self, shapes: Sequence, chunk: int, topk: int, dtype: torch.dtype):
        self.layout = ChunkLayout(shapes, chunk)
        topk = check_int("topk", topk, 1, what="an int >= 1")
        self.ks = [min(topk, piece.length) for piece in self.layout.pieces]
        self.counts = [piece.count * k for piece, k in zip(self.layout.pieces, self.ks)]
        self.k = sum(self.counts)
        self.dtype = dtype
        self.position_dtype = self.layout.position_dtype()
        value_bytes = torch.empty((), dtype=dtype).element_size()
        position_bytes = torch.empty((), dtype=self.position_dtype).element_size()
        self.value_bytes = self.k * value_bytes
        self.message_bytes = self.value_bytes + self.k * position_bytes

    def encode(self, contributions: torch.Tensor, generators=None) -> torch.Tensor:
        rows = contributions.shape[0]
        values, positions = [], []
        for chunks, k in zip(self.layout.split(contributions[:, :self.layout.numel], dct=True), self.ks):
            v, p = _select(chunks, k)
            values.append(v.reshape(rows, -1))
            positions.append(p.reshape(rows, -1))
        return torch.cat([as_bytes(torch.cat(values, 1).to(self.dtype)),
                          as_bytes(torch.cat(positions, 1).to(self.position_dtype))], dim=1)

    def unpack(self, messages: torch.Tensor) -> list:
        """Per tensor (values, int64 positions), each ``[W, count, k]``."""
        rows = messages.shape[0]
        values = from_bytes(messages[:, :self.value_bytes], self.dtype).split(self.counts, 1)
        positions = from_bytes(messages[:, self.value_bytes:], self.position_dtype).long().split(self.counts, 1)
        return [(v.reshape(rows, piece.count, k), p.reshape(rows, piece.count, k))
                for v, p, piece, k in zip(values, positions, self.layout.pieces, self.ks)]

    def decode(self, messages: torch.Tensor) -> torch.Tensor:
        """``[W, N]``: each sender's coefficients in place, zeros elsewhere, transformed back."""
        grids = [torch.zeros(v.shape[0], piece.count, piece.length, dtype=v.dtype, device=v.device)
                 .scatter_(-1, p, v) for (v, p), piece in zip(self.unpack(messages), self.layout.pieces)]
        return self.layout.join(grids, dct=True)

    def direction(self, messages: torch.Tensor) -> torch.Tensor:
        """``[N]``: every coefficient the mean of what its senders sent (demo.py's
        ``batch_decompress``: a scatter mean over the senders' concatenated messages,
        ``include_self=False``), transformed back."""
        grids = []
        for (v, p), piece in zip(self.unpack(messages), self.layout.pieces):
            senders, count, k = v.shape
            v = v.permute(1, 0, 2).reshape(count, senders * k)  # sender by sender, as demo.py's concatenation
            p = p.permute(1, 0, 2).reshape(count, senders * k)
            grid = torch.zeros(count, piece.length, dtype=v.dtype, device=v.device)
            grids.append(grid.scatter_reduce_(-1, p, v, reduce="mean", include_self=False).unsqueeze(0))
        return self.layout.join(grids, dct=True)[0]

    def aggregate(self, messages: torch.Tensor) -> torch.Tensor:
        """DeMo's update: the sign of :meth:`direction`."""
        return self.direction(messages).sign_()


class QuantizedTopKCodec:
    """SparseLoCo's message of a bucket: per tensor and chunk, the k_t largest entries
    (k_t = max(1, round(density · length)), at most the length), quantized per tensor to
    ``bits`` bits. Layout: each tensor's shift and level table (float32), the packed
    levels, the positions."""

    def __init__(self, shapes: Sequence, chunk: int, density: float, bits: int, range_sigmas: float):
        self.layout = ChunkLayout(shapes, chunk)
        density = check_real("topk_density", density, 0.0, 1.0, low_open=True)
        self.bits = check_choice("bits", bits, minmax.VALID_BITS)
        self.range_sigmas = check_real("range_sigmas", range_sigmas, 0.0, low_open=True)
        self.ks = [min(piece.length, max(1, round(piece.length * density))) for piece in self.layout.pieces]
        self.counts = [piece.count * k for piece, k in zip(self.layout.pieces, self.ks)]
        self.k = sum(self.counts)
        self.bins = 1 << self.bits
        self.position_dtype = self.layout.position_dtype()
        self.table_bytes = len(self.layout.pieces) * (1 + self.bins) * 4
        self.level_bytes = -(-self.k * self.bits // 8)
        position_bytes = torch.empty((), dtype=self.position_dtype).element_size()
        self.message_bytes = self.table_bytes + self.level_bytes + self.k * position_bytes

    def encode(self, contributions: torch.Tensor, generators=None) -> torch.Tensor:
        rows = contributions.shape[0]
        tables, levels, positions = [], [], []
        for chunks, k in zip(self.layout.split(contributions[:, :self.layout.numel]), self.ks):
            v, p = _select(chunks, k)
            level, shift, table = quantize_values(v.reshape(rows, -1).float(), self.bits, self.range_sigmas)
            tables.append(torch.cat([shift, table], dim=1))
            levels.append(level)
            positions.append(p.reshape(rows, -1))
        return torch.cat([as_bytes(torch.cat(tables, 1)), minmax.pack_levels(torch.cat(levels, 1), self.bits),
                          as_bytes(torch.cat(positions, 1).to(self.position_dtype))], dim=1)

    def unpack(self, messages: torch.Tensor) -> tuple:
        """(``[W, K]`` dequantized values, ``[W, K]`` places in the bucket, int64)."""
        rows = messages.shape[0]
        tables = from_bytes(messages[:, :self.table_bytes], torch.float32).view(rows, -1, 1 + self.bins)
        packed = messages[:, self.table_bytes:self.table_bytes + self.level_bytes]
        levels = minmax.unpack_levels(packed, self.bits, self.k).split(self.counts, 1)
        positions = from_bytes(messages[:, self.table_bytes + self.level_bytes:], self.position_dtype).long()
        values, places = [], []
        for i, (piece, k, level, where) in enumerate(zip(self.layout.pieces, self.ks, levels,
                                                         positions.split(self.counts, 1))):
            values.append(dequantize_values(level, tables[:, i, :1], tables[:, i, 1:]))
            places.append(piece.offset + piece.flat_positions(where.reshape(rows, piece.count, k)).reshape(rows, -1))
        return torch.cat(values, 1), torch.cat(places, 1)

    def decode(self, messages: torch.Tensor) -> torch.Tensor:
        """``[W, N]``: each sender's dequantized values in place, zeros elsewhere."""
        values, places = self.unpack(messages)
        return torch.zeros(messages.shape[0], self.layout.numel, dtype=values.dtype,
                           device=values.device).scatter_(1, places, values)

    def aggregate(self, messages: torch.Tensor) -> torch.Tensor:
        """(1/R) Σ_r of the senders' sparse values, summed sender by sender (in sender
        order on the CPU; CUDA's index_add_ adds a place's values in any order)."""
        values, places = self.unpack(messages)
        total = torch.zeros(self.layout.numel, dtype=values.dtype, device=values.device)
        total.index_add_(0, places.reshape(-1), values.reshape(-1))
        return total / messages.shape[0]
