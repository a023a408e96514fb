"""layer_norm / add_layer_norm: Triton vs the torch reference."""
import pytest
import torch

from infergraft.kernels.layer_norm import (add_layer_norm_torch, add_layer_norm_triton,
                                           layer_norm_torch, layer_norm_triton)

from .tolerances import assert_close, assert_exact

SHAPES = [(4, 1), (1, 7), (3, 64), (17, 768), (3, 1000)]  # (N, H): H=1, odd, pow2, GPT-2, ragged
EPS = 1e-5


def _rows(randn, n, h, dtype, layout):
    """x: [N, H] with last dim contiguous; 'strided' rows sit inside a wider buffer.
    An offset mean (+3) makes a missing mean subtraction visible."""
    if layout == "contiguous":
        return randn(n, h, dtype=dtype) + 3
    return randn(2 * n, h + 5, dtype=dtype)[::2, 3:h + 3] + 3  # row stride 2*(H+5)


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("n,h", SHAPES)
def test_layer_norm_matches_reference(device, dtype, randn, poisoned_empty, n, h, layout):
    x = _rows(randn, n, h, dtype, layout)
    w, b = randn(h, dtype=dtype), randn(h, dtype=dtype)
    x0 = x.clone()
    out = layer_norm_triton(x, w, b, EPS)
    assert out.shape == (n, h) and out.is_contiguous()
    assert_close(out, layer_norm_torch(x, w, b, EPS), f"N={n} H={h} {dtype} {layout}")
    assert_exact(x, x0, "input modified")


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("n,h", SHAPES)
def test_add_layer_norm_matches_reference(device, dtype, randn, poisoned_empty, n, h, layout):
    x = _rows(randn, n, h, dtype, layout)
    res = _rows(randn, n, h, dtype, "strided" if layout == "contiguous" else "contiguous")
    w, b = randn(h, dtype=dtype), randn(h, dtype=dtype)
    x0, res0 = x.clone(), res.clone()
    out, hid = add_layer_norm_triton(x, res, w, b, EPS)
    ref_out, ref_hid = add_layer_norm_torch(x, res, w, b, EPS)
    # h = x + residual is one rounding of an exact sum: identical to torch's
    assert_exact(hid, ref_hid, "h = x + residual")
    assert_close(out, ref_out, f"N={n} H={h} {dtype} {layout}")
    assert hid.data_ptr() not in (x.data_ptr(), res.data_ptr())
    assert_exact(x, x0, "x modified")
    assert_exact(res, res0, "residual modified")


def test_reference_is_layer_norm(randn):
    # the reference itself against the textbook formula in float64
    x, w, b = randn(5, 33) * 4 + 1, randn(33), randn(33)
    xd = x.double()
    ref = (xd - xd.mean(-1, keepdim=True)) / torch.sqrt(xd.var(-1, unbiased=False, keepdim=True)
                                                        + EPS) * w.double() + b.double()
    torch.testing.assert_close(layer_norm_torch(x, w, b, EPS).double(), ref, atol=1e-5, rtol=1e-5)


def test_layer_norm_float32_params_promote_like_reference(device, randn, poisoned_empty):
    # half-precision x with float32 weight/bias -> float32 out, in both
    x, w, b = randn(3, 40, dtype=torch.float16), randn(40), randn(40)
    out = layer_norm_triton(x, w, b, EPS)
    assert out.dtype == torch.float32
    assert_close(out, layer_norm_torch(x, w, b, EPS))


def test_layer_norm_constant_row_gives_bias(device, randn, poisoned_empty):
    # zero variance: (x - mean) = 0 exactly, so the output is the bias
    x, w, b = torch.full((2, 24), 7.5, device=device), randn(24), randn(24)
    assert_close(layer_norm_triton(x, w, b, EPS), b.expand(2, 24).contiguous())


def test_layer_norm_empty_and_bad_inputs(device, randn):
    x, w, b = randn(4, 16), randn(16), randn(16)
    assert layer_norm_triton(randn(0, 16), w, b, EPS).shape == (0, 16)
    with pytest.raises(AssertionError, match="weight must be"):
        layer_norm_triton(x, randn(15), b, EPS)
    with pytest.raises(AssertionError, match="bias must be"):
        layer_norm_triton(x, w, randn(17), EPS)
    with pytest.raises(AssertionError, match="contiguous in its last dim"):
        layer_norm_triton(randn(16, 4).t(), w, b, EPS)
    with pytest.raises(AssertionError, match="residual dtype"):
        add_layer_norm_triton(x, x.double(), w, b, EPS)
