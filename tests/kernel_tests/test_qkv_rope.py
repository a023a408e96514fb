"""The decode qkv GEMM with RoPE and the K/V cache write in its epilogue
(``normed_qkv_rope``) vs the composition it replaces, on fresh random inputs; 16-bit
weights, and 8-bit rows (int8, fp8 e4m3) with a scale each."""
import pytest
import torch

from infergraft.core.spec import split_qkv
from infergraft.kernels import fused_linear as FL
from infergraft.kernels.int8_linear import quantize_int8
from infergraft.kernels.rotary import rotary_kv_write_torch

from .test_fused_linear import (QUANTIZE, _each_8bit, _gemv_cfgs, _sum_sq_parts,  # noqa: F401
                                _weight, fuse_fp32)  # (fuse_fp32: a fixture)
from .test_rotary import MAX_POS, _cos_sin
from .tolerances import TOLERANCES

BLOCKS, BS = 9, 4  # cache [BLOCKS, BS, Hkv, D]: room for QKV_ROPE_MAX_ROWS + 1 tokens


def _inputs(randn, gen, device, dtype, m, hq, hkv, d, k, bias, parts, rows=None):
    """x, (weight, scale, its float32 value) as ``_weight`` draws them, bias, sum_sq
    parts, positions, idx0, idx1."""
    x = randn(m, k, dtype=dtype) * 2
    w = _weight(randn, (hq + 2 * hkv) * d, k, dtype, rows, 1 / k ** 0.5)
    b = randn(w[0].shape[0], dtype=dtype) if bias else None
    positions = torch.randint(0, MAX_POS, (m,), generator=gen).to(device)
    slots = torch.randperm(BLOCKS * BS, generator=gen)[:m]
    idx0, idx1 = slots // BS, slots % BS
    if m > 2:
        idx0[2] = -1  # a padding row: written nowhere
    return x, w, b, _sum_sq_parts(x, parts), positions, idx0.to(device), idx1.to(device)


def _reference(x, wf, b, positions, cos, sin, hq, caches, idx0, idx1, eps):
    """float32 GEMM (wf: the weight's float32 value) rounded once to x's dtype (as the
    kernel stores it), then the reference RoPE + K/V write."""
    xf = x.float()
    qkv = torch.nn.functional.linear(xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps),
                                     wf, None if b is None else b.float()).to(x.dtype)
    q, k, v = split_qkv(qkv, hq, caches[0].shape[2], caches[0].shape[3])
    return rotary_kv_write_torch(q, k, v, cos, sin, positions, *caches, idx0, idx1)


@pytest.mark.parametrize("m,hq,hkv,d,k,parts,rows", _each_8bit([
    (1, 4, 2, 64, 96, 1, None), (5, 3, 1, 32, 160, 3, None), (16, 2, 2, 64, 64, 7, None),
    (3, 3, 1, 32, 136, 2, "8"), (16, 2, 1, 64, 72, 5, "8"), (1, 2, 1, 32, 96, 1, "8")]))
@pytest.mark.parametrize("bias", [False, True])
def test_qkv_rope_matches_the_composition(device, dtype, randn, gen, poisoned_empty, fuse_fp32,
                                          monkeypatch, m, hq, hkv, d, k, parts, rows, bias):
    def unfused(*a, **kw):
        raise AssertionError("took the unfused composition")
    monkeypatch.setattr(FL, "rotary_kv_write_triton", unfused)  # the one-kernel path only
    x, (w, s, wf), b, ss, positions, idx0, idx1 = _inputs(randn, gen, device, dtype, m, hq, hkv,
                                                          d, k, bias, parts, rows)
    cos, sin = _cos_sin(d, device)
    x0 = x.clone()
    cfg = dict(BLOCK_M=max(16, 1 << (m - 1).bit_length()), BLOCK_N=16, BLOCK_K=32, num_warps=4,
               num_stages=2)  # several column and K tiles; 8-bit rows also the defaults
    tiles = (cfg, dict(cfg, SWAP=True))  # also swapped: y^T = W x^T
    for config in (tiles + (None,) if rows else tiles) + tuple(_gemv_cfgs(m, rows, k)):
        caches = [torch.full((BLOCKS, BS, hkv, d), -3.25, dtype=dtype, device=device)
                  for _ in range(4)]
        q = FL.normed_qkv_rope_triton(x, w, b, ss, 1e-5, cos, sin, positions, hq, caches[0],
                                      caches[1], idx0, idx1, s, config=config)
        q_ref = _reference(x, wf, b, positions, cos, sin, hq, caches[2:], idx0, idx1, 1e-5)
        tol = {key: 2 * v for key, v in TOLERANCES[dtype].items()}  # two ulps: rstd's rounding
        assert q.shape == (m, hq, d) and q.dtype == dtype
        for name, got, ref in (("q", q, q_ref), ("k_cache", caches[0], caches[2]),
                               ("v_cache", caches[1], caches[3])):
            torch.testing.assert_close(
                got, ref, **tol, msg=lambda e, n=name: f"{n} M={m} D={d} tiles {config}\n{e}")
        written = int((caches[1] != -3.25).any(-1).any(-1).sum())
        assert written == int((idx0 >= 0).sum())  # the padding row went nowhere
    assert torch.equal(x, x0)


