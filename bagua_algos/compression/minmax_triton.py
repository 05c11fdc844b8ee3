"""The min-max codec's arithmetic (:mod:`.minmax`) as Triton kernels, for CUDA tensors.

:mod:`.minmax` calls these for a CUDA tensor; the bytes they write equal its torch
path's, and so do the decoded values (fused multiply-adds are turned off, so
``min + index * gap`` rounds twice as the CPU's does). Four kernels, none of which
needs the host to look at the data:

- ``_minmax_kernel``: grid (rows, parts); each program reduces a stretch of its row
  (cast to float32) to a min, a max and whether it saw a NaN; ``_minmax_finish_kernel``
  reduces the parts to each row's min and max and the flag "a value is NaN/inf".
- ``_encode_kernel``: grid (rows, payload blocks); each program reads its row's min
  and max, quantizes its values (nearest or stochastic), packs 8 // b of them a byte
  and stores the bytes; the first program of a row also writes the header. With the
  flag set (``non_finite="mark"`` and a NaN/inf value somewhere) every byte written is
  zero: the mark.
- ``_decode_kernel``: grid (rows, payload blocks); each program reads its row's
  header, checks it is a b-bit encoding of n values (else the row decodes to NaN),
  unpacks its bytes and dequantizes.

Both kernels that round are compiled with ``enable_fp_fusion=False``: no multiply and
add is contracted into one rounding. An encode is three launches (four with stochastic
rounding: the seed), a decode one. An encode reads the input twice (min/max, then quantization) and writes the payload;
a decode reads the payload and writes the values: 1.75× the bytes of a copy of the
input at 8 bits, less below.

Why Triton rather than a CUDA kernel in ``cuda_ext/``:

- it ships with torch: no nvcc, ninja or build step at install or run time, and no
  fallback path for a failed build (``cuda_ext`` needs all three);
- one source for 4 bit widths × 2 roundings × 4 input dtypes: they are ``constexpr``
  parameters, specialised when a combination is first used;
- ``TRITON_INTERPRET=1`` runs the same kernels on the CPU, so the CPU-only test suite
  compares their bytes with the torch path's (tests/test_minmax.py);
- the work is elementwise plus a row reduction, memory-bound: Triton's generated
  loads and stores reach the bandwidth without hand-written shared memory or warp
  shuffles, which is what ``cuda_ext``'s Householder QR needs and Triton would not
  give it.

Exactness notes: float32 division is ``div_rn`` (Triton's ``/`` is the approximate
``div.full.f32``); nearest rounding adds and subtracts 2^23, which rounds half to even
for 0 <= t < 2^23 (libdevice's ``rint`` does not run under the interpreter); a row
whose range overflows float32 is quantized and dequantized in float64, as on the CPU.
Stochastic rounding draws u from Philox (``tl.rand``) keyed by one seed taken from the
caller's generator and counted by the value's position, so it is reproducible from a
seeded generator but differs from the CPU's draws.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .minmax_format import HEADER_BYTES

_HEADER = tl.constexpr(HEADER_BYTES)  # what a kernel may read of a global
_VALUES_PER_PROGRAM = 4096  # encode/decode: values a program handles
_MINMAX_BLOCK = 2048  # values a min/max program loads at a time
_MAX_PARTS = 1024  # min/max programs, all rows together (enough to fill a GPU)


@triton.jit
def _minmax_kernel(x_ptr, lo_ptr, hi_ptr, bad_ptr, n, stride, span, parts, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    part = tl.program_id(1)
    if (row == 0) & (part == 0):
        tl.store(bad_ptr, 0)  # raised by _minmax_finish_kernel, which runs after this one
    base = x_ptr + row.to(tl.int64) * stride
    start = part * span
    end = tl.minimum(start + span, n)
    lo = tl.full([BLOCK], float("inf"), tl.float32)
    hi = tl.full([BLOCK], float("-inf"), tl.float32)
    nan = tl.full([BLOCK], 0, tl.int32)
    for c in range(start, end, BLOCK):
        offs = c + tl.arange(0, BLOCK)
        m = offs < end
        v = tl.load(base + offs, mask=m, other=0.0).to(tl.float32)
        nan = tl.maximum(nan, (m & (v != v)).to(tl.int32))
        lo = tl.minimum(lo, tl.where(m, v, float("inf")))
        hi = tl.maximum(hi, tl.where(m, v, float("-inf")))
    saw_nan = tl.max(nan, axis=0) > 0
    out = row * parts + part
    tl.store(lo_ptr + out, tl.where(saw_nan, float("nan"), tl.min(lo, axis=0)))
    tl.store(hi_ptr + out, tl.where(saw_nan, float("nan"), tl.max(hi, axis=0)))


@triton.jit
def _minmax_finish_kernel(lo_ptr, hi_ptr, mn_ptr, mx_ptr, bad_ptr, rows, parts,
                          ROWS: tl.constexpr, PARTS: tl.constexpr):
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    part = tl.arange(0, PARTS)
    m = (row[:, None] < rows) & (part[None, :] < parts)
    at = row[:, None] * parts + part[None, :]
    lo = tl.load(lo_ptr + at, mask=m, other=float("inf"))
    hi = tl.load(hi_ptr + at, mask=m, other=float("-inf"))
    nan = tl.max(((lo != lo) | (hi != hi)).to(tl.int32), axis=1) > 0
    mn = tl.where(nan, float("nan"), tl.min(lo, axis=1))
    mx = tl.where(nan, float("nan"), tl.max(hi, axis=1))
    mn = tl.where(mn == 0.0, 0.0, mn)  # a zero is +0.0, as on the torch path
    mx = tl.where(mx == 0.0, 0.0, mx)
    tl.store(mn_ptr + row, mn, mask=row < rows)
    tl.store(mx_ptr + row, mx, mask=row < rows)
    finite = (tl.abs(mn) < float("inf")) & (tl.abs(mx) < float("inf"))  # False for NaN too
    tl.atomic_max(bad_ptr, tl.max(((row < rows) & (finite == 0)).to(tl.int32), axis=0))


def row_minmax(x: torch.Tensor):
    """Per-row float32 min and max of the 2-D tensor ``x`` (NaN where a row has one),
    zeros as +0.0, and a 0-dim int32 tensor, nonzero when a row has a NaN/inf value;
    all on the device, in two launches."""
    rows, n = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    parts = max(1, min(triton.cdiv(n, _MINMAX_BLOCK), _MAX_PARTS // max(rows, 1)))
    span = triton.cdiv(triton.cdiv(n, parts), _MINMAX_BLOCK) * _MINMAX_BLOCK
    parts = triton.cdiv(n, span)
    lo = torch.empty((rows, parts), dtype=torch.float32, device=x.device)
    hi = torch.empty_like(lo)
    mn = torch.empty(rows, dtype=torch.float32, device=x.device)
    mx = torch.empty_like(mn)
    bad = torch.empty((), dtype=torch.int32, device=x.device)
    _minmax_kernel[(rows, parts)](x, lo, hi, bad, n, x.stride(0), span, parts, BLOCK=_MINMAX_BLOCK)
    width = triton.next_power_of_2(parts)
    block_rows = max(1, _MINMAX_BLOCK // width)
    _minmax_finish_kernel[(triton.cdiv(rows, block_rows),)](lo, hi, mn, mx, bad, rows, parts,
                                                            ROWS=block_rows, PARTS=width)
    return mn, mx, bad


@triton.jit
def _quantize(t, levels, u, STOCHASTIC: tl.constexpr, MAGIC: tl.constexpr):
    """Level index (float) of t >= 0: nearest (half to even) or stochastic, <= levels."""
    if STOCHASTIC:
        floor = tl.floor(t)
        idx = floor + (u < t - floor).to(t.dtype)
    else:
        idx = (t + MAGIC) - MAGIC  # exact: one rounding of t + 2^23 (2^52 in float64)
    return tl.minimum(idx, levels)


@triton.jit
def _encode_kernel(x_ptr, mn_ptr, mx_ptr, mark_ptr, seed_ptr, out_ptr,
                   n, x_stride, out_stride, nbytes, tail,
                   BITS: tl.constexpr, STOCHASTIC: tl.constexpr, BLOCK: tl.constexpr):
    PER: tl.constexpr = 8 // BITS
    LEVELS: tl.constexpr = (1 << BITS) - 1
    row = tl.program_id(0)
    block = tl.program_id(1)
    mn = tl.load(mn_ptr + row)
    mx = tl.load(mx_ptr + row)
    marked = tl.load(mark_ptr) != 0
    out_row = out_ptr + row.to(tl.int64) * out_stride
    if block == 0:  # the header: bit width, tail, min and max little-endian
        k = tl.arange(0, 16)
        mn_bits = mn.to(tl.uint32, bitcast=True)
        mx_bits = mx.to(tl.uint32, bitcast=True)
        shift = (8 * ((k + 2) % 4)).to(tl.uint32)  # byte k of min (k < 6) or max
        value = tl.where(k == 0, BITS, tl.where(k == 1, tail, tl.where(
            k < 6, (mn_bits >> shift) & 255, (mx_bits >> shift) & 255)))
        value = tl.where(marked, 0, value)
        tl.store(out_row + k, value.to(tl.uint8), mask=k < _HEADER)
    byte = block * BLOCK + tl.arange(0, BLOCK)
    slot = tl.arange(0, PER)
    col = byte[:, None] * PER + slot[None, :]  # (BLOCK, PER): the values of each byte
    inside = col < n
    x = tl.load(x_ptr + row.to(tl.int64) * x_stride + col, mask=inside, other=0.0).to(tl.float32)
    if STOCHASTIC:
        u = tl.rand(tl.load(seed_ptr), row.to(tl.int64) * n + col)
    else:
        u = x  # unused
    span = mx - mn
    if span == float("inf"):  # the range overflows float32: this row in float64
        gap64 = (mx.to(tl.float64) - mn.to(tl.float64)) / LEVELS
        t64 = (x.to(tl.float64) - mn.to(tl.float64)) / gap64
        idx = _quantize(t64, LEVELS, u, STOCHASTIC, 4503599627370496.0).to(tl.int32)
    else:
        gap = tl.math.div_rn(span, LEVELS * 1.0)
        gap = tl.where(gap > 0, gap, 1.0)
        t = tl.math.div_rn(x - mn, gap)
        idx = _quantize(t, LEVELS, u, STOCHASTIC, 8388608.0).to(tl.int32)
    idx = tl.where(marked, 0, tl.where(inside, idx, 0))
    packed = tl.sum(idx << (8 - BITS * (slot[None, :] + 1)), axis=1)
    tl.store(out_row + _HEADER + byte, packed.to(tl.uint8), mask=byte < nbytes)


def _program_bytes(bits: int) -> int:
    return _VALUES_PER_PROGRAM // (8 // bits)


def encode_rows(x, mn, mx, mark, bits: int, tail: int, stochastic: bool, generator):
    """(R, encoded_size) uint8 encodings of the rows of ``x`` given their min and max;
    ``mark`` a 0-dim int32 tensor, nonzero: every row is the mark (zeros)."""
    rows, n = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    nbytes = (n * bits + 7) // 8
    out = torch.empty((rows, HEADER_BYTES + nbytes), dtype=torch.uint8, device=x.device)
    if stochastic:  # one draw from the caller's generator keys Philox for every value
        seed = torch.randint(0, 2**31 - 1, (1,), generator=generator, device=x.device, dtype=torch.int64)
    else:
        seed = mark  # not read
    block = _program_bytes(bits)
    grid = (rows, max(1, triton.cdiv(nbytes, block)))
    _encode_kernel[grid](x, mn, mx, mark, seed, out, n, x.stride(0), out.stride(0), nbytes, tail,
                         BITS=bits, STOCHASTIC=stochastic, BLOCK=block, num_warps=8, enable_fp_fusion=False)
    return out


@triton.jit
def _decode_kernel(buf_ptr, out_ptr, n, buf_stride, out_stride, nbytes, tail,
                   BITS: tl.constexpr, BLOCK: tl.constexpr):
    PER: tl.constexpr = 8 // BITS
    LEVELS: tl.constexpr = (1 << BITS) - 1
    row = tl.program_id(0)
    block = tl.program_id(1)
    base = buf_ptr + row.to(tl.int64) * buf_stride
    k = tl.arange(0, 16)
    head = tl.load(base + k, mask=k < _HEADER, other=0).to(tl.uint32)
    shift = (8 * ((k + 2) % 4)).to(tl.uint32)  # byte k of min (k < 6) or max
    width = tl.sum(tl.where(k == 0, head, 0), axis=0)
    slack = tl.sum(tl.where(k == 1, head, 0), axis=0)
    mn = tl.sum(tl.where((k >= 2) & (k < 6), head << shift, 0), axis=0).to(tl.float32, bitcast=True)
    mx = tl.sum(tl.where((k >= 6) & (k < 10), head << shift, 0), axis=0).to(tl.float32, bitcast=True)
    finite = (tl.abs(mn) < float("inf")) & (tl.abs(mx) < float("inf"))  # False for NaN too
    valid = (width == BITS) & (slack == tail) & finite & (mn <= mx)
    byte = block * BLOCK + tl.arange(0, BLOCK)
    slot = tl.arange(0, PER)
    payload = tl.load(base + _HEADER + byte, mask=byte < nbytes, other=0).to(tl.int32)
    idx = (payload[:, None] >> (8 - BITS * (slot[None, :] + 1))) & LEVELS
    span = mx - mn
    if span == float("inf"):  # as encoded: float64
        mn64 = mn.to(tl.float64)
        mx64 = mx.to(tl.float64)
        gap64 = (mx64 - mn64) / LEVELS
        value = tl.minimum(tl.maximum(idx.to(tl.float64) * gap64 + mn64, mn64), mx64).to(tl.float32)
    else:
        gap = tl.math.div_rn(span, LEVELS * 1.0)
        value = tl.minimum(tl.maximum(idx.to(tl.float32) * gap + mn, mn), mx)
    value = tl.where(valid, value, float("nan"))
    col = byte[:, None] * PER + slot[None, :]
    tl.store(out_ptr + row.to(tl.int64) * out_stride + col, value, mask=col < n)


def decode_rows(rows2d: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """(R, n) float32 values of the rows of ``rows2d`` (R, L) uint8, each expected to be
    a ``bits``-bit encoding of ``n`` values (a row that is not decodes to NaN)."""
    rows, length = rows2d.shape
    out = torch.empty((rows, n), dtype=torch.float32, device=rows2d.device)
    if n == 0 or rows == 0:
        return out
    if rows2d.stride(1) != 1:
        rows2d = rows2d.contiguous()
    nbytes = length - HEADER_BYTES
    block = _program_bytes(bits)
    grid = (rows, triton.cdiv(nbytes, block))
    # no fused multiply-add: min + index * gap rounds twice, as the torch path does
    _decode_kernel[grid](rows2d, out, n, rows2d.stride(0), out.stride(0), nbytes, (-n) % (8 // bits),
                         BITS=bits, BLOCK=block, num_warps=8, enable_fp_fusion=False)
    return out
