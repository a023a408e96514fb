"""silu_mul: Triton vs the torch reference."""
import pytest

from infergraft.kernels.silu_mul import silu_mul_torch, silu_mul_triton

from .tolerances import assert_close, assert_exact


# I = 1500 > the 1024-wide column block, so a row spans several programs
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("t,i", [(1, 7), (3, 64), (17, 500), (3, 1500)])
def test_silu_mul_matches_reference(device, dtype, randn, poisoned_empty, t, i, layout):
    if layout == "contiguous":
        x = randn(t, 2 * i, dtype=dtype)
    else:  # rows inside a wider buffer: row stride 2I + 3
        x = randn(t, 2 * i + 3, dtype=dtype)[:, 1:2 * i + 1]
    x0 = x.clone()
    out = silu_mul_triton(x)
    assert out.shape == (t, i) and out.is_contiguous()
    assert_close(out, silu_mul_torch(x), f"T={t} I={i} {dtype} {layout}")
    assert_exact(x, x0, "input modified")


def test_silu_mul_large_gate_values(device, randn, poisoned_empty):
    # saturated sigmoid at both ends: silu(-30) ~ -3e-12, silu(30) ~ 30
    x = randn(2, 16) * 30
    assert_close(silu_mul_triton(x), silu_mul_torch(x))


def test_silu_mul_empty_and_bad_inputs(device, randn):
    assert silu_mul_triton(randn(0, 8)).shape == (0, 4)
    with pytest.raises(AssertionError, match="even"):
        silu_mul_triton(randn(2, 7))
    with pytest.raises(AssertionError, match="contiguous in its last dim"):
        silu_mul_triton(randn(8, 2).t())
