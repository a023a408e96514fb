"""What the fused decode GEMMs do with 8-bit weight rows beyond 16-bit ones
(``Quantizer.scaled_rows``: int8 or fp8 e4m3, a float32 scale per row): their tiles, the
int8 one-row word loop that e4m3 rows never take, the fallbacks off the fused path and
bad scales. The kernel-vs-reference grids over both are in test_fused_linear.py."""
import pytest
import torch

from infergraft.kernels import fused_linear as FL
from infergraft.kernels import gemv
from infergraft.kernels.gemv import gemv_config

from .test_fused_linear import QUANTIZE, _sum_sq_parts
from .tolerances import TOLERANCES

ROWS = sorted(QUANTIZE)  # "fp8", "int8"
DTYPE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
FUSED = (("normed_linear", "sum_sq"), ("normed_swiglu", "sum_sq"), ("linear_residual", "r"))


def _calls(ss, r, sum_sq=True):
    """(name, the arguments after x, weight and bias) of each fused GEMM."""
    return [(name, (ss, 1e-6) if arg == "sum_sq" else (r, sum_sq)) for name, arg in FUSED]


@pytest.mark.parametrize("rows", ROWS)
def test_8bit_rows_off_the_fused_path(device, randn, rows):
    """8-bit rows with more than FL.FUSE_MAX_ROWS rows (their own GEMM kernel + torch ops)
    and with float32 x equal the references given the scale; in float32 those equal the
    same ops on the dequantised weight."""
    for dt, m in ((torch.float16, FL.FUSE_MAX_ROWS + 1), (torch.float32, 2)):
        x, r = randn(m, 32, dtype=dt), randn(m, 48, dtype=dt)
        q, s = QUANTIZE[rows](randn(48, 32) / 6)
        ss, b = _sum_sq_parts(x, 3), randn(48, dtype=dt)
        for name, args in _calls(ss, r):
            got = getattr(FL, f"{name}_triton")(x, q, b, *args, scale=s)
            ref = getattr(FL, f"{name}_torch")(x, q, b, *args, scale=s)
            torch.testing.assert_close(got, ref, **TOLERANCES[dt], msg=lambda e: f"{name}\n{e}")
            if dt is torch.float32:
                deq = getattr(FL, f"{name}_torch")(x, q.float() * s[:, None], b, *args)
                torch.testing.assert_close(ref, deq, **TOLERANCES[dt])


@pytest.mark.parametrize("rows", ROWS)
def test_8bit_default_tiles_double_short_k_tiles(rows):
    """An 8-bit tile carries half a 16-bit one's bytes: K tiles of <= 256 double, not longer
    ones (o, down: 512), nor tiles the caller chose."""
    at = ("o", 2, 64)  # kind, rows, K: not one row

    def tiles(config, default, row_dtype=DTYPE[rows]):
        return FL._tiles(config, default, row_dtype, *at)
    assert tiles(None, dict(BLOCK_N=32, BLOCK_K=128)) == dict(BLOCK_N=32, BLOCK_K=256)
    assert tiles(None, dict(BLOCK_N=64, BLOCK_K=256))["BLOCK_K"] == 512
    assert tiles(None, dict(BLOCK_N=32, BLOCK_K=512))["BLOCK_K"] == 512
    assert tiles(None, dict(BLOCK_N=32, BLOCK_K=128), None)["BLOCK_K"] == 128
    assert tiles(dict(BLOCK_N=16, BLOCK_K=32), dict(BLOCK_K=128))["BLOCK_K"] == 32


@pytest.mark.parametrize("kind", ["wide", "o", "down", "swiglu", "qkv_rope"])
def test_one_int8_row_takes_the_word_loop_with_its_switch_and_e4m3_never(monkeypatch, kind):
    """With INFERGRAFT_GEMV_INT8 one int8 row takes the word loop, its tiles holding the
    bytes the kind's 16-bit tiles keep in flight; K not a multiple of 4, more rows, or the
    switch off: the tensor-core tiles. One e4m3 row: the tiles always (the word loop
    reads its bytes as int8), as int8 rows would take them."""
    default = dict(BLOCK_N=32, BLOCK_K=128)
    monkeypatch.setattr(gemv, "GEMV_INT8", True)
    cfg, g = FL._tiles(None, default, torch.int8, kind, 1, 4096), gemv_config(kind)
    assert cfg["GEMV"] and cfg["DEPTH"] == 1 and cfg["BLOCK_K"] == 2 * g["BLOCK_K"] * g["DEPTH"]
    for m, k in ((1, 4098), (2, 4096)):
        assert not FL._tiles(None, default, torch.int8, kind, m, k).get("GEMV")
    fp8 = FL._tiles(None, default, torch.float8_e4m3fn, kind, 1, 4096)
    assert fp8 == dict(default, BLOCK_K=256)  # INFERGRAFT_GEMV_FP8 off (the default)
    monkeypatch.setattr(gemv, "GEMV_INT8", False)
    assert FL._tiles(None, default, torch.int8, kind, 1, 4096) == fp8
    monkeypatch.setattr(gemv, "GEMV_FP8", True)
    assert FL._tiles(None, default, torch.float8_e4m3fn, kind, 1, 4096) == cfg
    assert not FL._tiles(None, default, torch.float8_e4m3fn, kind, 1, 4098).get("GEMV")


