"""The pure-torch orthogonalization methods PowerSGD uses (no process group)."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from bagua_algos.compression.orthogonalization import (
    METHODS,
    cholesky_qr2,
    gram_schmidt,
    householder_torch,
    orthogonalize,
    orthogonalize_batch,
    orthogonalize_batches_,
    torch_qr,
)

PURE = ["gram_schmidt", "cholesky_qr2", "torch_qr"]


def _orthonormality_error(q: torch.Tensor) -> float:
    q = q.double()
    return (q.T @ q - torch.eye(q.shape[1], dtype=torch.float64)).abs().max().item()


def _same_span(a: torch.Tensor, q: torch.Tensor) -> float:
    """Largest residual of a's columns after projecting onto span(q), relative."""
    a, q = a.double(), q.double()
    residual = a - q @ (q.T @ a)
    return (residual.norm() / a.norm().clamp_min(1e-300)).item()


@pytest.mark.parametrize("method", PURE)
@given(m=st.integers(1, 40), r=st.integers(1, 8), seed=st.integers(0, 2**16), scale=st.sampled_from([1e-6, 1.0, 1e4]))
@settings(max_examples=40, deadline=None)
def test_full_rank_gives_orthonormal_columns_spanning_the_input(method, m, r, seed, scale):
    r = min(r, m)
    a = torch.randn(m, r, generator=torch.Generator().manual_seed(seed)) * scale
    (q,) = orthogonalize([a], method)
    assert q.shape == a.shape and q.dtype == a.dtype
    assert _orthonormality_error(q) <= 1e-5
    assert _same_span(a, q) <= 1e-5


@pytest.mark.parametrize("method", PURE)
def test_zero_and_rank_deficient_give_no_nan(method):
    zero = torch.zeros(7, 3)
    deficient = torch.randn(7, 1).repeat(1, 3)  # rank 1
    with_zero_column = torch.randn(7, 3)
    with_zero_column[:, 1] = 0
    for a in (zero, deficient, with_zero_column):
        (q,) = orthogonalize([a], method)
        assert torch.isfinite(q).all()
        assert _same_span(a, q) <= 1e-5 if a.abs().sum() > 0 else True


def test_gram_schmidt_zero_matrix_is_zero():
    assert gram_schmidt(torch.zeros(2, 5, 2)).abs().max() == 0


@pytest.mark.parametrize("method", PURE)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_computes_in_float32(method, dtype):
    a = torch.randn(3, 30, 4).to(dtype)
    q = orthogonalize_batch(a, method)
    assert q.dtype == dtype
    assert _orthonormality_error(q[0].float()) <= 2e-2


def test_mixed_shapes_keep_order_and_non_contiguous_inputs_work():
    base = torch.randn(20, 12)
    inputs = [torch.randn(9, 2), base[:, ::3], torch.randn(9, 2).double(), torch.randn(5, 5)]
    assert not inputs[1].is_contiguous()
    outputs = orthogonalize(inputs, "cholesky_qr2")
    for a, q in zip(inputs, outputs):
        assert q.shape == a.shape and q.dtype == a.dtype
        assert _orthonormality_error(q) <= 1e-5
        assert _same_span(a, q) <= 1e-5


def test_methods_agree_on_the_span():
    a = torch.randn(4, 50, 3, dtype=torch.float64)
    spans = [fn(a) for fn in (gram_schmidt, cholesky_qr2, torch_qr)]
    for q in spans[1:]:
        # Same column space: the projectors agree.
        assert torch.allclose(q @ q.transpose(1, 2), spans[0] @ spans[0].transpose(1, 2), atol=1e-10)


