"""The int4 decode GEMV (kernels/int4_gemv.py) and the paths ``int4_linear_triton``
dispatches to, against ``int4_linear_torch`` on fresh random inputs: 1..8 rows, tiles
spanning several groups or a fraction of one, a partial last group, odd K, N not a
multiple of the tile, split-K, bias, leading dims, no rows."""
import types

import pytest
import torch

from infergraft.kernels import int4_linear as IL
from infergraft.kernels.int4_gemv import MAX_ROWS, gemv_config, int4_gemv_triton
from infergraft.kernels.int4_linear import (dequantize_float, int4_config, int4_linear_torch,
                                            int4_linear_triton, quantize_int4)

from .tolerances import TOLERANCES


def _weight(randn, n, k, group_size):
    p = quantize_int4(randn(n, k) / k ** 0.5, group_size)
    return p.qweight, p.scales, p.zeros, group_size, k


def _gemv(bn, bk, split, warps=4):
    return dict(PATH="gemv", BLOCK_N=bn, BLOCK_K=bk, SPLIT=split, num_warps=warps,
                num_stages=1, EARLY=True)


# m, n, k, group, BLOCK_N, BLOCK_K, SPLIT: BLOCK_K above, at and below the group; K of
# one tile, of a partial last group (576 = 4.5 x 128), odd (577); N past the last tile
CASES = [
    (1, 40, 64, 32, 16, 32, 1),
    (1, 33, 577, 128, 16, 256, 2),
    (2, 17, 576, 128, 16, 64, 4),
    (3, 24, 1000, 64, 4, 512, 3),
    (4, 40, 128, 128, 32, 128, 1),
    (5, 9, 577, 32, 8, 1024, 1),
    (6, 33, 1000, 128, 64, 256, 2),
    (7, 16, 64, 64, 16, 32, 2),
    (8, 40, 576, 64, 64, 256, 3),
]


@pytest.mark.parametrize("m,n,k,group_size,bn,bk,split", CASES)
def test_gemv_matches_reference(device, dtype, randn, poisoned_empty, m, n, k, group_size,
                                bn, bk, split):
    x = randn(m, k, dtype=dtype)
    args = _weight(randn, n, k, group_size)
    b = randn(n, dtype=dtype) if m % 2 else None  # odd M with a bias, even without
    ref = int4_linear_torch(x, *args, b)
    for config in (_gemv(bn, bk, split), gemv_config(m, n, k, group_size)):
        out = int4_linear_triton(x, *args, b, config=config)
        assert out.shape == (m, n) and out.dtype == dtype
        torch.testing.assert_close(out, ref, **TOLERANCES[dtype], msg=lambda e: f"{config}\n{e}")


