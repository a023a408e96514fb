"""rms_norm / add_rms_norm: Triton vs the torch reference."""
import pytest
import torch

from infergraft.kernels.rms_norm import (add_rms_norm_torch, add_rms_norm_triton,
                                         rms_norm_torch, rms_norm_triton, sum_partials)

from .tolerances import assert_close, assert_exact

SHAPES = [(1, 7), (3, 64), (17, 576), (3, 1000)]  # (N, H): odd, pow2, model-like, ragged
EPS = 1e-6


def _rows(randn, n, h, dtype, layout):
    """x: [N, H] with last dim contiguous; 'strided' rows sit inside a wider buffer."""
    if layout == "contiguous":
        return randn(n, h, dtype=dtype)
    return randn(2 * n, h + 5, dtype=dtype)[::2, 3:h + 3]  # row stride 2*(H+5)


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("n,h", SHAPES)
def test_rms_norm_matches_reference(device, dtype, randn, poisoned_empty, n, h, layout):
    x = _rows(randn, n, h, dtype, layout)
    w = randn(h, dtype=dtype)
    x0 = x.clone()
    out = rms_norm_triton(x, w, EPS)
    assert out.shape == (n, h) and out.is_contiguous()
    assert_close(out, rms_norm_torch(x, w, EPS), f"N={n} H={h} {dtype} {layout}")
    assert_exact(x, x0, "input modified")


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("n,h", SHAPES)
def test_add_rms_norm_matches_reference(device, dtype, randn, poisoned_empty, n, h, layout):
    x = _rows(randn, n, h, dtype, layout)
    res = _rows(randn, n, h, dtype, "strided" if layout == "contiguous" else "contiguous")
    w = randn(h, dtype=dtype)
    x0, res0 = x.clone(), res.clone()
    out, hid = add_rms_norm_triton(x, res, w, EPS)
    ref_out, ref_hid = add_rms_norm_torch(x, res, w, EPS)
    # h = x + residual is one rounding of an exact sum: identical to torch's
    assert_exact(hid, ref_hid, "h = x + residual")
    assert_close(out, ref_out, f"N={n} H={h} {dtype} {layout}")
    assert hid.data_ptr() not in (x.data_ptr(), res.data_ptr())
    assert_exact(x, x0, "x modified")
    assert_exact(res, res0, "residual modified")


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("n,h", [(3, 64), (3, 1000)])
def test_unit_offset_is_gemmas_norm(device, dtype, randn, poisoned_empty, n, h, residual):
    """unit_offset: scale by 1 + w in float32 and round once (Gemma2RMSNorm), with or
    without the residual add; the reference is Gemma's own arithmetic."""
    x, res, w = randn(n, h, dtype=dtype), randn(n, h, dtype=dtype), 0.3 * randn(h, dtype=dtype)
    if residual:
        out, hid = add_rms_norm_triton(x, res, w, EPS, unit_offset=True)
        ref_out, ref_hid = add_rms_norm_torch(x, res, w, EPS, unit_offset=True)
        assert_exact(hid, ref_hid, "h = x + residual")
        x = ref_hid
    else:
        out, ref_out = rms_norm_triton(x, w, EPS, True), rms_norm_torch(x, w, EPS, unit_offset=True)
    assert_close(out, ref_out, f"N={n} H={h} {dtype} residual={residual}")
    xf = x.float()
    gemma = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * (1.0 + w.float()))
    assert_exact(ref_out, gemma.to(dtype), "Gemma2RMSNorm's arithmetic")
    assert not torch.allclose(ref_out.float(), rms_norm_torch(x, w, EPS).float(), atol=1e-2)


@pytest.mark.parametrize("parts", [1, 2, 4])
@pytest.mark.parametrize("n,h", [(1, 64), (5, 576)])
def test_add_rms_norm_sums_split_k_partials(device, dtype, randn, poisoned_empty, parts, n, h):
    # x as float32 partial sums [S, N, H] of a split-K GEMM: added in order, rounded to the
    # residual's dtype, then the residual is added, as if the GEMM had stored its output
    partials = randn(parts, n, h) * 2
    res, w = randn(n, h, dtype=dtype), randn(h, dtype=dtype)
    out, hid = add_rms_norm_triton(partials, res, w, EPS)
    ref_out, ref_hid = add_rms_norm_torch(partials, res, w, EPS)
    assert hid.dtype == dtype and out.dtype == dtype and out.shape == (n, h)
    assert_exact(hid, ref_hid, "h = sum(partials) + residual")
    assert_close(out, ref_out, f"S={parts} N={n} H={h}")
    unsplit = add_rms_norm_torch(sum_partials(partials, dtype), res, w, EPS)
    assert_exact(ref_hid, unsplit[1], "reference: partials == their rounded sum")
    with pytest.raises(AssertionError, match="float32"):
        add_rms_norm_triton(partials.to(dtype) if dtype != torch.float32 else partials.double(),
                            res, w, EPS)


def test_rms_norm_float32_weight_promotes_like_reference(device, randn, poisoned_empty):
    # weight * x in the reference promotes: half-precision x with float32 weight -> float32
    x, w = randn(3, 40, dtype=torch.float16), randn(40)
    out = rms_norm_triton(x, w, EPS)
    assert_close(out, rms_norm_torch(x, w, EPS))


def test_rms_norm_empty_rows(device, randn):
    x, w = randn(0, 64), randn(64)
    assert rms_norm_triton(x, w, EPS).shape == (0, 64)


def test_rms_norm_rejects_bad_inputs(device, randn):
    x = randn(4, 16)
    with pytest.raises(AssertionError, match="weight must be"):
        rms_norm_triton(x, randn(15), EPS)
    with pytest.raises(AssertionError, match="contiguous in its last dim"):
        rms_norm_triton(randn(16, 4).t(), randn(16), EPS)
    with pytest.raises(AssertionError, match="residual dtype"):
        add_rms_norm_triton(x, x.double(), randn(16), EPS)
