"""Skinny decode GEMM: Triton vs F.linear."""
import pytest
import torch

from infergraft.kernels.linear import (MAX_ROWS, MAX_SKINNY_M, linear_torch, linear_triton,
                                      skinny_gemm)
from infergraft.kernels.linear_partials import linear_partials_triton

from infergraft.kernels.gemv import gemv_config

from .tolerances import TOLERANCES, assert_close


@pytest.mark.parametrize("m,n,k", [(1, 40, 72), (3, 17, 300), (16, 64, 96), (11, 33, 129)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("swap", [False, True])
def test_skinny_gemm_matches_reference(device, dtype, randn, poisoned_empty, m, n, k, bias, swap):
    if dtype is torch.float32 and device == "cuda":
        pytest.skip("float32 on CUDA uses tf32 in tl.dot; linear_triton routes fp32 to cuBLAS")
    x, w = randn(m, k, dtype=dtype), randn(n, k, dtype=dtype) / k ** 0.5
    b = randn(n, dtype=dtype) if bias else None
    ref = linear_torch(x.float(), w.float(), None if b is None else b.float()).to(dtype)
    cfg = dict(BLOCK_M=max(16, 1 << (m - 1).bit_length()), BLOCK_N=16, BLOCK_K=32,
               num_warps=4, num_stages=2, SWAP=swap)  # SWAP: y^T = W x^T
    out = skinny_gemm(x, w, b, config=cfg)
    assert out.shape == (m, n)
    assert_close(out, ref, f"M={m} N={n} K={k} {cfg}")
    if dtype is not torch.float32 and m > 1:  # the default tiles (swapped where they won)
        assert_close(skinny_gemm(x, w, b), ref, f"M={m} N={n} K={k} default tiles")


@pytest.mark.parametrize("n,k", [(40, 72), (33, 300), (8, 16)])
@pytest.mark.parametrize("depth,early", [(1, True), (2, False)])
def test_one_row_register_loop_matches_reference(device, dtype, randn, poisoned_empty, n, k,
                                                 depth, early):
    """kernels/gemv.py's loop (FMAs in float32, so float32 on CUDA too): several K tiles,
    a partial last one, fewer K than one tile, N not a multiple of the tile."""
    x, w = randn(1, k, dtype=dtype), randn(n, k, dtype=dtype) / k ** 0.5
    b = randn(n, dtype=dtype)
    ref = linear_torch(x.float(), w.float(), b.float()).to(dtype)
    cfg = dict(gemv_config("down"), BLOCK_N=16, BLOCK_K=32, DEPTH=depth, EARLY=early)
    out = skinny_gemm(x, w, b, config=cfg)
    assert out.shape == (1, n)
    assert_close(out, ref, f"N={n} K={k} {cfg}")
    assert skinny_gemm(x, w, b).shape == (1, n)  # the default one-row tiles
    torch.testing.assert_close(skinny_gemm(x, w, b), ref, **TOLERANCES[dtype])


@pytest.mark.parametrize("m,n,k,split", [(1, 40, 300, 3), (5, 17, 128, 4), (33, 24, 96, 2),
                                         (2, 16, 64, 8)])
@pytest.mark.parametrize("bias", [False, True])
def test_split_k_partials_sum_to_the_product(device, dtype, randn, poisoned_empty, m, n, k,
                                             split, bias):
    if dtype is torch.float32 and device == "cuda":
        pytest.skip("float32 on CUDA uses tf32 in tl.dot")
    x, w = randn(m, k, dtype=dtype), randn(n, k, dtype=dtype) / k ** 0.5
    b = randn(n, dtype=dtype) if bias else None
    cfg = dict(BLOCK_M=max(16, 1 << (m - 1).bit_length()), BLOCK_N=16, BLOCK_K=32,
               num_warps=4, num_stages=2, SWAP=m % 2 == 1)  # swapped tiles split too
    parts = skinny_gemm(x, w, b, config=cfg, split_k=split)
    tiles = -(-k // 32)
    per = -(-tiles // split)  # whole K tiles per split; trailing empty splits are dropped
    assert parts.dtype == torch.float32 and parts.shape == (-(-tiles // per), m, n)
    ref = linear_torch(x.float(), w.float(), None if b is None else b.float())
    torch.testing.assert_close(parts.sum(0), ref, atol=1e-3 if dtype is torch.float32 else 2e-2,
                               rtol=1e-3)
    # each split is the product over its own K range (the bias only in split 0)
    lo, hi = per * 32, min(2 * per * 32, k)
    if parts.shape[0] > 1:
        torch.testing.assert_close(parts[1], linear_torch(x[:, lo:hi].float(), w[:, lo:hi].float()),
                                   atol=1e-3 if dtype is torch.float32 else 2e-2, rtol=1e-3)


def test_linear_partials_routes(device, randn):
    w = randn(64, 256, dtype=torch.float16)
    for m in (MAX_SKINNY_M + 1, MAX_ROWS):  # narrow N, 16-bit, 17..64 rows: split-K partials
        out = linear_partials_triton(randn(m, 256, dtype=torch.float16), w)
        assert out.dim() == 3 and out.dtype == torch.float32 and out.shape[1:] == (m, 64)
    assert linear_partials_triton(randn(1, 256, dtype=torch.float16), w).dim() == 2  # unsplit
    assert linear_partials_triton(randn(MAX_ROWS + 1, 256, dtype=torch.float16), w).dim() == 2
    assert linear_partials_triton(randn(2, 256), w.float()).dim() == 2  # float32: cuBLAS


def test_linear_routes_large_m_and_fp32_to_torch(device, randn):
    x, w = randn(MAX_SKINNY_M + 1, 8), randn(5, 8)
    assert torch.equal(linear_triton(x, w), linear_torch(x, w))
    x1 = randn(2, 8)
    assert torch.equal(linear_triton(x1, w), linear_torch(x1, w))


def test_skinny_gemm_rejects_bad_shapes(device, randn):
    with pytest.raises(AssertionError, match="K=8"):
        skinny_gemm(randn(2, 8), randn(4, 9))
    with pytest.raises(AssertionError, match="rows"):
        skinny_gemm(randn(MAX_ROWS + 1, 8), randn(4, 8))
