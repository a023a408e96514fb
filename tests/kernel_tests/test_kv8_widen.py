"""kv8.py: each way of widening 8-bit K/V in decode and varlen attention
(``INFERGRAFT_KV8_WIDEN``: cvt, f16, words, words16) against the torch references, with
int8 and e4m3 caches: quantised random K/V (MHA, GQA, windows, softcap, splits), then every
byte code (e4m3 subnormals, zeros, negatives; int8 -128..127) under scales spread over
many decades and q far from 1; the fp16 rows of q exactly; which mode a launch takes and
its key tiles. CUDA cases run the inline assembly (``fp8_mma``'s), the CPU its converts."""
import pytest
import torch

from infergraft.kernels import kv8, switches
from infergraft.kernels._triton import HAVE_TRITON, interpreting, tl, triton
from infergraft.kernels.paged_attention import paged_attention_torch, paged_attention_triton
from infergraft.kernels.paged_plan import launch_plan
from infergraft.kernels.varlen_attention import varlen_attention_torch, varlen_attention_triton

from .test_paged_attention import _paged
from .test_varlen_attention import _run
from .tolerances import assert_close

MODES = pytest.mark.parametrize("mode", ["f16", "words", "words16"])
KV8 = pytest.mark.parametrize("kv_quant", [torch.int8, torch.float8_e4m3fn],
                              ids=["int8", "fp8"])


def _expected_mode(mode, dtype, d):
    """The mode a launch takes: float32 q keeps ``cvt``; the word modes need a padded
    head_dim >= 64 (else ``f16``)."""
    if dtype == torch.float32:
        return kv8.CVT
    if mode.startswith("words") and d < 64:
        return kv8.F16
    return kv8.MODES.index(mode)


@MODES
@KV8
@pytest.mark.parametrize("hq,hkv,d,bs,lens,window,softcap,splits", [
    (4, 4, 64, 16, [1, 37, 80], None, None, None),     # MHA, words
    (8, 2, 128, 16, [70, 16, 33], 7, 5.0, 3),          # GQA 4, window, softcap, 3 splits
    (6, 2, 24, 5, [9, 1, 33], None, None, 2),          # GQA 3, odd head_dim: words -> f16
], ids=["mha64", "gqa4-128-window-softcap-S3", "gqa3-24"])
def test_decode_modes_match_reference(device, dtype, randn, gen, poisoned_empty, monkeypatch,
                                      mode, kv_quant, hq, hkv, d, bs, lens, window, softcap,
                                      splits):
    monkeypatch.setenv("INFERGRAFT_KV8_WIDEN", mode)
    k, v, ks, vs, tables, _ = _paged(randn, gen, lens, hkv, d, bs, dtype, kv_quant, device)
    q = randn(len(lens), hq, d, dtype=dtype) * (4.0 if softcap else 1.0)
    assert kv8.widen_mode(q, k) == _expected_mode(mode, dtype, d)
    ctx = torch.tensor(lens, dtype=torch.int32, device=device)
    out = paged_attention_triton(q, k, v, tables, ctx, d ** -0.5, window, ks, vs,
                                 softcap=softcap, num_splits=splits)
    ref = paged_attention_torch(q, k, v, tables, ctx, d ** -0.5, window, ks, vs,
                                softcap=softcap)
    assert_close(out, ref, f"{mode} {kv_quant} Hq={hq} Hkv={hkv} D={d}")


@MODES
@KV8
@pytest.mark.parametrize("hq,hkv,d,bs,seqs,pad,window,knobs", [
    # MHA: a fresh prompt and decode tokens (64-row and 16-row tiles), padding rows
    (4, 4, 64, 16, [(0, 21), (36, 1), (79, 1)], 3, None, {}),
    # GQA 4, window, softcap, split keys; decode-heavy (the decode plan)
    (8, 2, 128, 8, [(40, 1), (3, 1), (100, 1), (7, 2)], 0, 6, dict(softcap=3.0, num_splits=3)),
], ids=["mha64", "gqa4-128-decode-window-softcap-S3"])
def test_varlen_modes_match_reference(device, dtype, randn, gen, poisoned_empty, monkeypatch,
                                      mode, kv_quant, hq, hkv, d, bs, seqs, pad, window,
                                      knobs):
    monkeypatch.setenv("INFERGRAFT_KV8_WIDEN", mode)
    _run(randn, gen, device, dtype, hq, hkv, d, bs, seqs, pad, window, kv_quant,
         check_naive=False, q_scale=4.0 if knobs else 1.0, **knobs)


