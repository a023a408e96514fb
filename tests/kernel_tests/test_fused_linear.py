"""Decode GEMMs fused with the residual add, the (folded) RMSNorm and SwiGLU, vs the torch
compositions on fresh random inputs; 16-bit weights, and 8-bit rows with a scale each (int8,
fp8 e4m3). What only 8-bit rows do (tiles, the int8 word loop, fallbacks, bad scales):
test_fused_scaled_rows.py."""
import pytest
import torch

from infergraft.kernels import fused_linear as FL
from infergraft.kernels.fp8_linear import quantize_fp8
from infergraft.kernels.gemv import gemv_config
from infergraft.kernels.int8_linear import quantize_int8

from .tolerances import TOLERANCES

QUANTIZE = {"int8": quantize_int8, "fp8": quantize_fp8}  # 8-bit rows, a float32 scale each

SMALL = dict(BLOCK_N=16, BLOCK_K=32, num_warps=4, num_stages=2)  # several tiles each way


def _cfg(m):
    return dict(BLOCK_M=max(16, 1 << (m - 1).bit_length()), **SMALL)


@pytest.fixture
def fuse_fp32(monkeypatch, device, dtype):
    """float32 normally goes to cuBLAS; in the interpreter (exact float32 dots) run the
    kernel itself in float32 too, where a logic slip cannot hide in rounding."""
    if dtype is torch.float32:
        if device == "cuda":
            pytest.skip("float32 on CUDA uses tf32 in tl.dot; the entry points route it to cuBLAS")
        monkeypatch.setattr(FL, "_fusable", lambda x, *_: 0 < x.shape[0] <= FL.FUSE_MAX_ROWS)


def _weight(randn, n, k, dtype, rows, mul):
    """(weight, scale, its float32 value): randn(n, k) * mul in ``dtype`` and no scale
    (``rows`` None), or 8-bit rows of a float32 draw (``rows`` "int8" or "fp8":
    [n, k], scale [n]) and their dequantised value."""
    if not rows:
        w = randn(n, k, dtype=dtype) * mul
        return w, None, w.float()
    q, s = QUANTIZE[rows](randn(n, k) * mul)
    return q, s, q.float() * s[:, None]


def _gemv_cfgs(m, rows=None, k=0):
    """At one row, the register loop (kernels/gemv.py) with small tiles, at both depths;
    int8 rows (K a multiple of 4): the word loop, one tile ahead, both PDL releases; e4m3
    rows: none (they take the tiles)."""
    if m != 1 or rows == "fp8" or (rows and k % 4):
        return []
    if rows:
        return [dict(gemv_config("o"), BLOCK_N=16, BLOCK_K=32, DEPTH=1, EARLY=early)
                for early in (True, False)]
    return [dict(gemv_config("o"), BLOCK_N=16, BLOCK_K=32, DEPTH=depth, EARLY=depth == 1)
            for depth in (1, 2)]


def _configs(m, rows, k=0):
    """Small tiles (several K and column tiles), also swapped (y^T = W x^T); 8-bit rows
    also the default tiles; one row also the register loop (int8: the word loop)."""
    small = (_cfg(m), dict(_cfg(m), SWAP=True))
    return (small + (None,) if rows else small) + tuple(_gemv_cfgs(m, rows, k))


def _each_8bit(cases):
    """16-bit ``cases`` as they are; 8-bit ones (the last field "8") once for int8 and once
    for fp8 rows."""
    return [c for c in cases if c[-1] is None] + [
        (*c[:-1], rows) for rows in QUANTIZE for c in cases if c[-1] == "8"]


def _close(out, ref32, what):
    """ref32: float32 math; the fused kernel rounds fewer intermediates than the reference
    in ``out``'s dtype does, so allow two of its ulps."""
    tol = {k: 2 * v for k, v in TOLERANCES[out.dtype].items()}
    torch.testing.assert_close(out.float(), ref32, **tol, msg=lambda m: f"{what}\n{m}")


def _sum_sq_parts(x, parts):
    """x's sum of squares per row split into ``parts`` partial sums [P, M] (as the
    producing GEMM's programs leave them)."""
    cols = torch.tensor_split(torch.arange(x.shape[1]), parts)
    return torch.stack([x[:, c].float().square().sum(-1) for c in cols]).contiguous()


@pytest.mark.parametrize("m,n,k,parts,rows", _each_8bit([
    (1, 40, 72, 1, None), (3, 17, 300, 5, None), (16, 64, 96, 19, None), (2, 23, 136, 2, "8"),
    (20, 48, 70, 4, "8"), (1, 40, 72, 1, "8"), (1, 24, 70, 2, "8")]))
