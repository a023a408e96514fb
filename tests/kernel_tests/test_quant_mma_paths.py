"""Where ``INFERGRAFT_QUANT_MMA`` sends the quantised decode GEMMs (its value bound as
``mma`` by ``dispatch.get_ops`` at build). At 1 (``mma=True``): the int4 / e4m3 / int8
launchers to ``int4_mma`` / ``fp8_mma.rows_mma`` at 1-64 rows (groups of 128 for int4) and
to their shipped paths otherwise; the fused decode GEMMs over 8-bit rows keep their shipped
tiles and programs but read W as words, widened by ``fp8_mma.dot_words`` (WORDS; one int8
row stays on its word loop), K not a multiple of 4 on the byte tiles. Under ``auto`` (the default): int4 from ``int4_linear.MMA_MIN_ROWS`` rows only,
8-bit rows never. Each equals its reference (interpreter: float16; CUDA: float16 and
bfloat16)."""
import pytest
import torch

from infergraft.kernels import dispatch, switches
from infergraft.kernels import fp8_linear, fp8_mma, int4_linear, int8_linear
from infergraft.kernels import fused_linear as FL
from infergraft.kernels.fp8_linear import fp8_linear_torch, quantize_fp8
from infergraft.kernels.int4_linear import int4_linear_torch, quantize_int4
from infergraft.kernels.int8_linear import int8_linear_torch, quantize_int8

from infergraft.kernels.gemv import GEMV_INT8, takes_int8_gemv

from .test_fused_linear import QUANTIZE, _sum_sq_parts
from .test_qkv_rope import BLOCKS, BS, _inputs, _reference
from .test_rotary import _cos_sin
from .tolerances import TOLERANCES


def _dtypes(device):
    # bf16 on CUDA only: the interpreter's bf16 dots are not the GPU's (conftest.NEVER)
    return [torch.float16] + ([torch.bfloat16] if device == "cuda" else [])


def _spy(monkeypatch, module, name):
    calls, real = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **kw: calls.append(a[0].shape[0]) or
                        real(*a, **kw))
    return calls


def test_int4_decode_rows_take_int4_mma_and_others_the_shipped_paths(device, randn,
                                                                     monkeypatch):
    calls = _spy(monkeypatch, int4_linear, "int4_mma")
    for dt in _dtypes(device):
        for m, group in ((1, 128), (5, 128), (64, 128), (65, 128), (3, 64)):
            x, b = randn(m, 264, dtype=dt), randn(40, dtype=dt)  # K: 2 groups + 8 columns
            p = quantize_int4(randn(40, 264) / 16, group)
            args = (p.qweight, p.scales, p.zeros, group, 264)
            got = int4_linear.int4_linear_triton(x, *args, b, mma=True)
            ref = int4_linear_torch(x, *args, bias=b)
            torch.testing.assert_close(got, ref, **TOLERANCES[dt], msg=lambda e: f"M={m}\n{e}")
    assert calls == [1, 5, 64] * len(_dtypes(device))  # not 65 rows, not groups of 64


def test_the_route_rules_at_each_setting():
    """``int4_mma_chosen``: 0 never, 1 at every row count, auto from MMA_MIN_ROWS rows (the
    switch's help says which); ``rows_mma_chosen`` (e4m3, int8): only at 1."""
    low = int4_linear.MMA_MIN_ROWS
    assert f"{low}-64 rows (`int4_linear.MMA_MIN_ROWS`)" in \
        switches.switch("INFERGRAFT_QUANT_MMA").selects
    for m in range(1, 65):
        assert int4_linear.int4_mma_chosen(False, m) is False
        assert int4_linear.int4_mma_chosen(True, m) is True
        assert int4_linear.int4_mma_chosen("auto", m) is (m >= low), m
    assert [fp8_mma.rows_mma_chosen(v) for v in (False, "auto", True)] == [False, False, True]
    for bad in ("1", 1, "on", None):  # the switch's parsed values only
        with pytest.raises(AssertionError, match="False, True or 'auto'"):
            int4_linear.int4_mma_chosen(bad, 16)
        with pytest.raises(AssertionError, match="False, True or 'auto'"):
            fp8_mma.rows_mma_chosen(bad)