def _every_code(gen, shape, kv_quant, device):
    """8-bit values of ``shape`` drawn from every code: e4m3 all but NaN (subnormals, +-0,
    +-448), int8 -128..127 (-128 too, which the quantiser never writes)."""
    if kv_quant == torch.float8_e4m3fn:
        codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    else:
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    pick = torch.randint(len(codes), shape, generator=gen)
    return codes[pick].view(kv_quant).to(device)


def _spread_scales(gen, shape, lo, hi, device):
    """Scales 10^u, u uniform in [lo, hi]; every 7th exactly 0 (an all-zero row's)."""
    s = 10 ** (torch.rand(shape, generator=gen, dtype=torch.float64) * (hi - lo) + lo)
    s = s.float().flatten()
    s[::7] = 0.0
    return s.view(shape).to(device)


def _magnitudes(v):
    """|v| in v's 8-bit format (int8 -128 as 127): attention over it bounds each output
    row's terms sum p |v|, the scale of rounding errors where signed terms cancel."""
    if v.dtype == torch.float8_e4m3fn:
        return (v.view(torch.uint8) & 0x7F).view(torch.float8_e4m3fn)
    return v.to(torch.int16).abs().clamp(max=127).to(torch.int8)


def _close_to_terms(out, ref, bound, dtype, msg):
    """|out - ref| within a tolerance of each row's largest sum of |terms| (``bound``)."""
    tol = 4e-3 if dtype == torch.float16 else 2e-2 if dtype == torch.bfloat16 else 1e-4
    top = bound.float().abs().amax(-1, keepdim=True).clamp_min(1e-30)
    err = ((out.float() - ref.float()).abs() / top).max().item()
    assert err <= tol, f"{msg}: error {err:.2e} of the row's sum of |terms| > {tol}"


@MODES
@KV8
@pytest.mark.parametrize("q_gain", [2.0 ** -20, 1.0, 2.0 ** 9], ids=["q-tiny", "q-1", "q-big"])
def test_every_code_and_extreme_scales(device, dtype, gen, poisoned_empty, monkeypatch, mode,
                                       kv_quant, q_gain):
    """Every byte code, k scales over 4 decades (scores of order 1 down to 0), v scales
    over 7 (one tile's p V weighted by 1e-6 beside 10), q tiny or large: decode (split)
    and a varlen step over the same cache match the references."""
    monkeypatch.setenv("INFERGRAFT_KV8_WIDEN", mode)
    hq, hkv, d, bs, lens = 4, 2, 64, 16, [45, 80]
    nb = 12
    k, v = (_every_code(gen, (nb, bs, hkv, d), kv_quant, device) for _ in "kv")
    ks = _spread_scales(gen, (nb, bs, hkv), -6.0, -2.0, device)
    vs = _spread_scales(gen, (nb, bs, hkv), -6.0, 1.0, device)  # |v| <= 4480: fp16 out
    tables = torch.randperm(nb, generator=gen)[:10].view(2, 5).to(torch.int32).to(device)
    ctx = torch.tensor(lens, dtype=torch.int32, device=device)
    q = (torch.randn(2, hq, d, generator=gen) * q_gain).to(device=device, dtype=dtype)
    out = paged_attention_triton(q, k, v, tables, ctx, d ** -0.5, None, ks, vs, num_splits=2)
    ref = paged_attention_torch(q, k, v, tables, ctx, d ** -0.5, None, ks, vs)
    bound = paged_attention_torch(q, k, _magnitudes(v), tables, ctx, d ** -0.5, None, ks, vs)
    _close_to_terms(out, ref, bound, dtype, f"decode {mode} {kv_quant} q x {q_gain}")
    # a varlen step: a chunk of 9 on the first sequence's prefix, one decode token
    cu = torch.tensor([0, 9, 10], dtype=torch.int32, device=device)
    qv = (torch.randn(10, hq, d, generator=gen) * q_gain).to(device=device, dtype=dtype)
    out = varlen_attention_triton(qv, k, v, tables, cu, ctx, d ** -0.5, None, ks, vs)
    ref = varlen_attention_torch(qv, k, v, tables, cu, ctx, d ** -0.5, None, ks, vs)
    bound = varlen_attention_torch(qv, k, _magnitudes(v), tables, cu, ctx, d ** -0.5, None,
                                   ks, vs)
    _close_to_terms(out, ref, bound, dtype, f"varlen {mode} {kv_quant} q x {q_gain}")


