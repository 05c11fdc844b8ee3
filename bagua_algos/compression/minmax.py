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

When ``max == min`` (a constant tensor, or one value) every index is 0 and decoding
gives the constant back exactly. When ``max - min`` overflows float32 (values of
opposite sign near the float32 limit) that tensor is normalized and decoded in
float64 instead, so it still works. NaN or infinite values are refused, and so are
float64 values outside the float32 range. An empty tensor encodes to the header
alone (tail 0, min = max = 0.0) and decodes to an empty tensor.

The batched forms :func:`encode_chunks` and :func:`decode_chunks` handle a bucket cut
into equal chunks (one header per chunk) in one vectorized pass; their output is the
concatenation of the per-chunk encodings.
"""

from __future__ import annotations

import struct
import sys
from typing import List, Optional, Sequence, Union

import torch

__all__ = [
    "HEADER_BYTES",
    "VALID_BITS",
    "encode",
    "decode",
    "encode_chunks",
    "decode_chunks",
    "encoded_size",
]

HEADER_BYTES = 10
VALID_BITS = (1, 2, 4, 8)
_HEADER = struct.Struct("<BBff")
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_LITTLE = sys.byteorder == "little"


# --------------------------------------------------------------------------- checks


def _check_bits(bits) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in VALID_BITS:
        raise ValueError(f"bits must be one of 1, 2, 4, 8; got {bits!r}")
    return bits


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


def encoded_size(numel: int, bits: int) -> int:
    """Bytes of one encoded tensor of ``numel`` values at ``bits`` bits (header included)."""
    bits = _check_bits(bits)
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"numel must be a non-negative int, got {numel!r}")
    return HEADER_BYTES + (numel * bits + 7) // 8


# ----------------------------------------------------------------------- encoding


def _levels_fp32(x: torch.Tensor, mn: torch.Tensor, mx: torch.Tensor, levels: int):
    """(x - min) / gap per row, float32; rows with gap 0 give 0."""
    gap = (mx - mn) / levels
    gap = torch.where(gap > 0, gap, torch.ones_like(gap))
    return (x - mn[:, None]).div_(gap[:, None])


def _levels_fp64(x: torch.Tensor, mn: torch.Tensor, mx: torch.Tensor, levels: int):
    mn64, mx64 = mn.double(), mx.double()
    gap = (mx64 - mn64) / levels  # > 0 here: these rows have an overflowing range
    return (x.double() - mn64[:, None]).div_(gap[:, None])


def _round(t: torch.Tensor, levels: int, stochastic: bool, generator) -> torch.Tensor:
    if stochastic:
        floor = torch.floor(t)
        frac = t.sub_(floor)
        u = torch.rand(frac.shape, generator=generator, dtype=frac.dtype, device=frac.device)
        idx = floor.add_(u.lt_(frac))
    else:
        idx = t.round_()  # round half to even
    return idx.clamp_(0, levels).to(torch.uint8)


def _pack(idx: torch.Tensor, bits: int) -> torch.Tensor:
    """(R, n) uint8 indices -> (R, ceil(n*bits/8)) uint8, first value in the high bits."""
    rows, n = idx.shape
    per = 8 // bits
    if per == 1:
        return idx
    nbytes = (n + per - 1) // per
    if nbytes * per != n:
        padded = idx.new_zeros((rows, nbytes * per))
        padded[:, :n] = idx
        idx = padded
    idx = idx.view(rows, nbytes, per)
    out = idx[:, :, 0] << (8 - bits)
    for j in range(1, per):
        out |= idx[:, :, j] << (8 - bits * (j + 1))
    return out


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


def _encode_rows(
    x: torch.Tensor, bits: int, stochastic: bool, generator, names: Sequence[str]
) -> torch.Tensor:
    """Encode each row of the 2-D float tensor ``x``; returns (R, encoded_size) uint8."""
    rows, n = x.shape
    per = 8 // bits
    tail = (-n) % per
    levels = (1 << bits) - 1
    if n == 0:
        zeros = torch.zeros(rows, dtype=torch.float32, device=x.device)
        return _headers(bits, 0, zeros, zeros)
    x32 = x if x.dtype == torch.float32 else x.float()
    mn, mx = torch.aminmax(x32, dim=1)
    bad = ~(torch.isfinite(mn) & torch.isfinite(mx))
    if bool(bad.any()):
        r = int(bad.nonzero()[0, 0])
        where = names[r]
        if x.dtype == torch.float64 and bool(torch.isfinite(x[r]).all()):
            raise ValueError(f"{where} has values outside the float32 range")
        raise ValueError(f"{where} has NaN/inf values")
    overflow = ~torch.isfinite(mx - mn)
    if bool(overflow.any()):
        t = torch.empty((rows, n), dtype=torch.float64, device=x.device)
        ok = ~overflow
        t[ok] = _levels_fp32(x32[ok], mn[ok], mx[ok], levels).double()
        t[overflow] = _levels_fp64(x32[overflow], mn[overflow], mx[overflow], levels)
    else:
        t = _levels_fp32(x32, mn, mx, levels)
    idx = _round(t, levels, stochastic, generator)
    return torch.cat([_headers(bits, tail, mn, mx), _pack(idx, bits)], dim=1)


def encode(
    tensor: torch.Tensor,
    bits: int,
    stochastic: bool = False,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """Quantize ``tensor`` (any shape, any float dtype; flattened) to ``bits`` bits a value.

    Returns a 1-D ``torch.uint8`` tensor on the input's device: the 10-byte header
    (bits, tail, min, max) and the packed level indices. ``stochastic=True`` rounds
    each value up with probability equal to its fractional distance to the lower
    level (unbiased), drawing from ``generator`` (the default generator if None; it
    must be on the tensor's device). Nearest rounding sends ties to the even index.
    """
    bits = _check_bits(bits)
    tensor = _check_tensor(tensor, "tensor")
    if not isinstance(stochastic, bool):
        raise TypeError(f"stochastic must be True or False, got {stochastic!r}")
    return _encode_rows(tensor.reshape(1, -1), bits, stochastic, generator, ["tensor"])[0]


def encode_chunks(
    chunks: Union[torch.Tensor, Sequence[torch.Tensor]],
    bits: int,
    stochastic: bool = False,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """Encode each chunk with its own header; returns the encodings concatenated.

    ``chunks`` is a 2-D tensor (one chunk a row) or a sequence of tensors (each
    flattened). Chunks of equal length are encoded in one vectorized pass; chunks of
    different lengths one after the other. With nearest rounding the result equals
    ``torch.cat([encode(c, bits) for c in chunks])``; stochastic rounding draws the
    random numbers for all chunks at once, so its outcome differs from per-chunk
    calls (it is still reproducible from a seeded ``generator``).
    """
    bits = _check_bits(bits)
    if not isinstance(stochastic, bool):
        raise TypeError(f"stochastic must be True or False, got {stochastic!r}")
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
            names = [f"chunk {i}" for i in range(len(chunks))]
            return torch.cat(
                [
                    _encode_rows(c.reshape(1, -1), bits, stochastic, generator, [names[i]])[0]
                    for i, c in enumerate(chunks)
                ]
            )
        dtype = torch.promote_types(chunks[0].dtype, torch.float32)
        for c in chunks:
            dtype = torch.promote_types(dtype, c.dtype)
        rows = torch.stack([c.reshape(-1).to(dtype) for c in chunks])
    names = [f"chunk {i}" for i in range(rows.shape[0])]
    return _encode_rows(rows, bits, stochastic, generator, names).reshape(-1)


# ----------------------------------------------------------------------- decoding


def _as_buffer(buf) -> torch.Tensor:
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"buf must be a torch.Tensor, got {type(buf).__name__}")
    if buf.dtype != torch.uint8:
        raise TypeError(f"buf must be a torch.uint8 tensor, got {buf.dtype}")
    if buf.dim() != 1:
        raise ValueError(f"buf must be 1-D, got shape {tuple(buf.shape)}")
    return buf


def _parse_headers(rows2d: torch.Tensor, names: Sequence[str]):
    """Read and validate the header of each row of a (R, L) uint8 tensor.

    Returns (bits, tail, n, mins, maxs) with bits/tail/n common to all rows.
    """
    rows, length = rows2d.shape
    if length < HEADER_BYTES:
        raise ValueError(
            f"{names[0]}: {length} bytes is shorter than the {HEADER_BYTES}-byte header"
        )
    host = torch.cat([rows2d[:, :HEADER_BYTES], rows2d[:, -1:]], dim=1).cpu()
    raw = bytes(host.numpy().tobytes())
    width = HEADER_BYTES + 1
    payload = length - HEADER_BYTES
    common = None
    mins, maxs = [], []
    for r in range(rows):
        rec = raw[r * width : (r + 1) * width]
        bits, tail, mn, mx = _HEADER.unpack(rec[:HEADER_BYTES])
        where = names[r]
        if bits not in VALID_BITS:
            raise ValueError(f"{where}: corrupt header, bit width {bits} is not one of 1, 2, 4, 8")
        per = 8 // bits
        if tail >= per:
            raise ValueError(
                f"{where}: corrupt header, tail {tail} must be below {per} "
                f"(values per byte at {bits} bits)"
            )
        if payload == 0 and tail != 0:
            raise ValueError(f"{where}: corrupt header, tail {tail} with an empty payload")
        if not (mn == mn and mx == mx and abs(mn) != float("inf") and abs(mx) != float("inf")):
            raise ValueError(f"{where}: corrupt header, min {mn} / max {mx} not finite")
        if mn > mx:
            raise ValueError(f"{where}: corrupt header, min {mn} > max {mx}")
        if payload and tail and rec[HEADER_BYTES] & ((1 << (tail * bits)) - 1):
            raise ValueError(f"{where}: corrupt payload, unused slots of the last byte not zero")
        if common is None:
            common = (bits, tail)
        elif common != (bits, tail):
            raise ValueError(
                f"{where}: bit width / tail {(bits, tail)} differ from the first chunk's {common}"
            )
        mins.append(mn)
        maxs.append(mx)
    bits, tail = common
    n = payload * (8 // bits) - tail
    return bits, tail, n, mins, maxs


def _decode_rows(rows2d: torch.Tensor, names: Sequence[str]) -> torch.Tensor:
    bits, _tail, n, mins, maxs = _parse_headers(rows2d, names)
    rows = rows2d.shape[0]
    device = rows2d.device
    if n == 0:
        return torch.empty((rows, 0), dtype=torch.float32, device=device)
    per = 8 // bits
    payload = rows2d[:, HEADER_BYTES:]
    if per == 1:
        idx = payload
    else:
        mask = (1 << bits) - 1
        idx = torch.empty((rows, payload.shape[1], per), dtype=torch.uint8, device=device)
        for j in range(per):
            torch.bitwise_and(payload >> (8 - bits * (j + 1)), mask, out=idx[:, :, j])
        idx = idx.view(rows, -1)
    idx = idx[:, :n]
    levels = (1 << bits) - 1
    mn = torch.tensor(mins, dtype=torch.float32, device=device)
    mx = torch.tensor(maxs, dtype=torch.float32, device=device)
    overflow = ~torch.isfinite(mx - mn)
    if bool(overflow.any()):
        gap = (mx.double() - mn.double()) / levels
        out = idx.double().mul_(gap[:, None]).add_(mn.double()[:, None])
        return out.clamp_(mn.double()[:, None], mx.double()[:, None]).float()
    gap = (mx - mn) / levels
    out = idx.float().mul_(gap[:, None]).add_(mn[:, None])
    return out.clamp_(mn[:, None], mx[:, None])


def decode(buf: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`encode`: a 1-D float32 tensor on ``buf``'s device.

    The number of values comes from the payload size and the tail. A header with a
    bit width not in (1, 2, 4, 8), a tail not below the values per byte, a non-finite
    or inverted min/max, a too-short buffer, or non-zero padding slots raises
    ValueError.
    """
    buf = _as_buffer(buf)
    return _decode_rows(buf.reshape(1, -1), ["buf"])[0]


def decode_chunks(
    buf: torch.Tensor, chunks: Union[int, Sequence[int]]
) -> Union[torch.Tensor, List[torch.Tensor]]:
    """Inverse of :func:`encode_chunks`.

    ``chunks`` an int: the buffer holds that many encodings of equal length (and
    equal bit width); returns a 2-D float32 tensor, one chunk a row, decoded in one
    vectorized pass. ``chunks`` a sequence of element counts: the buffer holds one
    encoding of each size in turn; returns a list of 1-D float32 tensors (vectorized
    when the counts are all equal).
    """
    buf = _as_buffer(buf)
    if isinstance(chunks, bool):
        raise TypeError("chunks must be an int or a sequence of ints, got a bool")
    if isinstance(chunks, int):
        if chunks < 1:
            raise ValueError(f"chunks must be at least 1, got {chunks}")
        if buf.numel() % chunks:
            raise ValueError(
                f"buf of {buf.numel()} bytes does not split into {chunks} equal chunks"
            )
        names = [f"chunk {i}" for i in range(chunks)]
        return _decode_rows(buf.view(chunks, -1), names)
    sizes = list(chunks)
    if not sizes:
        raise ValueError("chunks (the sizes) is empty")
    for s in sizes:
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise ValueError(f"chunk sizes must be non-negative ints, got {s!r}")
    if buf.numel() < HEADER_BYTES:
        raise ValueError(f"buf of {buf.numel()} bytes is shorter than one header")
    bits = int(buf[0])
    if bits in VALID_BITS and len(set(sizes)) == 1:
        per_chunk = encoded_size(sizes[0], bits)
        if buf.numel() == per_chunk * len(sizes):
            out = decode_chunks(buf, len(sizes))
            if out.shape[1] != sizes[0]:
                raise ValueError(
                    f"chunks decode to {out.shape[1]} values each, expected {sizes[0]}"
                )
            return list(out.unbind(0))
    out, offset = [], 0
    for i, s in enumerate(sizes):
        if offset + HEADER_BYTES > buf.numel():
            raise ValueError(f"buf ends inside the header of chunk {i}")
        bits = int(buf[offset])
        if bits not in VALID_BITS:
            raise ValueError(
                f"chunk {i}: corrupt header, bit width {bits} is not one of 1, 2, 4, 8"
            )
        size = encoded_size(s, bits)
        if offset + size > buf.numel():
            raise ValueError(
                f"chunk {i}: needs {size} bytes for {s} values, {buf.numel() - offset} left"
            )
        values = _decode_rows(buf[offset : offset + size].view(1, -1), [f"chunk {i}"])[0]
        if values.numel() != s:
            raise ValueError(f"chunk {i}: decodes to {values.numel()} values, expected {s}")
        out.append(values)
        offset += size
    if offset != buf.numel():
        raise ValueError(f"buf has {buf.numel() - offset} bytes left after the last chunk")
    return out
