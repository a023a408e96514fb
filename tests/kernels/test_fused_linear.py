"""Decode GEMMs fused with the residual add, the (folded) RMSNorm and SwiGLU, vs the torch
compositions on fresh random inputs; 16-bit weights, and int8 ones with a scale per row."""
import pytest
import torch

from infergraft.kernels import fused_linear as FL
from infergraft.kernels.gemv import gemv_config
from infergraft.kernels.int8_linear import quantize_int8

from .tolerances import TOLERANCES

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


def _weight(randn, n, k, dtype, int8, mul):
    """(weight, scale, its float32 value): randn(n, k) * mul in ``dtype`` and no scale, or
    ``quantize_int8`` of a float32 draw (int8 [n, k], scale [n]) and its dequantised value."""
    if not int8:
        w = randn(n, k, dtype=dtype) * mul
        return w, None, w.float()
    q, s = quantize_int8(randn(n, k) * mul)
    return q, s, q.float() * s[:, None]


def _gemv_cfgs(m, int8=False, k=0):
    """At one row, the register loop (kernels/gemv.py) with small tiles, at both depths;
    int8 rows (K a multiple of 4): the word loop, one tile ahead, both PDL releases."""
    if m != 1 or (int8 and k % 4):
        return []
    if int8:
        return [dict(gemv_config("o"), BLOCK_N=16, BLOCK_K=32, DEPTH=1, EARLY=early)
                for early in (True, False)]
    return [dict(gemv_config("o"), BLOCK_N=16, BLOCK_K=32, DEPTH=depth, EARLY=depth == 1)
            for depth in (1, 2)]


def _configs(m, int8, k=0):
    """Small tiles (several K and column tiles), also swapped (y^T = W x^T); int8 weights
    also the default tiles; one row also the register loop."""
    small = (_cfg(m), dict(_cfg(m), SWAP=True))
    return (small + (None,) if int8 else small) + tuple(_gemv_cfgs(m, int8, k))


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


@pytest.mark.parametrize("m,n,k,parts,int8", [(1, 40, 72, 1, False), (3, 17, 300, 5, False),
                                               (16, 64, 96, 19, False), (2, 23, 136, 2, True),
                                               (20, 48, 70, 4, True), (1, 40, 72, 1, True),
                                               (1, 24, 70, 2, True)])
@pytest.mark.parametrize("bias", [False, True])
def test_normed_linear(device, dtype, randn, poisoned_empty, fuse_fp32, m, n, k, parts, int8,
                       bias):
    x = randn(m, k, dtype=dtype) * 3
    w, s, wf = _weight(randn, n, k, dtype, int8, 1 / k ** 0.5)
    b = randn(n, dtype=dtype) if bias else None
    xf = x.float()
    ref = torch.nn.functional.linear(xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-5),
                                     wf, None if b is None else b.float())
    for cfg in _configs(m, int8, k):
        out = FL.normed_linear_triton(x, w, b, _sum_sq_parts(x, parts), 1e-5, s, config=cfg)
        assert out.shape == (m, n) and out.dtype == dtype
        _close(out, ref, f"M={m} N={n} K={k} int8={int8} tiles {cfg}")


def _swiglu_rounded_like_the_kernel(x, w, b, eps, dtype):
    """float32 math with the kernel's roundings to ``dtype`` (gate and up; silu):
    silu(g) * u cancels, so rounding other intermediates (as the composed reference
    does) lands several ulps away, either way. The float32 case checks the math."""
    i = w.shape[0] // 2
    acc = (x @ w.T) * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    acc = acc + (0 if b is None else b)
    gate, up = acc[:, :i].to(dtype).float(), acc[:, i:].to(dtype).float()
    return (gate * torch.sigmoid(gate)).to(dtype).float() * up


@pytest.mark.parametrize("m,i,k,parts,int8", [(1, 40, 72, 1, False), (5, 24, 130, 3, False),
                                               (16, 33, 64, 8, False), (3, 20, 100, 2, True),
                                               (13, 37, 300, 6, True), (1, 20, 100, 2, True)])