@pytest.mark.parametrize("rows,fp8_words", [("int8", False), ("fp8", False), ("fp8", True)],
                         ids=["int8", "fp8", "fp8-words"])
def test_one_8bit_row_by_default_matches_the_reference(device, randn, monkeypatch, rows,
                                                       fp8_words):
    """The three fused GEMMs at one 8-bit row through their default tiles, the word loop's
    switch on, equal the references: int8 rows through the word loop (K tiles longer than
    K here: one tile), e4m3 rows through the tensor-core tiles, or with
    INFERGRAFT_GEMV_FP8 the word loop too (its bytes moved into float32 bits)."""
    monkeypatch.setattr(gemv, "GEMV_INT8", True)
    monkeypatch.setattr(gemv, "GEMV_FP8", fp8_words)
    loops, launch = [], FL.launch_gemm
    monkeypatch.setattr(FL, "launch_gemm", lambda grid, cfg, *a, **kw: loops.append(
        bool(cfg.get("GEMV"))) or launch(grid, cfg, *a, **kw))
    dt, k, n = torch.float16, 200, 48
    x, r = randn(1, k, dtype=dt), randn(1, n, dtype=dt)
    q, s = QUANTIZE[rows](randn(n, k) / 6)
    ss, b = _sum_sq_parts(x, 2), randn(n, dtype=dt)
    rtol = 2 * TOLERANCES[dt]["rtol"]
    for name, args in _calls(ss, r, sum_sq=False):
        got = getattr(FL, f"{name}_triton")(x, q, b, *args, scale=s)
        ref = getattr(FL, f"{name}_torch")(x, q, b, *args, scale=s)
        # the fused GEMM normalises x in float32, the reference rounds it to x's dtype
        # first (as the unfused path does): where a sum of K terms cancels (a small up
        # beside a large silu(gate)) that rounding shows at the terms' size, not the sum's
        atol = 2 * TOLERANCES[dt]["atol"] * max(1.0, float(ref.abs().max()))
        torch.testing.assert_close(got, ref, atol=atol, rtol=rtol,
                                   msg=lambda e: f"{name}\n{e}")
    assert loops == [rows == "int8" or fp8_words] * 3


def test_e4m3_rows_take_a_hand_given_word_loop_as_int8_rows_do(device, randn):
    """Tiles asked for by hand send e4m3 rows into the word loop as int8 ones (DEPTH 1, K a
    multiple of 4: its bytes read as e4m3, subnormals and signs included), else refused."""
    x, r = randn(1, 64, dtype=torch.float16), randn(1, 16, dtype=torch.float16)
    q, s = QUANTIZE["fp8"](randn(16, 64))
    q.view(torch.uint8)[0, :8] = torch.tensor([0, 1, 7, 0x80, 0x81, 0x7E, 0xFE, 0x38],
                                              dtype=torch.uint8)  # 0, subnormals, +-448, 1
    cfg = dict(gemv_config("o"), BLOCK_N=16, BLOCK_K=32, DEPTH=1)
    got = FL.linear_residual_triton(x, q, None, r, scale=s, config=cfg)
    torch.testing.assert_close(got, FL.linear_residual_torch(x, q, None, r, scale=s),
                               **{key: 2 * v for key, v in TOLERANCES[torch.float16].items()})
    with pytest.raises(ValueError, match=r"one-row GEMV loop .*8-bit rows: 1, K a multiple"):
        FL.linear_residual_triton(x, q, None, r, scale=s, config=dict(cfg, DEPTH=2))


@pytest.mark.parametrize("rows", ROWS)
def test_8bit_bad_scales_are_rejected(device, randn, rows):
    dt = torch.float16
    x = randn(2, 32, dtype=dt)
    q, s = QUANTIZE[rows](randn(48, 32))
    ss = _sum_sq_parts(x, 1)
    bad = r"scale must be contiguous float32 \[48\] \(one per weight row\), got "
    with pytest.raises(AssertionError, match=bad + r"\(47,\)"):
        FL.normed_linear_triton(x, q, None, ss, 1e-6, s[:47])
    with pytest.raises(AssertionError, match=bad + r"\(48,\) torch.float16"):
        FL.normed_swiglu_triton(x, q, None, ss, 1e-6, s.half())
    with pytest.raises(AssertionError, match=bad + r".*stride \(2,\)"):
        FL.linear_residual_triton(x, q, None, randn(2, 48, dtype=dt),
                                  scale=torch.stack([s, s], 1).view(-1)[::2])
    for w in (q.to(dt), q.view(torch.uint8)):  # a scale, but not 8-bit rows of either kind
        with pytest.raises(AssertionError, match="a weight with a scale must be int8 or "
                                                 f"float8_e4m3fn rows, got {w.dtype}"):
            FL.normed_linear_triton(x, w, None, ss, 1e-6, s)
    many = randn(FL.FUSE_MAX_ROWS + 1, 32, dtype=dt)  # the 8-bit GEMM's own check
    with pytest.raises(AssertionError, match=r"scale must be contiguous float32 \[48\], got \(47,\)"):
        FL.normed_linear_triton(many, q, None, _sum_sq_parts(many, 1), 1e-6, s[:47])