@pytest.mark.parametrize("m,k,split", [(1, 1000, 3), (5, 577, 4)])
def test_split_k_partials_are_each_splits_product(device, randn, m, k, split):
    """partials=True: float32 [S, M, N], split s the product over its own K tiles (no
    bias); their sum in order is what the reduce kernel rounds."""
    x = randn(m, k)
    q, s, z, gs, _ = _weight(randn, 24, k, 64)
    parts = int4_gemv_triton(x, q, s, z, gs, k, config=_gemv(16, 128, split), partials=True)
    tiles = -(-k // 128)
    per = -(-tiles // split)
    assert parts.dtype == torch.float32 and parts.shape == (-(-tiles // per), m, 24)
    w = dequantize_float(q, s, z, gs, k)
    for i in range(parts.shape[0]):
        cols = slice(i * per * 128, min((i + 1) * per * 128, k))
        torch.testing.assert_close(parts[i], x[:, cols] @ w[:, cols].T, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(parts.sum(0), int4_linear_torch(x, q, s, z, gs, k),
                               atol=1e-5, rtol=1e-5)


def test_leading_dims_and_no_rows(device, randn):
    dt = torch.float16
    args = _weight(randn, 24, 100, 32)
    x = randn(2, 3, 100, dtype=dt)  # 6 rows on the GEMV
    out = int4_linear_triton(x, *args, config=_gemv(8, 64, 2))
    assert out.shape == (2, 3, 24)
    torch.testing.assert_close(out, int4_linear_torch(x, *args), **TOLERANCES[dt])
    for empty in (randn(0, 100, dtype=dt), randn(2, 0, 100, dtype=dt)):
        out = int4_linear_triton(empty, *args)
        assert out.shape == (*empty.shape[:-1], 24) and out.dtype == dt
    with pytest.raises(AssertionError, match=f"takes 1..{MAX_ROWS} rows"):
        int4_linear_triton(randn(MAX_ROWS + 1, 100, dtype=dt), *args, config=_gemv(8, 64, 1))
    with pytest.raises(AssertionError, match="config PATH 'fast'"):
        int4_linear_triton(x, *args, config=dict(PATH="fast"))


def test_int4_config_paths_by_rows():
    """One row: the GEMV; up to WIDEN_MIN_ROWS: the tensor-core tiles (BLOCK_K inside a
    group); from there on the widened weight."""
    for gs in (32, 64, 128):
        assert int4_config(1, 4096, 4096, gs)["PATH"] == "gemv"
        for m in range(IL.GEMV_MAX_ROWS + 1, IL.WIDEN_MIN_ROWS, 37):
            cfg = int4_config(m, 4096, 576, gs)
            assert cfg["PATH"] == "tiles" and gs % cfg["BLOCK_K"] == 0
            assert cfg["BLOCK_M"] >= min(16, m) and cfg["SPLIT"] >= 1
        assert int4_config(IL.WIDEN_MIN_ROWS, 4096, 4096, gs)["PATH"] == "widen"
    assert IL.GEMV_MAX_ROWS <= MAX_ROWS


@pytest.mark.parametrize("dt", [torch.float32, torch.float16])
def test_default_paths_and_the_widened_weight(device, randn, monkeypatch, dt):
    """Each row count takes its path by default (the widening threshold lowered): the
    widened W is dequantize_float rounded to x's dtype, bit for bit, and cuBLAS's
    product with it is the matmul in x's dtype of that W."""
    real, widened = torch.nn.functional.linear, []

    def spy(x, w, b=None):
        widened.append(w)
        return real(x, w, b)

    q, s, z, gs, k = _weight(randn, 20, 129, 64)
    b = randn(20, dtype=dt)
    xs = [randn(m, k, dtype=dt) for m in (1, 3, 6)]  # gemv, tiles, widen
    w16 = dequantize_float(q, s, z, gs, k).to(dt)  # what the widened path multiplies by
    refs = [int4_linear_torch(x, q, s, z, gs, k, b) for x in xs[:2]]
    refs.append(real(xs[2].float(), w16.float(), b.float()).to(dt))
    monkeypatch.setattr(IL, "WIDEN_MIN_ROWS", 6)
    monkeypatch.setattr(IL, "F", types.SimpleNamespace(linear=spy))
    for x, ref in zip(xs, refs):
        torch.testing.assert_close(int4_linear_triton(x, q, s, z, gs, k, b), ref,
                                   **TOLERANCES[dt])
    assert len(widened) == 1 and widened[0].dtype == dt
    assert torch.equal(widened[0], w16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_split_k_gemv_and_tiles_replay_in_a_cuda_graph():
    """Split-K's partials and reduce are captured with no host sync; a replay on new x
    gives what an eager call gives."""
    from infergraft.core.runner.cuda_graph import capture_graph

    gen = torch.Generator().manual_seed(0)
    p = quantize_int4(torch.randn(4096, 4096, generator=gen).cuda() / 64, 128)
    args = (p.qweight, p.scales, p.zeros, 128, 4096)
    for m, cfg in ((1, _gemv(16, 256, 4)), (8, dict(int4_config(8, 4096, 4096, 128), SPLIT=4))):
        x = torch.randn(m, 4096, generator=gen).cuda().bfloat16()
        graph, out = capture_graph(lambda: int4_linear_triton(x, *args, config=cfg))
        x.copy_(torch.randn(m, 4096, generator=gen).bfloat16())
        graph.replay()
        torch.testing.assert_close(out, int4_linear_triton(x, *args, config=cfg), atol=0, rtol=0)
        torch.testing.assert_close(out, int4_linear_torch(x, *args), **TOLERANCES[torch.bfloat16])