@pytest.mark.parametrize("bias", [False, True])
def test_normed_swiglu(device, dtype, randn, poisoned_empty, fuse_fp32, m, i, k, parts, int8,
                       bias):
    x = randn(m, k, dtype=dtype)
    w, s, wf = _weight(randn, 2 * i, k, dtype, int8, 2 / k ** 0.5)  # gate | up
    b = randn(2 * i, dtype=dtype) if bias else None
    ref = _swiglu_rounded_like_the_kernel(x.float(), wf, None if b is None else b.float(),
                                          1e-6, dtype)
    for cfg in _configs(m, int8, k):
        out = FL.normed_swiglu_triton(x, w, b, _sum_sq_parts(x, parts), 1e-6, s, config=cfg)
        assert out.shape == (m, i) and out.dtype == dtype
        _close(out, ref, f"M={m} I={i} K={k} int8={int8} tiles {cfg}")


@pytest.mark.parametrize("m,n,k,int8", [(1, 40, 72, False), (7, 17, 300, False),
                                        (16, 64, 96, False), (2, 23, 136, True),
                                        (9, 40, 200, True), (1, 40, 72, True)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_residual_and_its_sum_of_squares(device, dtype, randn, poisoned_empty, fuse_fp32,
                                                m, n, k, int8, bias):
    x, r = randn(m, k, dtype=dtype), randn(m, n, dtype=dtype) * 4
    w, s, wf = _weight(randn, n, k, dtype, int8, 1 / k ** 0.5)
    b = randn(n, dtype=dtype) if bias else None
    ref = FL.linear_residual_torch(x.float(), wf, None if b is None else b.float(), r.float())
    for cfg in _configs(m, int8, k):
        out, parts = FL.linear_residual_triton(x, w, b, r, sum_sq=True, scale=s, config=cfg)
        assert out.shape == (m, n) and out.dtype == dtype
        _close(out, ref, f"M={m} N={n} K={k} int8={int8} tiles {cfg}")
        # one partial per program (BLOCK_N columns each), of the values as stored
        block_n = (cfg or FL._tiles(None, FL.skinny_config(m, n, k, gemv=s is None), s,
                                    FL.gemv_kind(n, k), m, k))["BLOCK_N"]
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


def test_int8_weights_off_the_fused_path(device, randn):
    """int8 weights with more than FL.FUSE_MAX_ROWS rows (the int8 GEMM kernel + torch ops)
    and with float32 x equal the references given the scale; in float32 those equal the
    same ops on the dequantised weight."""
    for dt, rows in ((torch.float16, FL.FUSE_MAX_ROWS + 1), (torch.float32, 2)):
        x, r = randn(rows, 32, dtype=dt), randn(rows, 48, dtype=dt)
        q, s = quantize_int8(randn(48, 32) / 6)
        ss, b = _sum_sq_parts(x, 3), randn(48, dtype=dt)
        for name, args in (("normed_linear", (ss, 1e-6)), ("normed_swiglu", (ss, 1e-6)),
                           ("linear_residual", (r, True))):
            got = getattr(FL, f"{name}_triton")(x, q, b, *args, scale=s)
            ref = getattr(FL, f"{name}_torch")(x, q, b, *args, scale=s)
            torch.testing.assert_close(got, ref, **TOLERANCES[dt], msg=lambda m: f"{name}\n{m}")
            if dt is torch.float32:
                deq = getattr(FL, f"{name}_torch")(x, q.float() * s[:, None], b, *args)
                torch.testing.assert_close(ref, deq, **TOLERANCES[dt])


def test_int8_default_tiles_double_short_k_tiles():
    """An int8 tile carries half a 16-bit one's bytes: K tiles of <= 256 double, not longer
    ones (o, down: 512), nor tiles the caller chose."""
    s = torch.ones(4)  # a scale given: an int8 weight
    at = ("o", 2, 64)  # kind, rows, K: not one row

    def tiles(config, default, scale):
        return FL._tiles(config, default, scale, *at)
    assert tiles(None, dict(BLOCK_N=32, BLOCK_K=128), s) == dict(BLOCK_N=32, BLOCK_K=256)
    assert tiles(None, dict(BLOCK_N=64, BLOCK_K=256), s)["BLOCK_K"] == 512
    assert tiles(None, dict(BLOCK_N=32, BLOCK_K=512), s)["BLOCK_K"] == 512
    assert tiles(None, dict(BLOCK_N=32, BLOCK_K=128), None)["BLOCK_K"] == 128
    assert tiles(dict(BLOCK_N=16, BLOCK_K=32), dict(BLOCK_K=128), s)["BLOCK_K"] == 32


@pytest.mark.parametrize("kind", ["wide", "o", "down", "swiglu", "qkv_rope"])
def test_int8_one_row_takes_the_word_loop_with_its_switch(monkeypatch, kind):
    """With INFERGRAFT_GEMV_INT8 one int8 row takes the word loop, its tiles holding the
    bytes the kind's 16-bit tiles keep in flight; K not a multiple of 4, more rows, or the
    switch off: the tensor-core tiles."""
    from infergraft.kernels import gemv
    s, default = torch.ones(4), dict(BLOCK_N=32, BLOCK_K=128)
    monkeypatch.setattr(gemv, "GEMV_INT8", True)
    cfg, g = FL._tiles(None, default, s, kind, 1, 4096), gemv_config(kind)
    assert cfg["GEMV"] and cfg["DEPTH"] == 1 and cfg["BLOCK_K"] == 2 * g["BLOCK_K"] * g["DEPTH"]
    for rows, k in ((1, 4098), (2, 4096)):
        assert not FL._tiles(None, default, s, kind, rows, k).get("GEMV")
    monkeypatch.setattr(gemv, "GEMV_INT8", False)
    assert not FL._tiles(None, default, s, kind, 1, 4096).get("GEMV")


def test_int8_word_loop_default_matches_the_reference(device, randn, monkeypatch):
    """The three fused GEMMs at one int8 row through their default tiles with the switch
    on (the word loop, K tiles longer than K here: one tile) equal the references."""
    from infergraft.kernels import gemv
    monkeypatch.setattr(gemv, "GEMV_INT8", True)
    dt, k, n = torch.float16, 200, 48
    x, r = randn(1, k, dtype=dt), randn(1, n, dtype=dt)
    q, s = quantize_int8(randn(n, k) / 6)
    ss, b = _sum_sq_parts(x, 2), randn(n, dtype=dt)
    for name, args in (("normed_linear", (ss, 1e-6)), ("normed_swiglu", (ss, 1e-6)),
                       ("linear_residual", (r, False))):
        got = getattr(FL, f"{name}_triton")(x, q, b, *args, scale=s)
        ref = getattr(FL, f"{name}_torch")(x, q, b, *args, scale=s)
        tol = {key: 2 * v for key, v in TOLERANCES[dt].items()}
        torch.testing.assert_close(got, ref, **tol, msg=lambda m: f"{name}\n{m}")


def test_int8_bad_scales_are_rejected(device, randn):
    dt = torch.float16
    x = randn(2, 32, dtype=dt)
    q, s = quantize_int8(randn(48, 32))
    ss = _sum_sq_parts(x, 1)
    bad = r"scale must be contiguous float32 \[48\] \(one per weight row\), got "
    with pytest.raises(AssertionError, match=bad + r"\(47,\)"):
        FL.normed_linear_triton(x, q, None, ss, 1e-6, s[:47])
    with pytest.raises(AssertionError, match=bad + r"\(48,\) torch.float16"):
        FL.normed_swiglu_triton(x, q, None, ss, 1e-6, s.half())
    with pytest.raises(AssertionError, match=bad + r".*stride \(2,\)"):
        FL.linear_residual_triton(x, q, None, randn(2, 48, dtype=dt),
                                  scale=torch.stack([s, s], 1).view(-1)[::2])
    with pytest.raises(AssertionError, match="qweight must be contiguous int8"):
        FL.normed_linear_triton(x, q.to(dt), None, ss, 1e-6, s)  # a scale, a 16-bit weight
    many = randn(FL.FUSE_MAX_ROWS + 1, 32, dtype=dt)  # the int8 GEMM's own check
    with pytest.raises(AssertionError, match=r"scale must be contiguous float32 \[48\], got \(47,\)"):
        FL.normed_linear_triton(many, q, None, _sum_sq_parts(many, 1), 1e-6, s[:47])


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
