"""gelu_mul (the GELU-gated MLP's activation): Triton vs the torch reference, both GELU
forms, and the reference vs HF's ``act_fn(gate) * up``."""
import pytest
import torch

from infergraft.kernels.gelu_mul import gelu_mul_torch, gelu_mul_triton

from .tolerances import assert_close, assert_exact


# I = 1500 > the 1024-wide column block, so a row spans several programs
@pytest.mark.parametrize("approximate", ["gelu_tanh", "gelu"])
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("t,i", [(1, 7), (17, 500), (3, 1500)])
def test_gelu_mul_matches_reference(device, dtype, randn, poisoned_empty, t, i, layout,
                                    approximate):
    if layout == "contiguous":
        x = randn(t, 2 * i, dtype=dtype)
    else:  # rows inside a wider buffer: row stride 2I + 3
        x = randn(t, 2 * i + 3, dtype=dtype)[:, 1:2 * i + 1]
    x0 = x.clone()
    out = gelu_mul_triton(x, approximate)
    assert out.shape == (t, i) and out.is_contiguous()
    assert_close(out, gelu_mul_torch(x, approximate), f"T={t} I={i} {dtype} {layout}")
    assert_exact(x, x0, "input modified")


@pytest.mark.parametrize("hf_name,ours", [("gelu_pytorch_tanh", "gelu_tanh"), ("gelu", "gelu")])
def test_reference_is_hfs_gated_activation(hf_name, ours):
    from transformers.activations import ACT2FN

    x = 4 * torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    assert_exact(gelu_mul_torch(x, ours), ACT2FN[hf_name](x[:, :32]) * x[:, 32:])
    assert not torch.allclose(gelu_mul_torch(x, ours), torch.nn.functional.silu(x[:, :32])
                              * x[:, 32:], atol=1e-2)


def test_gelu_mul_large_gate_values_and_bad_inputs(device, randn, poisoned_empty):
    x = randn(2, 16) * 30  # saturated at both ends
    assert_close(gelu_mul_triton(x), gelu_mul_torch(x))
    assert gelu_mul_triton(randn(0, 8)).shape == (0, 4)
    with pytest.raises(AssertionError, match="even"):
        gelu_mul_triton(randn(2, 7))
    with pytest.raises(ValueError, match="unknown GELU variant"):
        gelu_mul_triton(randn(2, 8), "relu")