if HAVE_TRITON:
    @triton.jit
    def _f16_rows_kernel(x_ptr, y_ptr, down_ptr, M: tl.constexpr, D: tl.constexpr):
        r = tl.arange(0, M)
        c = tl.arange(0, D)
        y, down = kv8.f16_rows(tl.load(x_ptr + r[:, None] * D + c[None, :]))
        tl.store(y_ptr + r[:, None] * D + c[None, :], y)
        tl.store(down_ptr + r, down)


@pytest.mark.skipif(not HAVE_TRITON or not (interpreting() or torch.cuda.is_available()),
                    reason="needs Triton (the interpreter or CUDA)")
def test_f16_rows_are_exact_powers_of_two():
    """Rows of bf16 values from 2^-60 to 2^60 (and a zero row): fp16 row times 2^-e gives
    each value back exactly (those within 2^-20 of the row's largest), the largest lands in
    [2^14, 2^15)."""
    dev = "cpu" if interpreting() else "cuda"
    g = torch.Generator().manual_seed(0)
    gains = 2.0 ** torch.tensor([-60.0, -20.0, 0.0, 14.0, 15.0, 60.0, 0.0, 3.0])
    x = torch.randn(8, 32, generator=g) * gains[:, None]
    x[6] = 0.0
    x = x.to(torch.bfloat16).float().to(dev)  # bf16 values, as float32
    y = torch.empty(8, 32, dtype=torch.float16, device=dev)
    down = torch.empty(8, device=dev)
    _f16_rows_kernel[(1,)](x, y, down, M=8, D=32)
    back = y.float() * down[:, None]
    big = x.abs() >= x.abs().amax(1, keepdim=True) * 2.0 ** -20
    assert torch.equal(back[big], x[big])
    top = y.float().abs().amax(1)
    live = x.abs().amax(1) > 0
    assert ((top[live] >= 2 ** 14) & (top[live] < 2 ** 15)).all(), top
    assert (down > 0).all() and (down == 2.0 ** torch.round(torch.log2(down))).all()


def test_mode_follows_the_switch_and_falls_back(monkeypatch):
    q = torch.zeros(1, 4, 64, dtype=torch.float16)
    cache = torch.zeros(3, 16, 4, 64, dtype=torch.int8)
    assert kv8.widen_mode(q, cache) == kv8.CVT  # the default
    for i, name in enumerate(kv8.MODES):
        monkeypatch.setenv("INFERGRAFT_KV8_WIDEN", name)
        assert kv8.widen_mode(q, cache) == i
        # 16-bit K/V and float32 q never widen 8-bit values
        assert kv8.widen_mode(q, cache.half()) == kv8.CVT
        assert kv8.widen_mode(q.float(), cache) == kv8.CVT
    # words need rows of whole, aligned words: a head_dim of 62, or a cache that starts
    # two bytes into its storage, reads bytes (f16)
    assert kv8.widen_mode(q[..., :62], cache[..., :62]) == kv8.F16
    base = torch.zeros(cache.numel() + 4, dtype=torch.int8)
    assert kv8.widen_mode(q, base[4:].view(cache.shape)) == kv8.WORDS16
    assert kv8.widen_mode(q, base[2:-2].view(cache.shape)) == kv8.F16
    assert kv8.as_words(cache, kv8.WORDS).shape == (3, 16, 4, 16)
    assert kv8.as_words(cache, kv8.F16) is cache
    monkeypatch.setenv("INFERGRAFT_KV8_WIDEN", "bits")
    with pytest.raises(switches.SwitchError,
                       match="INFERGRAFT_KV8_WIDEN='bits' is not one of cvt, f16, words, words16"):
        kv8.widen_mode(q, cache)


def test_8bit_plans_count_key_tiles_by_bytes():
    # LLaMA-2-7B at batch 16 on 132 SMs (MHA, 512 pairs): 16-bit K/V's measured tile, and
    # 8-bit K/V in it with twice the keys; a forced block_n is kept
    sixteen = launch_plan(16, 32, 4032, None, 132, group=1, wide_tiles=True)
    eight = launch_plan(16, 32, 4032, None, 132, group=1, wide_tiles=True, kv_bytes=1)
    assert eight[1] == 2 * sixteen[1] and eight[2] == sixteen[2]
    forced = launch_plan(16, 32, 4032, None, 132, group=1, wide_tiles=True, kv_bytes=1,
                         block_n=32)
    assert forced[1] == 32