@pytest.mark.parametrize("bias", [False, True])
def test_normed_linear(device, dtype, randn, poisoned_empty, fuse_fp32, m, n, k, parts, rows,
                       bias):
    x = randn(m, k, dtype=dtype) * 3
    w, s, wf = _weight(randn, n, k, dtype, rows, 1 / k ** 0.5)
    b = randn(n, dtype=dtype) if bias else None
    xf = x.float()
    ref = torch.nn.functional.linear(xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-5),
                                     wf, None if b is None else b.float())
    for cfg in _configs(m, rows, k):
        out = FL.normed_linear_triton(x, w, b, _sum_sq_parts(x, parts), 1e-5, s, config=cfg)
        assert out.shape == (m, n) and out.dtype == dtype
        _close(out, ref, f"M={m} N={n} K={k} rows={rows} tiles {cfg}")


def _swiglu_rounded_like_the_kernel(x, w, b, eps, dtype):
    """float32 math with the kernel's roundings to ``dtype`` (gate and up; silu):
    silu(g) * u cancels, so rounding other intermediates (as the composed reference
    does) lands several ulps away, either way. The float32 case checks the math."""
    i = w.shape[0] // 2
    acc = (x @ w.T) * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    acc = acc + (0 if b is None else b)
    gate, up = acc[:, :i].to(dtype).float(), acc[:, i:].to(dtype).float()
    return (gate * torch.sigmoid(gate)).to(dtype).float() * up


@pytest.mark.parametrize("m,i,k,parts,rows", _each_8bit([
    (1, 40, 72, 1, None), (5, 24, 130, 3, None), (16, 33, 64, 8, None), (3, 20, 100, 2, "8"),
    (13, 37, 300, 6, "8"), (1, 20, 100, 2, "8")]))
@pytest.mark.parametrize("bias", [False, True])
def test_normed_swiglu(device, dtype, randn, poisoned_empty, fuse_fp32, m, i, k, parts, rows,
                       bias):
    x = randn(m, k, dtype=dtype)
    w, s, wf = _weight(randn, 2 * i, k, dtype, rows, 2 / k ** 0.5)  # gate | up
    b = randn(2 * i, dtype=dtype) if bias else None
    ref = _swiglu_rounded_like_the_kernel(x.float(), wf, None if b is None else b.float(),
                                          1e-6, dtype)
    for cfg in _configs(m, rows, k):
        out = FL.normed_swiglu_triton(x, w, b, _sum_sq_parts(x, parts), 1e-6, s, config=cfg)
        assert out.shape == (m, i) and out.dtype == dtype
        _close(out, ref, f"M={m} I={i} K={k} rows={rows} tiles {cfg}")


@pytest.mark.parametrize("m,n,k,rows", _each_8bit([
    (1, 40, 72, None), (7, 17, 300, None), (16, 64, 96, None), (2, 23, 136, "8"),
    (9, 40, 200, "8"), (1, 40, 72, "8")]))