def test_householder_falls_back_or_matches_torch_qr():
    a = torch.randn(3, 16, 2)
    q = orthogonalize_batch(a, "householder")
    assert _orthonormality_error(q[1]) <= 1e-5
    assert _same_span(a[1], q[1]) <= 1e-5


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: orthogonalize([torch.randn(3, 2)], "qr"), "orthogonalization must be one of"),
        (lambda: orthogonalize([torch.randn(2, 3)]), "no more columns than rows"),
        (lambda: orthogonalize([torch.randn(3)]), r"matrices\[0\] must be a 2-D"),
        (lambda: orthogonalize([torch.randn(3, 2)], epsilon=-1.0), "epsilon must be a finite number"),
        (lambda: orthogonalize_batch(torch.randn(3, 2)), "batch must be a 3-D"),
    ],
)
def test_bad_input_is_named(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_methods_listed():
    assert set(METHODS) == {"auto", "gram_schmidt", "cholesky_qr2", "torch_qr", "householder"}


# --- several batches in one call, in place (PowerSGD's P factors) ---------------------------
@pytest.mark.parametrize("method", PURE + ["auto"])
def test_batches_in_place_equal_one_batch_at_a_time(method):
    g = torch.Generator().manual_seed(3)
    p_flat = torch.randn(3 * 30 * 2 + 2 * 12 * 2 + 1 * 9 * 1, generator=g)
    shapes = [(3, 30, 2), (2, 12, 2), (1, 9, 1)]
    batches, offset = [], 0
    for b, m, r in shapes:
        batches.append(p_flat[offset : offset + b * m * r].view(b, m, r))
        offset += b * m * r
    expected = [orthogonalize_batch(batch, method) for batch in batches]
    assert orthogonalize_batches_(batches, method) == batches
    for batch, want in zip(batches, expected):  # written into the shared buffer's views
        assert torch.equal(batch, want)


def test_batches_refuse_bad_input():
    with pytest.raises(ValueError, match=r"batches\[1\] must hold m × r matrices with r ≤ m"):
        orthogonalize_batches_([torch.randn(1, 4, 2), torch.randn(1, 2, 4)])
    with pytest.raises(ValueError, match=r"batches\[0\] must be a 3-D"):
        orthogonalize_batches_([torch.randn(4, 2)])
    with pytest.raises(ValueError, match="orthogonalization must be one of"):
        orthogonalize_batches_([torch.randn(1, 4, 2)], "qr")


@given(m=st.integers(1, 40), r=st.integers(1, 6), seed=st.integers(0, 2**16), scale=st.sampled_from([1e-20, 1.0, 1e20]))
@settings(max_examples=40, deadline=None)
def test_householder_torch_is_lapacks_q(m, r, seed, scale):
    """The torch twin of cuda_ext's Householder QR has LAPACK's sign convention: on a
    full-rank input its Q is torch.linalg.qr's, to rounding."""
    r = min(r, m)
    a = torch.randn(2, m, r, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale
    q = householder_torch(a)
    torch.testing.assert_close(q, torch.linalg.qr(a).Q, rtol=0, atol=1e-10)
    q32 = householder_torch(a.float())
    assert q32.dtype == torch.float32 and _orthonormality_error(q32[0]) <= 1e-5


def test_householder_torch_zero_columns_become_unit_columns():
    a = torch.randn(1, 9, 3)
    a[0, :, 1] = 0
    (q,) = householder_torch(a)
    assert torch.isfinite(q).all() and _orthonormality_error(q) <= 1e-5 and _same_span(a[0], q) <= 1e-5
    assert torch.equal(householder_torch(torch.zeros(2, 5, 3)), torch.eye(5, 3).expand(2, 5, 3))


def test_auto_runs_linalg_qr_from_wide_rank_on_every_device():
    """r >= WIDE_RANK: "auto" is torch.linalg.qr on CPU and GPU (the compiled per-matrix
    QR falls behind there); below it the rule is unchanged. A mixed call keeps the order."""
    from bagua_algos.compression import orthogonalization as o

    for device in ("cpu", "cuda"):
        assert o._resolve("auto", {torch.device(device)}, o.WIDE_RANK) == "torch_qr"
        assert o._resolve("auto", {torch.device(device)}, 64) == "torch_qr"
    assert o._resolve("auto", {torch.device("cuda")}, o.WIDE_RANK - 1) == "householder"
    g = torch.Generator().manual_seed(0)
    mats = [torch.randn(40, 4, generator=g), torch.randn(70, 20, generator=g), torch.randn(40, 4, generator=g)]
    for q, m in zip(o.orthogonalize(mats, "auto"), mats):
        assert q.shape == m.shape
        torch.testing.assert_close(q.T @ q, torch.eye(m.shape[1]), atol=1e-5, rtol=0)
        torch.testing.assert_close(q @ (q.T @ m), m, atol=1e-4, rtol=0)
    wide = torch.randn(2, 70, 20, generator=g)
    expected = torch.stack([torch.linalg.qr(b)[0] for b in wide])
    batches = [torch.randn(3, 40, 4, generator=g), wide.clone()]
    o.orthogonalize_batches_(batches, "auto")
    torch.testing.assert_close(batches[1].abs(), expected.abs(), atol=1e-5, rtol=0)
