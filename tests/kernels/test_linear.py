"""Skinny decode GEMM: Triton vs F.linear."""
import pytest
import torch

from infergraft.kernels.linear import MAX_SKINNY_M, linear_torch, linear_triton, skinny_gemm

from .tolerances import assert_close


@pytest.mark.parametrize("m,n,k", [(1, 40, 72), (3, 17, 300), (16, 64, 96), (11, 33, 129)])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_gemm_matches_reference(device, dtype, randn, poisoned_empty, m, n, k, bias):
    if dtype is torch.float32 and device == "cuda":
        pytest.skip("float32 on CUDA uses tf32 in tl.dot; linear_triton routes fp32 to cuBLAS")
    x, w = randn(m, k, dtype=dtype), randn(n, k, dtype=dtype) / k ** 0.5
    b = randn(n, dtype=dtype) if bias else None
    ref = linear_torch(x.float(), w.float(), None if b is None else b.float()).to(dtype)
    out = skinny_gemm(x, w, b, config=dict(BLOCK_M=max(16, 1 << (m - 1).bit_length()),
                                           BLOCK_N=16, BLOCK_K=32, num_warps=4, num_stages=2))
    assert out.shape == (m, n)
    assert_close(out, ref, f"M={m} N={n} K={k}")


def test_linear_routes_large_m_and_fp32_to_torch(device, randn):
    x, w = randn(MAX_SKINNY_M + 1, 8), randn(5, 8)
    assert torch.equal(linear_triton(x, w), linear_torch(x, w))
    x1 = randn(2, 8)
    assert torch.equal(linear_triton(x1, w), linear_torch(x1, w))


def test_skinny_gemm_rejects_bad_shapes(device, randn):
    with pytest.raises(AssertionError, match="K=8"):
        skinny_gemm(randn(2, 8), randn(4, 9))
    with pytest.raises(AssertionError, match="rows"):
        skinny_gemm(randn(MAX_SKINNY_M + 1, 8), randn(4, 8))