def test_auto_sends_int4_to_int4_mma_from_mma_min_rows(device, randn, monkeypatch):
    """The launcher under auto: one row on the GEMV, MMA_MIN_ROWS - 1 rows on the tiles,
    MMA_MIN_ROWS and 64 on int4_mma, 65 past it (and groups of 64 never)."""
    calls = _spy(monkeypatch, int4_linear, "int4_mma")
    gemv = _spy(monkeypatch, int4_linear, "int4_gemv_triton")
    low = int4_linear.MMA_MIN_ROWS
    for dt in _dtypes(device):
        for m, group in ((1, 128), (low - 1, 128), (low, 128), (64, 128), (65, 128),
                         (low, 64)):
            x, b = randn(m, 264, dtype=dt), randn(40, dtype=dt)
            p = quantize_int4(randn(40, 264) / 16, group)
            args = (p.qweight, p.scales, p.zeros, group, 264)
            got = int4_linear.int4_linear_triton(x, *args, b, mma="auto")
            ref = int4_linear_torch(x, *args, bias=b)
            torch.testing.assert_close(got, ref, **TOLERANCES[dt], msg=lambda e: f"M={m}\n{e}")
    assert calls == [low, 64] * len(_dtypes(device))
    assert gemv == [1] * len(_dtypes(device))


def test_auto_keeps_8bit_rows_on_their_shipped_paths(device, randn, monkeypatch):
    """Under auto the e4m3 / int8 launchers never reach rows_mma and the fused GEMMs never
    take the WORDS tiles, at one row, 17 and 32."""
    seen = {name: _spy(monkeypatch, module, "rows_mma")
            for name, module in (("fp8", fp8_linear), ("int8", int8_linear))}
    tiles, launch = [], FL.launch_gemm
    monkeypatch.setattr(FL, "launch_gemm", lambda grid, cfg, *a, **kw: tiles.append(
        bool(cfg.get("WORDS"))) or launch(grid, cfg, *a, **kw))
    n, k, dt = 48, 200, torch.float16
    for rows in sorted(QUANTIZE):
        for m in (1, 17, 32):
            x, r = randn(m, k, dtype=dt), randn(m, n, dtype=dt)
            q, s = QUANTIZE[rows](randn(n, k) / 6)
            getattr({"fp8": fp8_linear, "int8": int8_linear}[rows], f"{rows}_linear_triton")(
                x, q, s, mma="auto")
            FL.linear_residual_triton(x, q, None, r, True, scale=s, mma="auto")
            FL.normed_swiglu_triton(x, q, None, _sum_sq_parts(x, 2), 1e-6, scale=s, mma="auto")
    assert seen == {"fp8": [], "int8": []} and tiles == [False] * 12


@pytest.mark.parametrize("rows", sorted(QUANTIZE))
def test_8bit_decode_rows_take_the_rows_mma(device, randn, monkeypatch, rows):
    module, ref_of = {"fp8": (fp8_linear, fp8_linear_torch),
                      "int8": (int8_linear, int8_linear_torch)}[rows]
    launch = getattr(module, f"{rows}_linear_triton")
    calls = _spy(monkeypatch, module, "rows_mma")
    for dt in _dtypes(device):
        for m, k in ((1, 200), (7, 200), (64, 200), (65, 200), (3, 202)):
            x, b = randn(m, k, dtype=dt), randn(24, dtype=dt)
            q, s = QUANTIZE[rows](randn(24, k) / 8)
            got = launch(x, q, s, b, mma=True)
            if m > 64 and rows == "fp8" and dt == torch.bfloat16:
                continue  # W8A8 there: x rounded to e4m3, not the reference's math
            ref = ref_of(x.float(), q, s, b.float()).to(dt)
            torch.testing.assert_close(got, ref, **TOLERANCES[dt], msg=lambda e: f"M={m}\n{e}")
    assert calls == [1, 7, 64] * len(_dtypes(device))  # not 65 rows, not K % 4


FUSED = (("normed_linear", "sum_sq"), ("normed_swiglu", "sum_sq"), ("linear_residual", "r"))


