"""gelu (tanh approximation and exact erf form): Triton vs the torch reference."""
import math

import pytest
import torch

from infergraft.kernels.gelu import gelu_torch, gelu_triton

from .tolerances import assert_close, assert_exact

VARIANTS = ["gelu_tanh", "gelu"]


# I = 1500 > the 1024-wide column block, so a row spans several programs
@pytest.mark.parametrize("approximate", VARIANTS)
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("t,i", [(4, 1), (1, 7), (3, 64), (17, 500), (3, 1500)])
def test_gelu_matches_reference(device, dtype, randn, poisoned_empty, t, i, layout, approximate):
    if layout == "contiguous":
        x = randn(t, i, dtype=dtype) * 3
    else:  # rows inside a wider buffer: row stride I + 3
        x = (randn(t, i + 3) * 3).to(dtype)[:, 1:i + 1]
    x0 = x.clone()
    out = gelu_triton(x, approximate)
    assert out.shape == (t, i) and out.is_contiguous() and out.dtype == dtype
    assert_close(out, gelu_torch(x, approximate), f"T={t} I={i} {dtype} {layout} {approximate}")
    assert_exact(x, x0, "input modified")


@pytest.mark.parametrize("approximate", VARIANTS)
def test_gelu_saturates(device, approximate, poisoned_empty):
    # far tails: gelu(-30) ~ 0 (no NaN from overflowing exp/tanh), gelu(30) ~ 30
    x = torch.tensor([[-30.0, -8.0, -1e-3, 0.0, 1e-3, 8.0, 30.0]], device=device)
    out = gelu_triton(x, approximate)
    assert torch.isfinite(out).all()
    assert_close(out, gelu_torch(x, approximate))


def test_reference_variants_are_the_hf_formulas():
    x = torch.linspace(-6, 6, 241, dtype=torch.float64)
    # HF gelu_new (NewGELUActivation), GPT-2's activation
    new = 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    exact = 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))
    torch.testing.assert_close(gelu_torch(x.float(), "gelu_tanh").double(), new, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(gelu_torch(x.float(), "gelu").double(), exact, atol=1e-6, rtol=1e-6)
    assert (new - exact).abs().max() > 1e-4  # the two variants really differ


def test_gelu_empty_and_bad_inputs(device, randn):
    assert gelu_triton(randn(0, 8), "gelu_tanh").shape == (0, 8)
    with pytest.raises(ValueError, match="unknown GELU variant"):
        gelu_triton(randn(2, 8), "tanh")
    with pytest.raises(ValueError, match="unknown GELU variant"):
        gelu_torch(randn(2, 8), "relu")
    with pytest.raises(AssertionError, match="contiguous in its last dim"):
        gelu_triton(randn(8, 2).t(), "gelu")
