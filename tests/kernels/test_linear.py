"""Skinny decode GEMM: Triton vs F.linear."""
import pytest
import torch

from infergraft.kernels.linear import (MAX_SKINNY_M, MAX_SPLIT_M, _tile_counters, linear_torch,
                                      linear_triton, skinny_gemm)

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


@pytest.mark.parametrize("m,n,k,split", [(1, 40, 300, 3), (5, 17, 128, 4), (33, 24, 96, 2),
                                         (2, 16, 64, 8), (64, 48, 200, 7)])
@pytest.mark.parametrize("bias", [False, True])
def test_split_k_matches_reference(device, dtype, randn, poisoned_empty, m, n, k, split, bias):
    # K split over several programs per column tile; the last to finish sums the partials
    if dtype is torch.float32 and device == "cuda":
        pytest.skip("float32 on CUDA uses tf32 in tl.dot")
    x, w = randn(m, k, dtype=dtype), randn(n, k, dtype=dtype) / k ** 0.5
    b = randn(n, dtype=dtype) if bias else None
    cfg = dict(BLOCK_M=max(16, 1 << (m - 1).bit_length()), BLOCK_N=16, BLOCK_K=32,
               num_warps=4, num_stages=2)
    out = skinny_gemm(x, w, b, config=cfg, split_k=split)
    ref = linear_torch(x.float(), w.float(), None if b is None else b.float()).to(dtype)
    assert out.shape == (m, n) and out.dtype == dtype
    assert_close(out, ref, f"M={m} N={n} K={k} S={split}")
    # deterministic (partials summed in split order whoever finishes last), and the
    # arrival counters are back at zero for the next launch
    assert torch.equal(skinny_gemm(x, w, b, config=cfg, split_k=split), out)
    assert int(_tile_counters(torch.device(device)).abs().sum()) == 0


def test_linear_routes_narrow_outputs_to_split_k(device, randn, monkeypatch):
    import infergraft.kernels.linear as linear

    calls = []
    real = linear.skinny_gemm
    monkeypatch.setattr(linear, "skinny_gemm", lambda *a: calls.append(a[-1]) or real(*a))
    narrow, wide = randn(64, 256, dtype=torch.float16), randn(9000, 256, dtype=torch.float16)
    for m in (1, MAX_SPLIT_M):  # narrow N, 16-bit, up to 64 rows: split K
        x = randn(m, 256, dtype=torch.float16)
        assert_close(linear_triton(x, narrow), linear_torch(x.float(), narrow.float()).half())
    assert calls and all(c > 1 for c in calls)
    calls.clear()
    linear_triton(randn(MAX_SPLIT_M + 1, 256, dtype=torch.float16), narrow)  # cuBLAS
    linear_triton(randn(20, 256, dtype=torch.float16), wide)  # wide N above 16 rows: cuBLAS
    assert calls == []
    linear_triton(randn(3, 256, dtype=torch.float16), wide)  # wide N, few rows: unsplit
    assert calls == [1]


def test_linear_routes_large_m_and_fp32_to_torch(device, randn):
    x, w = randn(MAX_SKINNY_M + 1, 8), randn(5, 8)
    assert torch.equal(linear_triton(x, w), linear_torch(x, w))
    x1 = randn(2, 8)
    assert torch.equal(linear_triton(x1, w), linear_torch(x1, w))


def test_skinny_gemm_rejects_bad_shapes(device, randn):
    with pytest.raises(AssertionError, match="K=8"):
        skinny_gemm(randn(2, 8), randn(4, 9))
    with pytest.raises(AssertionError, match="rows"):
        skinny_gemm(randn(MAX_SPLIT_M + 1, 8), randn(4, 8))