def _tile_spy(monkeypatch):
    """The fused GEMMs' launches, each as "words" (WORDS tiles), "loop" (the one-row word
    loop) or "bytes" (plain byte tiles)."""
    seen, launch = [], FL.launch_gemm
    monkeypatch.setattr(FL, "launch_gemm", lambda grid, cfg, *a, **kw: seen.append(
        "words" if cfg.get("WORDS") else "loop" if cfg.get("GEMV") else "bytes") or
        launch(grid, cfg, *a, **kw))
    return seen


@pytest.mark.parametrize("rows", sorted(QUANTIZE))
def test_fused_gemms_on_8bit_rows_take_the_words_tiles(device, randn, monkeypatch, rows):
    """At 1, 2, 17 and 32 rows the three fused GEMMs read the rows as words (one int8 row:
    its word loop, as under 0) and equal the references on fresh inputs; K = 202 (not
    whole words) keeps the byte tiles."""
    tiles = _tile_spy(monkeypatch)
    n, want = 48, []
    for dt in _dtypes(device):
        for m, k in ((1, 200), (2, 200), (17, 200), (32, 200), (3, 202)):
            x, r = randn(m, k, dtype=dt), randn(m, n, dtype=dt)
            q, s = QUANTIZE[rows](randn(n, k) / 6)
            ss, b = _sum_sq_parts(x, 2), randn(n, dtype=dt)
            loop = takes_int8_gemv(m, k, fp8=rows == "fp8")
            want += ["bytes" if k % 4 else "loop" if loop else "words"] * len(FUSED)
            for name, arg in FUSED:
                args = (ss, 1e-6) if arg == "sum_sq" else (r, True)
                got = getattr(FL, f"{name}_triton")(x, q, b, *args, scale=s, mma=True)
                ref = getattr(FL, f"{name}_torch")(x, q, b, *args, scale=s)
                if arg == "r":  # (y, its sum of squares: partial sums [P, M] / [1, M])
                    torch.testing.assert_close(got[1].sum(0), ref[1].sum(0), rtol=1e-2, atol=1e-2)
                    got, ref = got[0], ref[0]
                # the fused GEMM normalises x in float32, the reference rounds it first
                atol = 2 * TOLERANCES[dt]["atol"] * max(1.0, float(ref.abs().max()))
                torch.testing.assert_close(got, ref, atol=atol, rtol=2 * TOLERANCES[dt]["rtol"],
                                           msg=lambda e: f"{name} M={m} K={k}\n{e}")
    assert tiles == want
    assert "words" in want and ("loop" in want) == (rows == "int8" and GEMV_INT8)


@pytest.mark.parametrize("rows", sorted(QUANTIZE))
def test_qkv_rope_on_8bit_rows_through_the_words_tiles(device, randn, gen, monkeypatch, rows):
    """The qkv GEMM rotating and writing K/V in its epilogue, 8-bit rows read as words
    (64 or 32 dims a head: tiles of 16 of half a head), equals the composition at 1, 2, 17
    and 32 rows; past UNSWAPPED_ROPE_MAX_ROWS (the unswapped tiles' limit, as under 0) it is
    normed_linear + rotary_kv_write."""
    composed = _spy(monkeypatch, FL, "rotary_kv_write_triton")
    for dt in _dtypes(device):
        for m, hq, hkv, d, k in ((1, 2, 1, 32, 96), (2, 3, 1, 64, 160), (17, 2, 1, 32, 96),
                                 (32, 3, 1, 64, 160)):
            x, (q8, s, wf), b, ss, positions, idx0, idx1 = _inputs(
                randn, gen, device, dt, m, hq, hkv, d, k, True, 2, rows=rows)
            cos, sin = _cos_sin(d, device)
            caches = [torch.zeros((BLOCKS, BS, hkv, d), dtype=dt, device=device)
                      for _ in range(4)]
            q = FL.normed_qkv_rope_triton(x, q8, b, ss, 1e-6, cos, sin, positions, hq,
                                          caches[0], caches[1], idx0, idx1, s, mma=True)
            q_ref = _reference(x, wf, b, positions, cos, sin, hq, caches[2:], idx0, idx1, 1e-6)
            tol = {key: 2 * v for key, v in TOLERANCES[dt].items()}
            for got, ref in ((q, q_ref), (caches[0], caches[2]), (caches[1], caches[3])):
                torch.testing.assert_close(got, ref, **tol, msg=lambda e: f"M={m} D={d}\n{e}")
    assert composed == [m for m in (17, 32) if m > FL.UNSWAPPED_ROPE_MAX_ROWS] * \
        len(_dtypes(device))