@pytest.mark.parametrize("bias", [False, True])
def test_linear_residual_and_its_sum_of_squares(device, dtype, randn, poisoned_empty, fuse_fp32,
                                                m, n, k, rows, bias):
    x, r = randn(m, k, dtype=dtype), randn(m, n, dtype=dtype) * 4
    w, s, wf = _weight(randn, n, k, dtype, rows, 1 / k ** 0.5)
    b = randn(n, dtype=dtype) if bias else None
    ref = FL.linear_residual_torch(x.float(), wf, None if b is None else b.float(), r.float())
    for cfg in _configs(m, rows, k):
        out, parts = FL.linear_residual_triton(x, w, b, r, sum_sq=True, scale=s, config=cfg)
        assert out.shape == (m, n) and out.dtype == dtype
        _close(out, ref, f"M={m} N={n} K={k} rows={rows} tiles {cfg}")
        # one partial per program (BLOCK_N columns each), of the values as stored
        block_n = (cfg or FL._tiles(None, FL.skinny_config(m, n, k, gemv=s is None),
                                    FL._row_dtype(w, s), FL.gemv_kind(n, k), m, k))["BLOCK_N"]
        assert parts.shape == (-(-n // block_n), m) and parts.dtype == torch.float32
        torch.testing.assert_close(parts.sum(0), out.float().square().sum(-1), rtol=1e-5,
                                   atol=1e-5)
        alone = FL.linear_residual_triton(x, w, b, r, scale=s, config=cfg)
        torch.testing.assert_close(alone, out, rtol=0, atol=0)  # without the sums: same output


def test_a_decode_layer_chain_matches_the_unfused_composition(device, randn):
    """o + residual -> normed gate_up (weights folded) -> down + residual, with the sums
    of squares handed along, equals norm -> GEMM -> silu -> GEMM -> add in float16."""
    dt, h, i = torch.float16, 96, 80
    stream, attn = randn(2, h, dtype=dt), randn(2, h, dtype=dt)
    wo, wgu, wd = randn(h, h, dtype=dt) / 10, randn(2 * i, h, dtype=dt) / 10, randn(h, i, dtype=dt) / 9
    g = (1 + 0.3 * randn(h)).to(dt)
    s1, parts = FL.linear_residual_triton(attn, wo, None, stream, sum_sq=True)
    folded = (wgu.float() * g.float()).to(dt)
    out = FL.linear_residual_triton(FL.normed_swiglu_triton(s1, folded, None, parts, 1e-6),
                                    wd, None, s1)
    from infergraft.kernels.rms_norm import rms_norm_torch
    r1 = (attn.float() @ wo.float().T).to(dt) + stream
    act = FL.silu_mul_torch(torch.nn.functional.linear(rms_norm_torch(r1, g, 1e-6), wgu))
    ref = (act.float() @ wd.float().T).to(dt) + r1
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=1e-2)


def test_unfusable_inputs_take_the_composition(device, randn):
    """float32 and more than FL.FUSE_MAX_ROWS rows: torch ops, same results as the references."""
    for dt, rows in ((torch.float16, FL.FUSE_MAX_ROWS + 1), (torch.float32, 2)):
        x, r = randn(rows, 32, dtype=dt), randn(rows, 48, dtype=dt)
        w, ss = randn(48, 32, dtype=dt) / 6, _sum_sq_parts(x, 3)
        tol = TOLERANCES[dt]
        torch.testing.assert_close(FL.normed_linear_triton(x, w, None, ss, 1e-6),
                                   FL.normed_linear_torch(x, w, None, ss, 1e-6), **tol)
        torch.testing.assert_close(FL.normed_swiglu_triton(x, w, None, ss, 1e-6),
                                   FL.normed_swiglu_torch(x, w, None, ss, 1e-6), **tol)
        y, parts = FL.linear_residual_triton(x, w, None, r, sum_sq=True)
        ry, rparts = FL.linear_residual_torch(x, w, None, r, sum_sq=True)
        torch.testing.assert_close(y, ry, **tol)
        torch.testing.assert_close(parts.sum(0), rparts.sum(0), rtol=1e-5, atol=1e-5)


def test_bad_inputs_are_rejected(device, randn):
    dt = torch.float16
    x, w = randn(2, 32, dtype=dt), randn(48, 32, dtype=dt)
    with pytest.raises(AssertionError, match="sum_sq"):
        FL.normed_linear_triton(x, w, None, torch.ones(3, 1, device=x.device), 1e-6)
    with pytest.raises(AssertionError, match="residual"):
        FL.linear_residual_triton(x, w, None, randn(2, 47, dtype=dt))
    with pytest.raises(AssertionError, match="even"):
        FL.normed_swiglu_triton(x, randn(47, 32, dtype=dt), None, _sum_sq_parts(x, 1), 1e-6)
    with pytest.raises(AssertionError, match="weight"):
        FL.normed_linear_triton(x, randn(48, 31, dtype=dt), None, _sum_sq_parts(x, 1), 1e-6)


def test_one_row_takes_the_register_loop_by_default():
    """The default tiles at M=1 (16-bit weights) are the GEMV loop's; more rows, the
    16-bit configs asked for without it (``gemv=False``: int8 rows take their own word
    loop, ``_tiles``) and split-K keep the tensor-core tiles."""
    from infergraft.kernels import linear as L
    assert L.skinny_config(1, 4096, 4096).get("GEMV") is True
    assert FL.swiglu_config(1, 11008, 4096).get("GEMV") is True
    assert FL.qkv_rope_config(1, 64, 4096).get("GEMV") is True
    for cfg in (L.skinny_config(2, 4096, 4096), L.skinny_config(1, 4096, 4096, gemv=False),
                FL.swiglu_config(1, 11008, 4096, gemv=False), FL.qkv_rope_config(3, 64, 4096)):
        assert not cfg.get("GEMV") and cfg["BLOCK_M"] >= 16


@pytest.mark.parametrize("m,depth", [(2, 1), (1, 3), (1, 0)])
def test_the_register_loop_refuses_what_it_cannot_compute(device, randn, m, depth):
    """More than one row, or a depth other than 1 / 2, would silently drop rows or tiles."""
    from infergraft.kernels.linear import skinny_gemm
    x, w = randn(m, 64, dtype=torch.float16), randn(16, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="one-row GEMV loop"):
        skinny_gemm(x, w, config=dict(gemv_config("o"), BLOCK_N=16, BLOCK_K=32, DEPTH=depth))
