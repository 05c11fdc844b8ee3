"""The min-max (TernGrad-style) quantization codec in bagua_algos.compression.minmax."""

from __future__ import annotations

import math
import os
import re
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bagua_algos.compression import (
    HEADER_BYTES,
    decode,
    decode_chunks,
    encode,
    encode_chunks,
    encoded_size,
    marked,
)

BITS = [1, 2, 4, 8]
SEED_EXAMPLE = [-5.0, 2.0, -3.0, 7.0, -1.0, 5.0, 3.0]


def header(buf: torch.Tensor):
    return struct.unpack("<BBff", bytes(buf[:HEADER_BYTES].tolist()))


def gap_of(x: torch.Tensor, bits: int) -> float:
    x = x.float()
    return float((x.max() - x.min()) / ((1 << bits) - 1))


def slack(x: torch.Tensor) -> float:
    """Float32 rounding allowance for values of this magnitude."""
    return 4e-7 * float(x.float().abs().max()) if x.numel() else 0.0


finite_lists = st.lists(
    st.floats(-1e6, 1e6, width=32, allow_subnormal=False), min_size=0, max_size=40
)


# ------------------------------------------------------------- the seed's example


def test_seed_example_nearest_bytes():
    buf = encode(torch.tensor(SEED_EXAMPLE), 2)
    assert header(buf) == (2, 1, -5.0, 7.0)
    # indices 0,2,0,3 | 1,2,2,(pad): -3 -> 0.5 and 5 -> 2.5 are ties, sent to the even index
    assert buf[HEADER_BYTES:].tolist() == [0b00100011, 0b01101000] == [35, 104]
    assert decode(buf).tolist() == [-5.0, 3.0, -5.0, 7.0, -1.0, 3.0, 3.0]


def test_seed_example_bytes_decode():
    buf = torch.tensor(list(struct.pack("<BBff", 2, 1, -5.0, 7.0)) + [39, 104], dtype=torch.uint8)
    assert decode(buf).tolist() == [-5.0, 3.0, -1.0, 7.0, -1.0, 3.0, 3.0]


def test_seed_example_stochastic_outcomes():
    x = torch.tensor(SEED_EXAMPLE)
    g = torch.Generator().manual_seed(1)
    rows = encode_chunks(x.expand(400, 7), 2, stochastic=True, generator=g).view(400, -1)
    assert all(header(r) == (2, 1, -5.0, 7.0) for r in rows[:5])
    payloads = {tuple(r) for r in rows[:, HEADER_BYTES:].tolist()}
    assert (39, 104) in payloads  # the seed's outcome (probability 3/16 per draw)
    values = decode_chunks(rows.reshape(-1), 400)
    lo = torch.tensor([-5.0, -1.0, -5.0, 7.0, -1.0, 3.0, 3.0])
    hi = torch.tensor([-5.0, 3.0, -1.0, 7.0, -1.0, 7.0, 3.0])
    assert ((values == lo) | (values == hi)).all()


def test_one_bit_packing_order():
    buf = encode(torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0]), 1)
    assert header(buf) == (1, 3, 0.0, 1.0)
    assert buf[HEADER_BYTES:].tolist() == [0b01101000]


# --------------------------------------------------------------- sizes and headers


@pytest.mark.parametrize("bits", BITS)
def test_every_length_size_header_and_round_trip(bits):
    per = 8 // bits
    for n in range(21):
        x = torch.linspace(-3.0, 2.0, n) if n != 1 else torch.tensor([0.25])
        buf = encode(x, bits)
        assert buf.dtype == torch.uint8 and buf.dim() == 1
        assert buf.numel() == encoded_size(n, bits) == HEADER_BYTES + math.ceil(n * bits / 8)
        b, tail, mn, mx = header(buf)
        assert (b, tail) == (bits, (-n) % per)
        if n:
            assert (mn, mx) == (float(x.min()), float(x.max()))
        else:
            assert (mn, mx) == (0.0, 0.0)
        out = decode(buf)
        assert out.dtype == torch.float32 and out.shape == (n,)
        if n:
            assert (out - x).abs().max() <= gap_of(x, bits) / 2 + slack(x)


def test_encoded_size_checks():
    assert encoded_size(0, 8) == HEADER_BYTES
    assert encoded_size(4_000_000, 2) == HEADER_BYTES + 1_000_000
    with pytest.raises(ValueError, match="numel"):
        encoded_size(-1, 2)
    with pytest.raises(ValueError, match="bits"):
        encoded_size(4, 3)


