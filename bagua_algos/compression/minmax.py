"""Min-max (TernGrad-style) quantization of a tensor to 1, 2, 4 or 8 bits per value.

Pure tensor functions: they do the arithmetic on the input's device and never
communicate. The layout of one encoded tensor (a 1-D ``torch.uint8`` tensor) is

    byte 0      bit width b (1, 2, 4 or 8)
    byte 1      tail: the number of unused value slots in the last payload byte
    bytes 2-5   min, float32 little-endian
    bytes 6-9   max, float32 little-endian
    bytes 10-   payload: one level index (0 .. 2**b - 1) per value, 8 // b values a
                byte, the first value of each byte in its highest bits; unused slots
                in the last byte are zero

so a tensor of ``n`` values takes ``10 + ceil(n * b / 8)`` bytes (:func:`encoded_size`).

Quantization, computed in float32 whatever the input's float dtype:

    gap   = (max - min) / (2**b - 1)
    index = round((x - min) / gap)          nearest; ties go to the even index
                                            (torch.round, like C's nearbyint)
    index = floor(t) + [u < t - floor(t)]   stochastic, t = (x - min) / gap and
                                            u uniform in [0, 1) from ``generator``;
                                            rounds up with probability equal to the
                                            fractional part, so E[decode] = x
    value = min + index * gap               decoding, clamped to [min, max]

(indices are clamped to 2**b - 1: a subnormal gap can be rounded well below the exact
range / (2**b - 1)). When ``max == min`` (a constant tensor, or one value) every index
is 0 and decoding gives the constant back exactly. When ``max - min`` overflows
float32 (values of opposite sign near the float32 limit) that tensor is normalized
and decoded in float64 instead, so it still works. A zero min or max is written as
+0.0 (``torch.aminmax`` may return either zero when both are present; the
canonical sign makes the bytes the same on every device). An empty tensor encodes to
the header alone (tail 0, min = max = 0.0) and decodes to an empty tensor.

NaN/inf values are refused (ValueError), and so are float64 values outside the float32
range, unless the caller asks for the **mark** (``non_finite="mark"``): then, if any
value is not finite, every chunk's encoding is all zero bytes, bit width 0, which no
encoding has. A receiver learns from the bytes alone that the sender could not encode
(:func:`marked`), so a collective can carry the news and every worker can raise
together (the runtime's ops do).

The batched forms :func:`encode_chunks` and :func:`decode_chunks` handle a bucket cut
into equal chunks (one header per chunk) in one vectorized pass; their output is the
concatenation of the per-chunk encodings.

**Where it runs.** A CUDA tensor goes through the Triton kernels of
:mod:`.minmax_triton` (when Triton imports; ``BAGUA_MINMAX_TRITON=0`` turns them off):
a min/max pass, one kernel that quantizes, packs and writes the headers, and one that
unpacks and dequantizes; the bytes equal this module's. Everything else (the CPU) runs
the torch code below, which on the CPU works through the tensor in blocks of
``_BLOCK`` values, so that a block's intermediates stay in cache and memory sees
little more than one read of the input for the min/max, one for the quantization, and
the writes of the payload and (decoding) of the values. Within a block: the indices
(integral floats) meet their byte as one product with the slot weights 2^(8 - b(j+1));
adding 2^23 to an integral float below 2^23 leaves the integer in the low byte of its
bits, which an int32 -> uint8 copy takes (several times faster than a float -> uint8
one); decoding looks each payload byte up in a per-chunk table of the decoded values
of its 8 // b slots (256 entries), one gather a byte instead of unpacking and
dequantizing.

**Host synchronisation** (what reads device memory back to the host, on CUDA):

- ``non_finite="raise"`` (the default) reads one flag to raise; ``"mark"`` reads
  nothing.
- decoding reads the headers back to validate them and to learn the output's size,
  unless the caller passes ``bits`` and ``numel`` (what it encoded): then nothing is
  read back, a header is not validated, and a chunk whose header is not a ``bits``-bit
  encoding of ``numel`` values (the mark, or a corrupt one) decodes to NaN.
- the torch path (CUDA without Triton) also reads a few flags of its own back.

The runtime uses ``non_finite="mark"`` and passes ``bits``/``numel``, so its encodes
and decodes never wait for the device; it checks the marks once per op.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Callable, List, Optional, Sequence, Union

import numpy as np
import torch

from ..arguments import check_choice, check_flag, check_int, is_int
from .minmax_format import HEADER as _HEADER
from .minmax_format import HEADER_BYTES

__all__ = [
    "HEADER_BYTES",
    "VALID_BITS",
    "NON_FINITE",
    "encode",
    "decode",
    "encode_chunks",
    "decode_chunks",
    "encoded_size",
    "marked",
    "pack_levels",
    "unpack_levels",
]

VALID_BITS = (1, 2, 4, 8)
NON_FINITE = ("raise", "mark")
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_LITTLE = sys.byteorder == "little"
# Values per step of the host (torch) path: its float32 scratch (1 MiB) and the other
# intermediates of a step stay in cache, so memory sees the input's read and the
# output's write; and a step's work dwarfs the ~10 us of Python a torch op costs
# (measured on 8 x 2^21 values: 2^15 takes 1.4x the time of 2^18, 2^20 0.95x).
_BLOCK = 1 << 18


# --------------------------------------------------------------------------- checks


def _check_bits(bits) -> int:
    return check_choice("bits", bits, VALID_BITS)


def _check_tensor(tensor, what: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"{what} must have a float dtype (float16, bfloat16, float32, float64), "
            f"got {tensor.dtype}"
        )
    if tensor.is_sparse:
        raise TypeError(f"{what} must be a dense tensor, got a sparse one")
    return tensor


def _check_non_finite(non_finite) -> str:
    return check_choice("non_finite", non_finite, NON_FINITE)


def _check_stochastic(stochastic) -> bool:
    return check_flag("stochastic", stochastic)


def encoded_size(numel: int, bits: int) -> int:
    """Bytes of one encoded tensor of ``numel`` values at ``bits`` bits (header included)."""
    bits = _check_bits(bits)
    numel = check_int("numel", numel, 0)
    return HEADER_BYTES + (numel * bits + 7) // 8


_KERNELS = False  # not looked for yet


def _kernels(t: torch.Tensor):
    """The Triton kernels module for a CUDA tensor, or None (the torch path)."""
    global _KERNELS
    if not t.is_cuda:
        return None
    if _KERNELS is False:
        _KERNELS = None
        if os.environ.get("BAGUA_MINMAX_TRITON", "1") != "0":
            try:
                from . import minmax_triton
            except ImportError:  # no Triton: the torch path, on CUDA too
                pass
            else:
                _KERNELS = minmax_triton
                if not _kernels_agree(t.device):
                    _KERNELS = None
    return _KERNELS


def _kernels_agree(device) -> bool:
    """Once per process, before the Triton kernels carry real data: they compile on this
    device and give the torch path's bytes and values on a small input. Otherwise one
    warning, and the torch path serves CUDA tensors too (slower, never wrong)."""
    try:
        x = torch.linspace(-1.0, 1.0, 777, dtype=torch.float32).pow(3)
        for bits in (1, 2, 4, 8):
            ref = encode(x, bits)
            got = encode(x.to(device), bits)
            if not torch.equal(got.cpu(), ref) or not torch.allclose(decode(got).cpu(), decode(ref)):
                raise RuntimeError(f"{bits}-bit bytes or values differ from the torch path")
        return True
    except Exception as error:  # noqa: BLE001 - any failure means: do not use them
        warnings.warn(f"bagua_algos: the Triton min-max kernels are not used on {device} ({error}); "
                      "the torch path encodes CUDA tensors instead", RuntimeWarning, stacklevel=3)
        return False


def _blocks(rows: int, n: int, device):
    """(steps, cells): the (r0, r1, c0, c1) steps covering a (rows, n) grid in
    row-major order and the most cells one holds. On the CPU about _BLOCK cells a step,
    a long row in column blocks (multiples of 8, so packed bytes never straddle two
    steps), short rows several at a time; elsewhere one step (a device's kernels are
    not slowed by the size)."""
    if device.type != "cpu":
        return [(0, rows, 0, n)], rows * n
    if n >= _BLOCK:
        return [(r, r + 1, c0, min(n, c0 + _BLOCK)) for r in range(rows) for c0 in range(0, n, _BLOCK)], _BLOCK
    step = max(1, _BLOCK // max(n, 1))
    return [(r0, min(rows, r0 + step), 0, n) for r0 in range(0, rows, step)], min(rows, step) * n


# ----------------------------------------------------------------------- encoding


def _row_minmax(x: torch.Tensor):
    """Per-row min and max as float32 (min of the float32 casts = cast of the min,
    rounding being monotonic), zeros made +0.0 (adding +0.0 maps -0.0 to +0.0 and
    leaves every other value alone), and whether a row has a NaN/inf value (0-dim)."""
    if x.device.type != "cpu":
        mn, mx = torch.aminmax(x, dim=1)
    elif x.shape[1] >= 1 << 15:  # on the CPU aminmax(dim=1) takes 5-8x the time of these
        mn, mx = torch.stack([torch.stack(torch.aminmax(row)) for row in x]).unbind(1)
    else:
        mn, mx = x.amin(1), x.amax(1)
    mn, mx = mn.float().add_(0.0), mx.float().add_(0.0)
    return mn, mx, ~(torch.isfinite(mn) & torch.isfinite(mx)).all()


def _levels(x: torch.Tensor, mn: torch.Tensor, gap: torch.Tensor, out: torch.Tensor):
    """out <- (x - min) / gap per row, float32 (``gap`` already 1 where it is 0)."""
    if x.dtype == torch.float32:
        torch.sub(x, mn[:, None], out=out)
    else:  # cast first: the subtraction is float32's, as for a float32 input
        out.copy_(x).sub_(mn[:, None])
    return out.div_(gap[:, None])


def _round(t: torch.Tensor, levels: int, stochastic: bool, generator, work, clamp: bool = True,
           uniforms: Optional[torch.Tensor] = None):
    """Level indices of ``t``, in place, as integral floats in [0, levels]; ``work`` a
    scratch of t's shape and dtype (the random numbers, drawn from ``generator`` into it,
    or copied there from ``uniforms``, the caller's u of each value). ``clamp=False`` when
    no index can exceed ``levels`` (nearest rounding with a normal gap: t <= levels (1 + 2^-23))."""
    if stochastic:
        floor = torch.floor(t)
        frac = t.sub_(floor)
        if uniforms is None:
            u = torch.rand(frac.shape, generator=generator, dtype=frac.dtype, device=frac.device, out=work)
        else:
            u = work.copy_(uniforms)
        return floor.add_(u.lt_(frac)).clamp_(0, levels)
    if clamp:
        t.clamp_max_(levels)  # = clamping the index: levels is an integer
    return t.round_()  # round half to even


# 2^23: adding it to an integral float32 in [0, 2^23) is exact and leaves the integer
# in the low mantissa bits, so the low byte of the sum's bits is the integer's low byte
# (the float -> uint8 conversion is several times slower than int32 -> uint8).
_MAGIC = float(1 << 23)
_WEIGHTS: dict = {}  # (bits, device) -> the slot weights 2^(8 - bits (j + 1))


def _pack(idx: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    """(R, n) level indices (integral float32, changed in place) -> ``out``, (R,
    ceil(n*bits/8)) uint8, the first value of a byte in its high bits, unused slots 0.

    A byte's value is sum_j index_j * 2^(8 - bits (j + 1)), j < 8 // bits: a product of
    the (bytes, 8 // bits) indices with those weights (exact in float32: integers below
    256), then the magic-number conversion."""
    rows, n = idx.shape
    per = 8 // bits
    if per > 1:
        if n % per:
            padded = idx.new_zeros((rows, out.shape[1] * per))
            padded[:, :n] = idx
            idx = padded
        key = (bits, str(idx.device))
        if key not in _WEIGHTS:
            _WEIGHTS[key] = torch.tensor([float(1 << (8 - bits * (j + 1))) for j in range(per)], device=idx.device)
        idx = torch.mv(idx.reshape(-1, per), _WEIGHTS[key]).view(rows, -1)
    out.copy_(idx.add_(_MAGIC).view(torch.int32))


def pack_levels(levels: torch.Tensor, bits: int) -> torch.Tensor:
    """``levels`` (R, n), level indices in [0, 2**bits) (integers or integral floats),
    packed as this codec packs its payload: (R, ceil(n*bits/8)) uint8, 8 // bits values a
    byte, the first in the high bits, unused slots 0. For a codec of its own levels
    (SparseLoCo's statistical quantizer) that sends ``bits`` bits a value."""
    bits = _check_bits(bits)
    if levels.dim() != 2:
        raise ValueError(f"levels must be (rows, n), got shape {tuple(levels.shape)}")
    out = torch.empty((levels.shape[0], -(-levels.shape[1] * bits // 8)), dtype=torch.uint8, device=levels.device)
    _pack(levels.to(torch.float32, copy=True), bits, out)
    return out


def unpack_levels(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """The inverse of :func:`pack_levels`: (R, B) uint8 → the (R, n) level indices, int64."""
    bits = _check_bits(bits)
    check_int("n", n, 0, packed.shape[-1] * (8 // bits) + 1,
              what=f"an int in [0, {8 // bits} x {packed.shape[-1]} bytes]")
    return _slots(bits, packed.device)[packed.long()].reshape(packed.shape[0], -1)[:, :n]


def _headers(bits: int, tail: int, mn: torch.Tensor, mx: torch.Tensor) -> torch.Tensor:
    rows = mn.shape[0]
    head = torch.empty((rows, HEADER_BYTES), dtype=torch.uint8, device=mn.device)
    head[:, 0] = bits
    head[:, 1] = tail
    minmax = torch.stack([mn, mx], dim=1).contiguous().view(torch.uint8)  # (R, 8)
    if not _LITTLE:
        minmax = minmax.view(rows, 2, 4).flip(-1).reshape(rows, 8)
    head[:, 2:] = minmax
    return head


def _quantize_rows(x, mn, mx, bits: int, stochastic: bool, generator, payload, uniforms=None) -> None:
    """The torch path: write the packed level indices of each row of ``x`` (R, n) into
    ``payload`` (R, ceil(n*bits/8)). Stochastic rounding draws u block by block, in
    row-major order of the (R, n) values, from ``generator``, or takes it from
    ``uniforms`` (R, n) where the caller drew it."""
    rows, n = x.shape
    levels = (1 << bits) - 1
    gap = (mx - mn) / levels
    overflow = ~torch.isfinite(gap)
    clamp = stochastic or bool(((gap > 0) & (gap < torch.finfo(torch.float32).tiny)).any())
    gap = torch.where(gap > 0, gap, torch.ones_like(gap))
    if bool(overflow.any()):
        # A range beyond float32 (rare): whole rows, those in float64.
        t = torch.empty((rows, n), dtype=torch.float64, device=x.device)
        ok = ~overflow
        t32 = torch.empty((int(ok.sum()), n), dtype=torch.float32, device=x.device)
        t[ok] = _levels(x[ok], mn[ok], gap[ok], t32).double()
        mn64 = mn[overflow].double()
        gap64 = (mx[overflow].double() - mn64) / levels
        t[overflow] = (x[overflow].double() - mn64[:, None]).div_(gap64[:, None])
        _pack(_round(t, levels, stochastic, generator, torch.empty_like(t), uniforms=uniforms).float(), bits, payload)
        return
    per = 8 // bits
    blocks, cells = _blocks(rows, n, x.device)
    t_buf = torch.empty(cells, dtype=torch.float32, device=x.device)
    work = torch.empty(cells if stochastic else 0, dtype=torch.float32, device=x.device)
    for r0, r1, c0, c1 in blocks:
        shape = (r1 - r0, c1 - c0)
        t = _levels(x[r0:r1, c0:c1], mn[r0:r1], gap[r0:r1], t_buf[: shape[0] * shape[1]].view(shape))
        idx = _round(t, levels, stochastic, generator, work[: t.numel()].view(shape) if stochastic else None, clamp,
                     None if uniforms is None else uniforms[r0:r1, c0:c1])
        _pack(idx, bits, payload[r0:r1, c0 // per : -(-c1 // per)])


def _encode_rows(
    x: torch.Tensor, bits: int, stochastic: bool, generator, non_finite: str,
    name: Callable[[int], str], uniforms: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Encode each row of the 2-D float tensor ``x``; returns (R, encoded_size) uint8.
    ``uniforms`` (stochastic rounding's u, x's shape) runs the torch path on any device."""
    rows, n = x.shape
    per = 8 // bits
    tail = (-n) % per
    if n == 0:
        zeros = torch.zeros(rows, dtype=torch.float32, device=x.device)
        return _headers(bits, 0, zeros, zeros)
    kernels = _kernels(x) if uniforms is None else None
    mn, mx, bad = kernels.row_minmax(x) if kernels is not None else _row_minmax(x)
    # bad: a NaN/inf value somewhere; with "raise" refused (on CUDA the encoder's one
    # host synchronisation), with "mark" every chunk becomes the mark
    if non_finite == "raise" and bool(bad):
        r = int((~(torch.isfinite(mn) & torch.isfinite(mx))).nonzero()[0, 0])
        if x.dtype == torch.float64 and bool(torch.isfinite(x[r]).all()):
            raise ValueError(f"{name(r)} has values outside the float32 range")
        raise ValueError(f"{name(r)} has NaN/inf values")
    if kernels is not None:
        return kernels.encode_rows(x, mn, mx, bad, bits, tail, stochastic, generator)
    size = encoded_size(n, bits)
    if bool(bad):
        return torch.zeros((rows, size), dtype=torch.uint8, device=x.device)
    out = torch.empty((rows, size), dtype=torch.uint8, device=x.device)
    out[:, :HEADER_BYTES] = _headers(bits, tail, mn, mx)
    _quantize_rows(x, mn, mx, bits, stochastic, generator, out[:, HEADER_BYTES:], uniforms)
    return out


def encode(
    tensor: torch.Tensor,
    bits: int,
    stochastic: bool = False,
    generator: Optional[torch.Generator] = None,
    non_finite: str = "raise",
) -> torch.Tensor:
    """Quantize ``tensor`` (any shape, any float dtype; flattened) to ``bits`` bits a value.

    Returns a 1-D ``torch.uint8`` tensor on the input's device: the 10-byte header
    (bits, tail, min, max) and the packed level indices. ``stochastic=True`` rounds
    each value up with probability equal to its fractional distance to the lower
    level (unbiased), drawing from ``generator`` (the default generator if None; it
    must be on the tensor's device). Nearest rounding sends ties to the even index.
    ``non_finite``: "raise" refuses NaN/inf values (ValueError); "mark" encodes them
    as the mark (all zero bytes) instead, without a host synchronisation.
    """
    bits = _check_bits(bits)
    tensor = _check_tensor(tensor, "tensor")
    _check_stochastic(stochastic)
    _check_non_finite(non_finite)
    rows = tensor.reshape(1, -1)
    return _encode_rows(rows, bits, stochastic, generator, non_finite, lambda r: "tensor")[0]


def encode_chunks(
    chunks: Union[torch.Tensor, Sequence[torch.Tensor]],
    bits: int,
    stochastic: bool = False,
    generator: Optional[torch.Generator] = None,
    non_finite: str = "raise",
    uniforms: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Encode each chunk with its own header; returns the encodings concatenated.

    ``chunks`` is a 2-D tensor (one chunk a row) or a sequence of tensors (each
    flattened). Chunks of equal length are encoded in one vectorized pass; chunks of
    different lengths one after the other. With nearest rounding the result equals
    ``torch.cat([encode(c, bits) for c in chunks])``; stochastic rounding draws the
    random numbers for all chunks at once, so its outcome differs from per-chunk
    calls (it is still reproducible from a seeded ``generator``). ``non_finite`` as
    for :func:`encode`: with "mark", a NaN/inf value anywhere makes every chunk the
    mark.

    ``uniforms`` (stochastic rounding, ``chunks`` a 2-D tensor; instead of
    ``generator``): the u of every value, a float32 tensor of ``chunks``' shape on its
    device, so that a caller can encode in one pass rows whose u come from different
    generators (the one-process engine: each worker's chunks from its own stream). On
    the CPU, u drawn with ``torch.rand((R, m), generator=g)`` gives the bytes that
    ``generator=g`` gives, except for a chunk whose max − min overflows float32 (the
    codec then draws float64 u from a generator, and widens the given ones). It runs
    the torch path on every device (the Triton kernels draw their own u).
    """
    bits = _check_bits(bits)
    _check_stochastic(stochastic)
    _check_non_finite(non_finite)
    if uniforms is not None:
        _check_uniforms(uniforms, chunks, stochastic, generator)
    if isinstance(chunks, torch.Tensor):
        _check_tensor(chunks, "chunks")
        if chunks.dim() != 2:
            raise ValueError(
                f"chunks given as a tensor must be 2-D (one chunk a row), got shape "
                f"{tuple(chunks.shape)}"
            )
        rows = chunks
    else:
        chunks = list(chunks)
        if not chunks:
            raise ValueError("chunks is empty")
        for i, c in enumerate(chunks):
            _check_tensor(c, f"chunks[{i}]")
        devices = {c.device for c in chunks}
        if len(devices) > 1:
            raise ValueError(f"chunks must all be on one device, got {sorted(map(str, devices))}")
        sizes = {c.numel() for c in chunks}
        if len(sizes) > 1:
            parts = [
                _encode_rows(c.reshape(1, -1), bits, stochastic, generator, non_finite,
                             lambda r, i=i: f"chunk {i}")
                for i, c in enumerate(chunks)
            ]
            if non_finite == "mark":  # one marked chunk marks them all
                bad = torch.stack([marked(p.reshape(-1), 1)[0] for p in parts]).any()
                parts = [p.masked_fill(bad, 0) for p in parts]
            return torch.cat([p[0] for p in parts])
        dtype = torch.promote_types(chunks[0].dtype, torch.float32)
        for c in chunks:
            dtype = torch.promote_types(dtype, c.dtype)
        rows = torch.stack([c.reshape(-1).to(dtype) for c in chunks])
    return _encode_rows(rows, bits, stochastic, generator, non_finite, lambda r: f"chunk {r}",
                        uniforms).reshape(-1)


def _check_uniforms(uniforms, chunks, stochastic: bool, generator) -> None:
    """``uniforms`` of :func:`encode_chunks`: only with stochastic rounding, no
    generator, 2-D chunks, and float32 of their shape on their device."""
    if not stochastic:
        raise ValueError("uniforms are the u of stochastic rounding: pass them with stochastic=True")
    if generator is not None:
        raise ValueError("give either generator or uniforms (the u already drawn), not both")
    if not isinstance(chunks, torch.Tensor):
        raise ValueError("uniforms need chunks as a 2-D tensor (one chunk a row)")
    if not isinstance(uniforms, torch.Tensor) or uniforms.dtype != torch.float32:
        raise TypeError(f"uniforms must be a float32 torch.Tensor, got "
                        f"{uniforms.dtype if isinstance(uniforms, torch.Tensor) else type(uniforms).__name__}")
    if uniforms.shape != chunks.shape or uniforms.device != chunks.device:
        raise ValueError(f"uniforms must have chunks' shape {tuple(chunks.shape)} on {chunks.device}, got "
                         f"{tuple(uniforms.shape)} on {uniforms.device}")


def marked(buf: torch.Tensor, chunks: int = 1) -> torch.Tensor:
    """Which of the ``chunks`` equal encodings in ``buf`` are the mark (their sender had
    NaN/inf values): a bool tensor of ``chunks`` on ``buf``'s device, read from the bit
    width bytes without a host synchronisation."""
    buf = _as_buffer(buf)
    chunks = check_int("chunks", chunks, 1)
    if buf.numel() % chunks or buf.numel() // chunks < HEADER_BYTES:
        raise ValueError(f"buf of {buf.numel()} bytes does not split into {chunks} encodings")
    return buf.view(chunks, -1)[:, 0] == 0


# ----------------------------------------------------------------------- decoding


def _as_buffer(buf) -> torch.Tensor:
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"buf must be a torch.Tensor, got {type(buf).__name__}")
    if buf.dtype != torch.uint8:
        raise TypeError(f"buf must be a torch.uint8 tensor, got {buf.dtype}")
    if buf.dim() != 1:
        raise ValueError(f"buf must be 1-D, got shape {tuple(buf.shape)}")
    return buf


def _header_error(rec: bytes, payload: int, where: str, common) -> Optional[str]:
    """What is wrong with one header (``rec``: its 10 bytes and the last byte of the
    encoding), or None."""
    bits, tail, mn, mx = _HEADER.unpack(rec[:HEADER_BYTES])
    if bits not in VALID_BITS:
        return f"{where}: corrupt header, bit width {bits} is not one of 1, 2, 4, 8"
    per = 8 // bits
    if tail >= per:
        return f"{where}: corrupt header, tail {tail} must be below {per} (values per byte at {bits} bits)"
    if payload == 0 and tail != 0:
        return f"{where}: corrupt header, tail {tail} with an empty payload"
    if not (mn == mn and mx == mx and abs(mn) != float("inf") and abs(mx) != float("inf")):
        return f"{where}: corrupt header, min {mn} / max {mx} not finite"
    if mn > mx:
        return f"{where}: corrupt header, min {mn} > max {mx}"
    if payload and tail and rec[HEADER_BYTES] & ((1 << (tail * bits)) - 1):
        return f"{where}: corrupt payload, unused slots of the last byte not zero"
    if common is not None and common != (bits, tail):
        return f"{where}: bit width / tail {(bits, tail)} differ from the first chunk's {common}"
    return None


def _parse_headers(rows2d: torch.Tensor, name: Callable[[int], str]):
    """Read and validate the header of each row of a (R, L) uint8 tensor (one read
    back to the host, a device synchronisation on CUDA); returns (bits, n), common to
    all rows."""
    rows, length = rows2d.shape
    if length < HEADER_BYTES:
        raise ValueError(
            f"{name(0)}: {length} bytes is shorter than the {HEADER_BYTES}-byte header"
        )
    host = torch.cat([rows2d[:, :HEADER_BYTES], rows2d[:, -1:]], dim=1).cpu().numpy()
    payload = length - HEADER_BYTES
    bits, tail, last = host[:, 0].astype(np.int64), host[:, 1].astype(np.int64), host[:, -1]
    minmax = host[:, 2:HEADER_BYTES].copy().view("<f4")  # (R, 2)
    valid_bits = np.isin(bits, VALID_BITS)
    per = 8 // np.where(valid_bits, bits, 8)
    unused = (1 << (tail * np.where(valid_bits, bits, 0)).clip(0, 8)) - 1
    ok = (
        valid_bits
        & (tail < per)
        & ((payload > 0) | (tail == 0))
        & np.isfinite(minmax).all(axis=1)
        & (minmax[:, 0] <= minmax[:, 1])
        & ((payload == 0) | (tail == 0) | ((last & unused) == 0))
        & (bits == bits[0])
        & (tail == tail[0])
    )
    if not ok.all():  # the first bad row, in the order of the checks
        common = None
        for r in range(rows):
            rec = bytes(host[r].tobytes())
            message = _header_error(rec, payload, name(r), common)
            if message:
                raise ValueError(message)
            common = common or tuple(_HEADER.unpack(rec[:HEADER_BYTES])[:2])
    b = int(bits[0])
    return b, payload * (8 // b) - int(tail[0])


def _header_minmax(rows2d: torch.Tensor):
    """The min and max of each row's header, float32, on the device."""
    raw = rows2d[:, 2:HEADER_BYTES].clone(memory_format=torch.contiguous_format)  # offset 0
    if not _LITTLE:
        raw = raw.view(-1, 2, 4).flip(-1).reshape(-1, 8)
    minmax = raw.view(torch.float32)  # (R, 2)
    return minmax[:, 0], minmax[:, 1]


def _dequantize_(v: torch.Tensor, mn: torch.Tensor, gap: torch.Tensor, mx: torch.Tensor) -> torch.Tensor:
    """In place: level indices ``v`` (R, m) -> min + v * gap clamped to [min, max], per row."""
    return v.mul_(gap[:, None]).add_(mn[:, None]).clamp_(mn[:, None], mx[:, None])


def _level_values(mn: torch.Tensor, mx: torch.Tensor, levels: int) -> torch.Tensor:
    """(R, levels + 1) float32: the decoded value of every index, float32 arithmetic
    (float64 for a row whose range overflows float32)."""
    i = torch.arange(levels + 1, dtype=torch.float32, device=mn.device)
    values = _dequantize_(i.expand(mn.shape[0], -1).clone(), mn, (mx - mn) / levels, mx)
    overflow = ~torch.isfinite(mx - mn)
    if bool(overflow.any()):
        mn64, mx64 = mn[overflow].double(), mx[overflow].double()
        wide = i.double().expand(mn64.shape[0], -1).clone()
        values[overflow] = _dequantize_(wide, mn64, (mx64 - mn64) / levels, mx64).float()
    return values


_SLOTS: dict = {}


def _slots(bits: int, device) -> torch.Tensor:
    """(256, 8 // bits) int64: the level index in each slot of every byte value."""
    key = (bits, str(device))
    if key not in _SLOTS:
        per = 8 // bits
        byte = torch.arange(256, device=device)[:, None]
        shift = torch.tensor([8 - bits * (j + 1) for j in range(per)], device=device)
        _SLOTS[key] = (byte >> shift) & ((1 << bits) - 1)
    return _SLOTS[key]


# Looked-up element for a byte of each width: its 8 // b decoded float32 values as one
# element of a dtype that wide; 1-bit bytes (8 values, 32 bytes) take two elements.
_ELEMENT = {1: torch.float32, 2: torch.float64, 4: torch.complex128}


def _dequantize_rows(rows2d: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """The torch path: decode each row of (R, L) uint8 holding ``bits``-bit encodings of
    ``n`` values; a row whose header is not one (the mark, or corrupt) gives NaN."""
    rows, length = rows2d.shape
    device = rows2d.device
    # zeros, not empty, on the CPU: fresh memory's page faults then happen in the fill,
    # on every thread, instead of one at a time in the (single-threaded) gather; with
    # one thread it costs nothing measurable (the page is hot after its fault)
    out = (torch.zeros if device.type == "cpu" else torch.empty)((rows, n), dtype=torch.float32, device=device)
    if n == 0 or rows == 0:
        return out
    per = 8 // bits
    nbytes = length - HEADER_BYTES
    mn, mx = _header_minmax(rows2d)
    valid = (
        (rows2d[:, 0] == bits) & (rows2d[:, 1] == (-n) % per)
        & torch.isfinite(mn) & torch.isfinite(mx) & (mn <= mx)
    )
    levels = (1 << bits) - 1
    values = _level_values(mn, mx, levels)
    values = torch.where(valid[:, None], values, torch.full_like(values, float("nan")))
    # table[r, byte] = the decoded values of the byte's slots, as k elements of a
    # dtype of 4 * per / k bytes: one lookup (index_select) a byte, two at 1 bit.
    k = 2 if per == 8 else 1
    element, width = _ELEMENT[per // k], per // k
    table = values[:, _slots(bits, device)].contiguous().view(-1, width).view(element).view(-1)
    offsets = torch.arange(0, rows * 256, 256, dtype=torch.int32, device=device)[:, None]
    blocks, cells = _blocks(rows, nbytes, device)
    index = torch.empty(cells * k, dtype=torch.int32, device=device)
    decoded = torch.empty(cells * per, dtype=torch.float32, device=device)
    flat_out = out.view(-1)
    for r0, r1, b0, b1 in blocks:
        shape = (r1 - r0, b1 - b0)
        payload = rows2d[r0:r1, HEADER_BYTES + b0 : HEADER_BYTES + b1]
        idx = index[: shape[0] * shape[1] * k].view(*shape, k)
        # the element of byte b of row r: k (256 r + b) + j, j < k
        if r1 - r0 == 1:
            idx[..., 0].copy_(payload)
            lookup = table[r0 * 256 * k : r1 * 256 * k]
        else:
            torch.add(payload, offsets[r0:r1], out=idx[..., 0])
            lookup = table
        if k == 2:
            idx[..., 0].mul_(2)
            torch.add(idx[..., 0], 1, out=idx[..., 1])
        c0, c1 = b0 * per, min(n, b1 * per)
        start = r0 * n + c0
        if (c1 - c0 == shape[1] * per and (r1 - r0 == 1 or c1 - c0 == n)
                and start % width == 0):  # straight into the output
            got = flat_out[start : start + shape[0] * (c1 - c0)]
            torch.index_select(lookup, 0, idx.view(-1), out=got.view(element))
        else:
            got = decoded[: idx.numel() * width]
            torch.index_select(lookup, 0, idx.view(-1), out=got.view(element))
            out[r0:r1, c0:c1] = got.view(shape[0], -1)[:, : c1 - c0]
    return out


def _decode_rows(rows2d: torch.Tensor, bits: Optional[int], n: Optional[int],
                 name: Callable[[int], str]) -> torch.Tensor:
    if bits is None:
        bits, n = _parse_headers(rows2d, name)
    kernels = _kernels(rows2d)
    if kernels is not None:
        return kernels.decode_rows(rows2d, bits, n)
    return _dequantize_rows(rows2d, bits, n)


def _check_expected(bits, numel):
    """The caller's ``bits`` and ``numel`` (both or neither)."""
    if (bits is None) != (numel is None):
        raise ValueError("bits and numel go together: give both (no header read back) or neither")
    if bits is not None:
        encoded_size(numel, bits)  # checks both
    return bits, numel


def decode(buf: torch.Tensor, bits: Optional[int] = None, numel: Optional[int] = None) -> torch.Tensor:
    """Inverse of :func:`encode`: a 1-D float32 tensor on ``buf``'s device.

    The number of values comes from the payload size and the tail. A header with a
    bit width not in (1, 2, 4, 8), a tail not below the values per byte, a non-finite
    or inverted min/max, a too-short buffer, or non-zero padding slots raises
    ValueError. Given ``bits`` and ``numel`` (what was encoded), the header is neither
    read back nor validated (see the module's notes): a buffer that is not a
    ``bits``-bit encoding of ``numel`` values decodes to NaN.
    """
    buf = _as_buffer(buf)
    bits, numel = _check_expected(bits, numel)
    if bits is not None and buf.numel() != encoded_size(numel, bits):
        raise ValueError(f"buf of {buf.numel()} bytes is not a {bits}-bit encoding of {numel} values")
    return _decode_rows(buf.reshape(1, -1), bits, numel, lambda r: "buf")[0]


def decode_chunks(
    buf: torch.Tensor, chunks: Union[int, Sequence[int]],
    bits: Optional[int] = None, numel: Optional[int] = None,
) -> Union[torch.Tensor, List[torch.Tensor]]:
    """Inverse of :func:`encode_chunks`.

    ``chunks`` an int: the buffer holds that many encodings of equal length (and
    equal bit width); returns a 2-D float32 tensor, one chunk a row, decoded in one
    vectorized pass. ``chunks`` a sequence of element counts: the buffer holds one
    encoding of each size in turn; returns a list of 1-D float32 tensors (vectorized
    when the counts are all equal). ``bits`` and ``numel`` (``chunks`` an int; each
    chunk's bit width and values): as for :func:`decode`, no header is read back.
    """
    buf = _as_buffer(buf)
    bits, numel = _check_expected(bits, numel)
    if isinstance(chunks, bool):
        raise TypeError("chunks must be an int or a sequence of ints, got a bool")
    if isinstance(chunks, int):
        if chunks < 1:
            raise ValueError(f"chunks must be at least 1, got {chunks}")
        if buf.numel() % chunks:
            raise ValueError(
                f"buf of {buf.numel()} bytes does not split into {chunks} equal chunks"
            )
        if bits is not None and buf.numel() != chunks * encoded_size(numel, bits):
            raise ValueError(
                f"buf of {buf.numel()} bytes is not {chunks} {bits}-bit encodings of {numel} values"
            )
        return _decode_rows(buf.view(chunks, -1), bits, numel, lambda r: f"chunk {r}")
    if bits is not None:
        raise ValueError("bits and numel need chunks as an int (equal chunks)")
    sizes = list(chunks)
    if not sizes:
        raise ValueError("chunks (the sizes) is empty")
    for s in sizes:
        if not is_int(s) or s < 0:
            raise ValueError(f"chunk sizes must be non-negative ints, got {s!r}")
    if buf.numel() < HEADER_BYTES:
        raise ValueError(f"buf of {buf.numel()} bytes is shorter than one header")
    first = int(buf[0])
    if first in VALID_BITS and len(set(sizes)) == 1:
        per_chunk = encoded_size(sizes[0], first)
        if buf.numel() == per_chunk * len(sizes):
            out = decode_chunks(buf, len(sizes))
            if out.shape[1] != sizes[0]:
                raise ValueError(
                    f"chunks decode to {out.shape[1]} values each, expected {sizes[0]}"
                )
            return list(out.unbind(0))
    # Chunks of different sizes: one after the other, each header read on its own.
    out, offset = [], 0
    for i, s in enumerate(sizes):
        if offset + HEADER_BYTES > buf.numel():
            raise ValueError(f"buf ends inside the header of chunk {i}")
        width = int(buf[offset])
        if width not in VALID_BITS:
            raise ValueError(
                f"chunk {i}: corrupt header, bit width {width} is not one of 1, 2, 4, 8"
            )
        size = encoded_size(s, width)
        if offset + size > buf.numel():
            raise ValueError(
                f"chunk {i}: needs {size} bytes for {s} values, {buf.numel() - offset} left"
            )
        values = _decode_rows(buf[offset : offset + size].view(1, -1), None, None, lambda r, i=i: f"chunk {i}")[0]
        if values.numel() != s:
            raise ValueError(f"chunk {i}: decodes to {values.numel()} values, expected {s}")
        out.append(values)
        offset += size
    if offset != buf.numel():
        raise ValueError(f"buf has {buf.numel() - offset} bytes left after the last chunk")
    return out