def test_qkv_rope_default_tiles_and_the_unfused_fallbacks(device, randn, gen):
    """Default tiles (swapped, 64-wide of a 64-dim half-head), past 16 rows too, partial
    rotary (Phi-4-mini's 96 dims of 128 too), a head of 96 (half 48: no power-of-two
    tile divides it, so the composition takes over, one row and three), more rows than
    QKV_ROPE_MAX_ROWS (the composition again) and float32 (cuBLAS): all equal the
    reference."""
    dt = torch.float16
    for d, r, dtype, m in ((128, 128, dt, 3), (128, 128, dt, 20), (64, 32, dt, 3),
                           (128, 96, dt, 1), (96, 96, dt, 1), (96, 96, dt, 3),
                           (64, 64, torch.float32, 3), (32, 32, dt, FL.QKV_ROPE_MAX_ROWS + 1)):
        hq, hkv, k = 2, 1, 128
        x, (w, _, _), b, ss, positions, idx0, idx1 = _inputs(randn, gen, device, dtype, m, hq,
                                                              hkv, d, k, False, 2)
        cos, sin = _cos_sin(r, device)
        caches = [torch.zeros((BLOCKS, BS, hkv, d), dtype=dtype, device=device) for _ in range(4)]
        q = FL.normed_qkv_rope_triton(x, w, b, ss, 1e-6, cos, sin, positions, hq, caches[0],
                                      caches[1], idx0, idx1)
        q_ref = FL.normed_qkv_rope_torch(x, w, b, ss, 1e-6, cos, sin, positions, hq, caches[2],
                                         caches[3], idx0, idx1)
        tol = {key: 2 * v for key, v in TOLERANCES[dtype].items()}
        for got, ref in ((q, q_ref), (caches[0], caches[2]), (caches[1], caches[3])):
            torch.testing.assert_close(got, ref, **tol)


def test_qkv_rope_rejects_bad_inputs(device, randn, gen):
    dt = torch.float16
    x, (w, _, _), b, ss, positions, idx0, idx1 = _inputs(randn, gen, device, dt, 2, 2, 1, 32, 64,
                                                          False, 1)
    cos, sin = _cos_sin(32, device)
    kc = torch.zeros((BLOCKS, BS, 1, 32), dtype=dt, device=device)
    with pytest.raises(AssertionError, match="rows, not"):
        FL.normed_qkv_rope_triton(x, w[:-32], b, ss, 1e-6, cos, sin, positions, 2, kc, kc.clone(),
                                  idx0, idx1)
    with pytest.raises(AssertionError, match=r"positions must be \[2\], got \(1,\)"):
        FL.normed_qkv_rope_triton(x, w, b, ss, 1e-6, cos, sin, positions[:1], 2, kc, kc.clone(),
                                  idx0, idx1)
    with pytest.raises(AssertionError, match="cos/sin"):
        FL.normed_qkv_rope_triton(x, w, b, ss, 1e-6, cos.half(), sin.half(), positions, 2, kc,
                                  kc.clone(), idx0, idx1)
    q8, s8 = quantize_int8(w.float())
    with pytest.raises(AssertionError, match=r"scale must be contiguous float32 \[128\].*\(127,\)"):
        FL.normed_qkv_rope_triton(x, q8, b, ss, 1e-6, cos, sin, positions, 2, kc, kc.clone(),
                                  idx0, idx1, s8[:-1])


@pytest.mark.parametrize("rows", sorted(QUANTIZE))
def test_qkv_rope_8bit_default_tiles_and_the_unfused_fallbacks(device, randn, gen, rows):
    """8-bit rows (int8, e4m3), the one-kernel path with its default tiles (one row: int8's
    word loop, e4m3's tiles) and more rows than UNSWAPPED_ROPE_MAX_ROWS (8-bit tiles are
    not swapped: the fused normed GEMM + the rotary kernel), and the reference: all
    equal the float32 math on the dequantised weight, within the reference's roundings
    (normed x to float16, then the projection: two ulps). Past FUSE_MAX_ROWS it is the
    rows' own GEMM kernel, as in test_fused_scaled_rows.test_8bit_rows_off_the_fused_path."""
    dt, hq, hkv, d, k = torch.float16, 2, 1, 64, 96
    for m in (1, 3, FL.UNSWAPPED_ROPE_MAX_ROWS + 1, FL.QKV_ROPE_MAX_ROWS + 1):
        x, (q8, s, wf), b, ss, positions, idx0, idx1 = _inputs(randn, gen, device, dt, m, hq, hkv,
                                                               d, k, True, 2, rows=rows)
        cos, sin = _cos_sin(d, device)
        caches = [torch.zeros((BLOCKS, BS, hkv, d), dtype=dt, device=device) for _ in range(6)]
        q = FL.normed_qkv_rope_triton(x, q8, b, ss, 1e-6, cos, sin, positions, hq, caches[0],
                                      caches[1], idx0, idx1, s)
        q_torch = FL.normed_qkv_rope_torch(x, q8, b, ss, 1e-6, cos, sin, positions, hq,
                                           caches[2], caches[3], idx0, idx1, scale=s)
        q_ref = _reference(x, wf, b, positions, cos, sin, hq, caches[4:], idx0, idx1, 1e-6)
        tol = {key: 2 * v for key, v in TOLERANCES[dt].items()}
        for got, ref in ((q, q_ref), (caches[0], caches[4]), (caches[1], caches[5]),
                         (q_torch, q_ref), (caches[2], caches[4]), (caches[3], caches[5])):
            torch.testing.assert_close(got, ref, **tol, msg=lambda e: f"M={m}\n{e}")