@pytest.mark.parametrize("bits", [0, 3, 5, 16, -2, True, 2.0, "2", None])
def test_invalid_bits_refused(bits):
    with pytest.raises(ValueError, match=re.escape("bits must be one of [1, 2, 4, 8], got")):
        encode(torch.ones(4), bits)
    with pytest.raises(ValueError, match=re.escape("bits must be one of [1, 2, 4, 8], got")):
        encode_chunks(torch.ones(2, 4), bits)


def test_non_float_input_refused():
    with pytest.raises(TypeError, match="float dtype"):
        encode(torch.arange(4), 2)
    with pytest.raises(TypeError, match="torch.Tensor"):
        encode([1.0, 2.0], 2)


# ------------------------------------------------------------------- round trips


@settings(max_examples=60, deadline=None)
@given(values=finite_lists, bits=st.sampled_from(BITS))
def test_nearest_round_trip_within_half_gap(values, bits):
    x = torch.tensor(values, dtype=torch.float32)
    out = decode(encode(x, bits))
    assert out.shape == x.shape
    if x.numel():
        assert (out - x).abs().max() <= gap_of(x, bits) / 2 + slack(x)
        assert out.min() >= x.min() and out.max() <= x.max()


@settings(max_examples=60, deadline=None)
@given(values=finite_lists, bits=st.sampled_from(BITS), seed=st.integers(0, 2**31))
def test_stochastic_round_trip_within_one_gap(values, bits, seed):
    x = torch.tensor(values, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    out = decode(encode(x, bits, stochastic=True, generator=g))
    assert out.shape == x.shape
    if x.numel():
        assert (out - x).abs().max() <= gap_of(x, bits) + slack(x)


def test_stochastic_is_reproducible_from_a_seeded_generator():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    a = encode(x, 2, stochastic=True, generator=torch.Generator().manual_seed(7))
    b = encode(x, 2, stochastic=True, generator=torch.Generator().manual_seed(7))
    c = encode(x, 2, stochastic=True, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize("bits", BITS)
def test_stochastic_rounding_is_unbiased(bits):
    """Mean of K independent stochastic decodes is within 4 standard errors of x.

    A single decode of x is lower + gap * Bernoulli(p), p the fractional level, so its
    standard deviation is gap * sqrt(p (1 - p)); the mean of K has that over sqrt(K).
    """
    k, n = 4000, 64
    x = torch.randn(n, generator=torch.Generator().manual_seed(bits))
    g = torch.Generator().manual_seed(100 + bits)
    buf = encode_chunks(x.expand(k, n), bits, stochastic=True, generator=g)
    mean = decode_chunks(buf, k).double().mean(0)
    gap = gap_of(x, bits)
    t = (x.double() - x.min().double()) / gap
    p = t - t.floor()
    se = gap * torch.sqrt(p * (1 - p)) / math.sqrt(k)
    err = (mean - x.double()).abs()
    assert (err <= 4 * se + 1e-5 * gap).all(), float((err / (se + 1e-12)).max())
    # and nearest rounding is biased on the same data (so the check has teeth)
    nearest = decode(encode(x, bits)).double()
    assert (nearest - x.double()).abs().max() > 10 * se.max()


# ------------------------------------------------------- constants, edges, dtypes


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("value", [0.0, 1.5, -3.25e-7, 6.0e37])
@pytest.mark.parametrize("n", [1, 3, 8, 17])
def test_constant_tensor_round_trips_exactly(bits, value, n):
    x = torch.full((n,), value)
    buf = encode(x, bits)
    assert header(buf)[2] == header(buf)[3] == float(x[0])
    assert buf[HEADER_BYTES:].eq(0).all()
    assert torch.equal(decode(buf), x)
    g = torch.Generator().manual_seed(0)
    assert torch.equal(decode(encode(x, bits, stochastic=True, generator=g)), x)


def test_empty_tensor():
    for bits in BITS:
        buf = encode(torch.empty(0), bits)
        assert header(buf) == (bits, 0, 0.0, 0.0) and buf.numel() == HEADER_BYTES
        assert decode(buf).shape == (0,)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_and_inf_refused(bad):
    x = torch.tensor([1.0, bad, 2.0])
    with pytest.raises(ValueError, match="tensor has NaN/inf values"):
        encode(x, 4)
    with pytest.raises(ValueError, match="chunk 1 has NaN/inf values"):
        encode_chunks(torch.stack([torch.ones(3), x]), 4)
    with pytest.raises(ValueError, match="chunk 1 has NaN/inf values"):
        encode_chunks([torch.ones(5), x], 4)


def test_float64_outside_float32_range_refused():
    with pytest.raises(ValueError, match="outside the float32 range"):
        encode(torch.tensor([1.0, 1e300], dtype=torch.float64), 8)


@pytest.mark.parametrize("bits", BITS)
def test_range_overflowing_float32_still_works(bits):
    x = torch.tensor([3e38, -3e38, 0.0, 1e38, -2e38])
    out = decode(encode(x, bits))
    assert torch.isfinite(out).all()
    assert (out.double() - x.double()).abs().max() <= (6e38 / ((1 << bits) - 1)) / 2 * (1 + 1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("bits", BITS)
def test_other_float_dtypes(dtype, bits):
    x = torch.randn(37, generator=torch.Generator().manual_seed(3)).to(dtype)
    buf = encode(x, bits)
    assert torch.equal(buf, encode(x.float(), bits))
    assert header(buf)[2:] == (float(x.min()), float(x.max()))
    out = decode(buf)
    assert out.dtype == torch.float32
    assert (out - x.float()).abs().max() <= gap_of(x, bits) / 2 + slack(x)


def test_shape_is_flattened():
    x = torch.randn(3, 5, 2)
    assert torch.equal(encode(x, 4), encode(x.reshape(-1), 4))
    assert decode(encode(x, 4)).shape == (30,)


# ------------------------------------------------------------------ batched form


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 6),
    n=st.integers(0, 19),
    bits=st.sampled_from(BITS),
    seed=st.integers(0, 2**31),
)
def test_batched_equals_per_chunk(rows, n, bits, seed):
    x = torch.randn(rows, n, generator=torch.Generator().manual_seed(seed))
    if rows > 1:
        x[1] = 2.5  # a constant chunk among the others
    expected = torch.cat([encode(r, bits) for r in x])
    assert torch.equal(encode_chunks(x, bits), expected)
    assert torch.equal(encode_chunks(list(x), bits), expected)
    assert expected.numel() == rows * encoded_size(n, bits)
    decoded = decode_chunks(expected, rows)
    assert decoded.shape == (rows, n)
    assert torch.equal(decoded, torch.stack([decode(encode(r, bits)) for r in x]))
    as_list = decode_chunks(expected, [n] * rows)
    assert len(as_list) == rows and all(torch.equal(a, b) for a, b in zip(as_list, decoded))


def test_batched_unequal_chunks():
    g = torch.Generator().manual_seed(5)
    chunks = [torch.randn(n, generator=g) for n in (5, 0, 13, 1)]
    buf = encode_chunks(chunks, 2)
    assert torch.equal(buf, torch.cat([encode(c, 2) for c in chunks]))
    out = decode_chunks(buf, [5, 0, 13, 1])
    assert [o.numel() for o in out] == [5, 0, 13, 1]
    for o, c in zip(out, chunks):
        assert torch.equal(o, decode(encode(c, 2)))
    with pytest.raises(ValueError, match="bytes left|expected|needs"):
        decode_chunks(buf, [5, 0, 13])
    with pytest.raises(ValueError, match="equal chunks"):
        decode_chunks(buf, 3)


def test_batched_stochastic_is_reproducible_and_mixed_dtypes():
    x = torch.randn(4, 50, generator=torch.Generator().manual_seed(2))
    a = encode_chunks(x, 4, stochastic=True, generator=torch.Generator().manual_seed(3))
    b = encode_chunks(x, 4, stochastic=True, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
    mixed = [x[0].half(), x[1], x[2].bfloat16(), x[3].double()]
    assert torch.equal(
        encode_chunks(mixed, 4), torch.cat([encode(c, 4) for c in mixed])
    )


# ------------------------------------------------------------- corrupted buffers


def make(bits=2, tail=1, mn=-5.0, mx=7.0, payload=(39, 104)):
    return torch.tensor(list(struct.pack("<BBff", bits, tail, mn, mx)) + list(payload), dtype=torch.uint8)


@pytest.mark.parametrize(
    "buf, message",
    [
        (make(bits=3), "bit width 3"),
        (make(bits=0), "bit width 0"),
        (make(bits=16), "bit width 16"),
        (make(tail=4), "tail 4 must be below 4"),
        (make(bits=8, tail=1), "tail 1 must be below 1"),
        (make(mn=8.0), "min 8.0 > max 7.0"),
        (make(mn=float("nan")), "not finite"),
        (make(mx=float("inf")), "not finite"),
        (make(payload=(39, 105)), "unused slots"),
        (make(payload=()), "empty payload"),
        (make()[:9], "shorter than the 10-byte header"),
    ],
)
def test_corrupted_buffer_refused(buf, message):
    with pytest.raises(ValueError, match=message):
        decode(buf)


def test_decode_checks_buffer_type():
    with pytest.raises(TypeError, match="uint8"):
        decode(torch.zeros(12))
    with pytest.raises(ValueError, match="1-D"):
        decode(torch.zeros(2, 12, dtype=torch.uint8))


def test_decode_chunks_refuses_mismatched_chunks():
    a = encode(torch.randn(8), 2)
    b = encode(torch.randn(16), 1)  # same byte length, different bit width
    assert a.numel() == b.numel()
    with pytest.raises(ValueError, match="chunk 1: bit width / tail"):
        decode_chunks(torch.cat([a, b]), 2)
    bad = torch.cat([a, make(bits=5, payload=(0, 0))])
    with pytest.raises(ValueError, match="chunk 1: corrupt header, bit width 5"):
        decode_chunks(bad, 2)


# ----------------------------------------------------- blocks, the mark, no host reads


def oracle_encode(x: torch.Tensor, bits: int) -> bytes:
    """The module docstring's formulas in numpy float32, nearest rounding, one chunk."""
    x32 = x.float().reshape(-1).numpy()
    levels = (1 << bits) - 1
    mn, mx = (np.float32(x32.min()) + np.float32(0), np.float32(x32.max()) + np.float32(0))
    gap = np.float32((mx - mn) / np.float32(levels))
    gap = gap if gap > 0 else np.float32(1)
    idx = np.minimum(np.rint((x32 - mn) / gap), levels).astype(np.int64)  # rint: half to even
    per = 8 // bits
    idx = np.concatenate([idx, np.zeros((-len(idx)) % per, np.int64)]).reshape(-1, per)
    payload = (idx << (8 - bits * (np.arange(per) + 1))).sum(1).astype(np.uint8)
    return struct.pack("<BBff", bits, (-x32.size) % per, mn, mx) + payload.tobytes()


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("block", [8, 64])
def test_blocks_change_nothing(monkeypatch, bits, block):
    """The host path works in blocks of _BLOCK values (long rows cut, short rows
    grouped); small blocks on small tensors give the same bytes, draws and values as the
    default, and the bytes are the formulas'."""
    g = torch.Generator().manual_seed(bits)
    shapes = [(3, 200), (5, 37), (2, 8 * block + 3), (40, 3), (1, block), (4, block - 1)]
    xs = [torch.randn(*s, generator=g) * 3 for s in shapes]
    xs[0][1] = 2.5  # a constant row
    def run():
        out = []
        for x in xs:
            near = encode_chunks(x, bits)
            stoch = encode_chunks(x, bits, stochastic=True, generator=torch.Generator().manual_seed(9))
            out.append((near, stoch, decode_chunks(near, x.shape[0]), decode_chunks(stoch, x.shape[0])))
        return out
    default = run()
    from bagua_algos.compression import minmax
    monkeypatch.setattr(minmax, "_BLOCK", block)
    for x, a, b in zip(xs, default, run()):
        assert all(torch.equal(u, v) for u, v in zip(a, b))
        expected = b"".join(oracle_encode(row, bits) for row in x)
        assert bytes(b[0].numpy().tobytes()) == expected


def test_zero_min_and_max_are_written_positive():
    buf = encode(torch.tensor([-0.0, 0.0, -0.0]), 8)
    assert bytes(buf[2:10].tolist()) == struct.pack("<ff", 0.0, 0.0)


@pytest.mark.parametrize("bits", BITS)
def test_the_mark(bits):
    x = torch.randn(3, 11, generator=torch.Generator().manual_seed(4))
    good = encode_chunks(x, bits, non_finite="mark")
    assert torch.equal(good, encode_chunks(x, bits))
    assert not marked(good, 3).any()
    x[2, 5] = float("inf")
    buf = encode_chunks(x, bits, non_finite="mark")
    assert buf.numel() == 3 * encoded_size(11, bits) and buf.eq(0).all()  # every chunk
    assert marked(buf, 3).all()
    assert decode_chunks(buf, 3, bits=bits, numel=11).isnan().all()
    with pytest.raises(ValueError, match="chunk 0: corrupt header, bit width 0"):
        decode_chunks(buf, 3)
    one = encode(torch.tensor([1.0, float("nan")]), bits, non_finite="mark")
    assert one.eq(0).all() and marked(one).tolist() == [True]
    with pytest.raises(ValueError, match="non_finite must be one of"):
        encode(x, bits, non_finite="skip")


@pytest.mark.parametrize("bits", BITS)
def test_decode_given_bits_and_numel(bits):
    """The runtime's form: nothing read back; equal to the validated decode, and a
    chunk that is not a bits-bit encoding of numel values decodes to NaN."""
    x = torch.randn(4, 29, generator=torch.Generator().manual_seed(6))
    buf = encode_chunks(x, bits)
    checked = decode_chunks(buf, 4)
    assert torch.equal(decode_chunks(buf, 4, bits=bits, numel=29), checked)
    assert torch.equal(decode(buf[: encoded_size(29, bits)], bits=bits, numel=29), checked[0])
    rows = buf.view(4, -1).clone()
    rows[1, 0] = 3  # a corrupt bit width
    rows[3, 6:10] = torch.tensor(list(struct.pack("<f", float("nan"))), dtype=torch.uint8)  # max NaN
    out = decode_chunks(rows.reshape(-1), 4, bits=bits, numel=29)
    assert out[1].isnan().all() and out[3].isnan().all()
    assert torch.equal(out[0], checked[0]) and torch.equal(out[2], checked[2])
    with pytest.raises(ValueError, match="not 4 .*encodings of 37 values"):
        decode_chunks(buf, 4, bits=bits, numel=37)
    if bits == 1:  # 30 values take the bytes of 29: the tail tells them apart
        assert decode_chunks(buf, 4, bits=bits, numel=30).isnan().all()
    with pytest.raises(ValueError, match="bits and numel go together"):
        decode_chunks(buf, 4, bits=bits)
    with pytest.raises(ValueError, match="need chunks as an int"):
        decode_chunks(buf, [29] * 4, bits=bits, numel=29)


# ------------------------------------------------------- the Triton kernels (interpreted)


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def test_triton_kernels_under_the_interpreter():
    """The kernels of minmax_triton run on the CPU under Triton's interpreter, which
    must be on before triton is first imported: a child pytest runs the test below."""
    pytest.importorskip("triton")
    if _interpreted():
        pytest.skip("this is the child")
    from subprocesses import child_env, run_python

    env = child_env()
    env["TRITON_INTERPRET"] = "1"
    test = f"{__file__}::test_triton_kernels_write_the_torch_paths_bytes"
    code, out, err = run_python(["-m", "pytest", "-q", "-p", "no:cacheprovider", test], env=env, timeout=600)
    assert code == 0 and f"{len(BITS)} passed" in out, out + err


@pytest.mark.parametrize("bits", BITS)
def test_triton_kernels_write_the_torch_paths_bytes(monkeypatch, bits):
    """Through the public functions with the kernels in place of the torch path: the
    same bytes and values (nearest), the same refusals, the mark; stochastic rounding
    (Philox, not torch's generator) within one gap and reproducible."""
    if not _interpreted():
        pytest.skip("run under TRITON_INTERPRET=1 by test_triton_kernels_under_the_interpreter")
    from bagua_algos.compression import minmax, minmax_triton

    g = torch.Generator().manual_seed(10 + bits)
    cases = [
        torch.randn(3, 37, generator=g) * 3,
        torch.randn(2, 1001, generator=g).half(),
        torch.tensor([SEED_EXAMPLE]),
        torch.tensor([[3e38, -3e38, 0.0, 1e38, -2e38]]),  # the range overflows float32
        torch.stack([torch.full((9,), 1.5), torch.full((9,), -0.0)]),
        torch.randint(-3, 4, (2, 16), generator=g).float(),  # ties
    ]
    expected = [(encode_chunks(x, bits), decode_chunks(encode_chunks(x, bits), x.shape[0])) for x in cases]
    bad = cases[0].clone()
    bad[1, 3] = float("nan")
    monkeypatch.setattr(minmax, "_kernels", lambda t: minmax_triton)
    for x, (buf, values) in zip(cases, expected):
        rows, n = x.shape
        got = encode_chunks(x, bits)
        assert torch.equal(got, buf)
        assert torch.equal(decode_chunks(got, rows), values)
        assert torch.equal(decode_chunks(got, rows, bits=bits, numel=n), values)
        s = encode_chunks(x, bits, stochastic=True, generator=torch.Generator().manual_seed(1))
        assert torch.equal(s, encode_chunks(x, bits, stochastic=True, generator=torch.Generator().manual_seed(1)))
        assert torch.equal(s.view(rows, -1)[:, :HEADER_BYTES], buf.view(rows, -1)[:, :HEADER_BYTES])
        out = decode_chunks(s, rows).double()
        for r in range(rows):
            gap = (x[r].double().max() - x[r].double().min()) / ((1 << bits) - 1)
            assert (out[r] - x[r].double()).abs().max() <= gap * (1 + 1e-6)
    with pytest.raises(ValueError, match="chunk 1 has NaN/inf values"):
        encode_chunks(bad, bits)
    mark = encode_chunks(bad, bits, non_finite="mark")
    assert mark.eq(0).all() and mark.numel() == 3 * encoded_size(37, bits)
    assert decode_chunks(mark, 3, bits=bits, numel=37).isnan().all()


def test_triton_kernels_compile_for_an_h100():
    """Every kernel variant the codec launches compiles to sm_90 code here, with no GPU
    (the interpreter does not check what only the compiler refuses), and the kernels
    that round contain no fused multiply-add and only correctly rounded divisions."""
    pytest.importorskip("triton")
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from triton.compiler import compile as triton_compile
    except ImportError as e:
        pytest.skip(f"this Triton has no ahead-of-time compile API: {e}")
    if _interpreted():
        pytest.skip("the interpreter's kernels do not compile")
    from bagua_algos.compression import minmax_triton as kernels

    def build(fn, signature, constants, **options):
        signature = {**signature, **{name: "constexpr" for name in constants}}
        source = ASTSource(fn=fn, signature=signature, constexprs=constants)
        return triton_compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]

    for dtype in ("fp32", "fp16", "bf16", "fp64"):
        build(kernels._minmax_kernel, {"x_ptr": f"*{dtype}", "lo_ptr": "*fp32", "hi_ptr": "*fp32", "bad_ptr": "*i32",
                                       "n": "i32", "stride": "i32", "span": "i32", "parts": "i32"}, {"BLOCK": 2048})
    build(kernels._minmax_finish_kernel, {"lo_ptr": "*fp32", "hi_ptr": "*fp32", "mn_ptr": "*fp32", "mx_ptr": "*fp32",
                                          "bad_ptr": "*i32", "rows": "i32", "parts": "i32"}, {"ROWS": 16, "PARTS": 128})
    for bits, dtype in [(b, "fp32") for b in BITS] + [(8, "fp16"), (8, "bf16"), (2, "fp64")]:
        block = 4096 // (8 // bits)
        for stochastic in (False, True):
            ptx = build(kernels._encode_kernel, {
                "x_ptr": f"*{dtype}", "mn_ptr": "*fp32", "mx_ptr": "*fp32", "mark_ptr": "*i32", "seed_ptr": "*i64",
                "out_ptr": "*u8", "n": "i32", "x_stride": "i32", "out_stride": "i32", "nbytes": "i32", "tail": "i32",
            }, {"BITS": bits, "STOCHASTIC": stochastic, "BLOCK": block}, num_warps=8, enable_fp_fusion=False)
            assert "fma.rn" not in ptx and "div.full" not in ptx and "div.rn.f32" in ptx
        if dtype != "fp32":
            continue
        ptx = build(kernels._decode_kernel, {
            "buf_ptr": "*u8", "out_ptr": "*fp32", "n": "i32", "buf_stride": "i32", "out_stride": "i32",
            "nbytes": "i32", "tail": "i32",
        }, {"BITS": bits, "BLOCK": block}, num_warps=8, enable_fp_fusion=False)
        assert "fma." not in ptx and "div.full" not in ptx and "div.rn.f32" in ptx


# -------------------------------------------------------------------------- CUDA


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("bits", BITS)
def test_cuda_matches_cpu(bits):
    x = torch.randn(4, 1001, generator=torch.Generator().manual_seed(bits))
    cpu = encode_chunks(x, bits)
    gpu = encode_chunks(x.cuda(), bits)
    assert gpu.device.type == "cuda"
    # float32 division is correctly rounded on both, so the bytes agree
    assert torch.equal(gpu.cpu(), cpu)
    out = decode_chunks(gpu, 4)
    assert out.device.type == "cuda"
    # The codec's contract across devices is equal bytes; decoded values are min +
    # index * gap in float32 on both, and equal as long as no fused multiply-add rounds
    # once where the CPU rounds twice (the Triton decode turns FMA off), so: close.
    assert torch.allclose(out.cpu(), decode_chunks(cpu, 4), rtol=1e-6, atol=0)
    g = torch.Generator(device="cuda").manual_seed(0)
    s = decode(encode(x[0].cuda(), bits, stochastic=True, generator=g))
    assert s.device.type == "cuda" and (s.cpu() - x[0]).abs().max() <= gap_of(x[0], bits) * 1.001


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("bits", BITS)
def test_cuda_runtime_forms_and_the_mark(bits):
    x = torch.randn(8, 4099, generator=torch.Generator().manual_seed(bits)).cuda()
    buf = encode_chunks(x, bits, non_finite="mark")
    assert torch.equal(buf.cpu(), encode_chunks(x.cpu(), bits))
    values = decode_chunks(buf, 8, bits=bits, numel=4099)
    assert torch.allclose(values.cpu(), decode_chunks(buf.cpu(), 8), rtol=1e-6, atol=0)
    x[5, 7] = float("nan")
    mark = encode_chunks(x, bits, non_finite="mark")
    assert mark.eq(0).all().item() and marked(mark, 8).all().item()
    assert decode_chunks(mark, 8, bits=bits, numel=4099).isnan().all().item()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("stochastic", [False, True])
def test_cuda_runtime_forms_never_wait_for_the_device(stochastic):
    """What the runtime calls (non_finite="mark", decodes given bits/numel) makes no
    synchronising CUDA call: torch raises on one in sync debug mode "error"."""
    pytest.importorskip("triton")
    x = torch.randn(8, 5000, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    for bits in BITS:  # compile outside the check
        decode_chunks(encode_chunks(x, bits, stochastic=stochastic, generator=g, non_finite="mark"),
                      8, bits=bits, numel=5000)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for bits in BITS:
            buf = encode_chunks(x, bits, stochastic=stochastic, generator=g, non_finite="mark")
            marked(buf, 8)
            decode_chunks(buf, 8, bits=bits, numel=5000)
            decode(encode(x[0], bits, stochastic=stochastic, generator=g, non_finite="mark"), bits=bits, numel=5000)
    finally:
        torch.cuda.set_sync_debug_mode("default")



def test_uniforms_drawn_by_the_caller_give_the_generators_bytes():
    """encode_chunks(uniforms=U): U drawn with torch.rand((R, m), generator=g) gives the
    bytes generator=g gives (the engine's batched stochastic rounding relies on it);
    bad uniforms are refused naming the argument."""
    chunks = torch.randn(5, 301, generator=torch.Generator().manual_seed(4))
    for bits in (1, 2, 8):
        drawn = torch.rand(chunks.shape, generator=torch.Generator().manual_seed(7))
        expected = encode_chunks(chunks, bits, stochastic=True, generator=torch.Generator().manual_seed(7))
        assert torch.equal(encode_chunks(chunks, bits, stochastic=True, uniforms=drawn), expected)
    with pytest.raises(ValueError, match="stochastic=True"):
        encode_chunks(chunks, 2, uniforms=drawn)
    with pytest.raises(ValueError, match="not both"):
        encode_chunks(chunks, 2, stochastic=True, generator=torch.Generator(), uniforms=drawn)
    with pytest.raises(ValueError, match="shape"):
        encode_chunks(chunks, 2, stochastic=True, uniforms=drawn[:, :-1])
    with pytest.raises(TypeError, match="float32"):
        encode_chunks(chunks, 2, stochastic=True, uniforms=drawn.double())