# LLaMA-2-7B's fused decode GEMMs: (plan's gemm, N, K, D / 2)
LLAMA2_7B = {"qkv + RoPE": ("qkv_rope", 12288, 4096, 64), "qkv": ("linear", 12288, 4096, 0),
             "o": ("linear", 4096, 4096, 0), "gate_up": ("swiglu", 22016, 4096, 0),
             "down": ("linear", 4096, 11008, 0)}


@pytest.mark.parametrize("rows", [torch.float8_e4m3fn, torch.int8])
def test_on_the_fused_8bit_gemms_launch_the_shipped_programs(rows):
    """Under 1 each fused GEMM over 8-bit rows launches the grid it launches under 0 and
    auto, on the same columns and rows a program, read as words in shorter K steps (the
    one-row word loop unchanged): the switch measures the widening alone. LLaMA-2-7B on
    132 SMs: qkv + RoPE 192 programs, o and down 128, gate_up 344 (172 above 16 rows), not
    the 96 / 64 / 172 / 64 of the 64-row tiles before."""
    programs = {}
    for m in (1, 2, 16, 17, 32):
        for name, (gemm, n, k, half) in LLAMA2_7B.items():
            (grid, on), (grid_off, off) = (FL.plan(gemm, m, n, k, rows, mma, half=half)
                                           for mma in (True, False))
            assert grid == grid_off and grid[1] == 1, (name, m)
            loop = bool(off.get("GEMV"))
            assert on == (off if loop else FL.words_tiles(off, gemm != "linear")), (name, m)
            assert "WORDS" not in off and not on.get("SWAP"), (name, m)
            assert [on[key] for key in ("BLOCK_M", "BLOCK_N", "num_warps")] == \
                [off[key] for key in ("BLOCK_M", "BLOCK_N", "num_warps")], (name, m)
            # the bytes of W a program keeps in flight: the shipped tiles', up to 8 stages
            assert on["BLOCK_K"] * on["num_stages"] == min(
                off["BLOCK_K"] * off["num_stages"], 8 * on["BLOCK_K"]), (name, m)
            assert FL.plan(gemm, m, n, k, rows, "auto", half=half) == (grid, off)
            programs[name, m] = grid[0]
    for m in (2, 16):
        assert [programs[g, m] for g in ("qkv + RoPE", "o", "gate_up", "down")] == \
            [192, 128, 344, 128], m
    assert [programs[g, 32] for g in ("o", "gate_up", "down")] == [128, 172, 128]


def test_the_switch_is_read_at_each_build(monkeypatch):
    """get_ops binds the switch's value as mma (and one counter pool a build) into the
    quantised GEMMs where it is 1 or auto (unset: its default) and Triton runs; the torch
    references never take it."""
    monkeypatch.setenv("INFERGRAFT_QUANT_MMA", "1")
    on = dispatch.get_ops("cpu", "triton")
    again = dispatch.get_ops("cpu", "triton")
    assert on.quant_mma is True and on.int4_linear.keywords["mma"] is True
    pool = on.fp8_linear.keywords["counters"]
    assert on.normed_swiglu.keywords == {"mma": True, "counters": pool}  # (int4's split-K)
    assert on.int8_linear.keywords["counters"] is pool is not again.fp8_linear.keywords["counters"]
    assert dispatch.get_ops("cpu", "torch").quant_mma is False
    monkeypatch.delenv("INFERGRAFT_QUANT_MMA")
    auto = dispatch.get_ops("cpu", "triton")
    assert auto.quant_mma == "auto" and auto.int4_linear.keywords["mma"] == "auto"
    assert auto.normed_qkv_rope.keywords == {"mma": "auto",
                                             "counters": auto.int4_linear.keywords["counters"]}
    assert auto.int8_linear.keywords["counters"] is auto.int4_linear.keywords["counters"]
    assert dispatch.get_ops("cpu", "torch").quant_mma is False
    monkeypatch.setenv("INFERGRAFT_QUANT_MMA", "0")
    off = dispatch.get_ops("cpu", "triton")
    assert off.quant_mma is False and off.int4_linear is int4_linear.int4_linear_triton
