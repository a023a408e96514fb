"""paged_attention: Triton vs the torch reference (and the reference vs plain math),
random block tables, GQA ratios 1/3/4/8, sliding windows, int8 K/V, and split-KV
(flash-decoding) with forced and automatic split counts, split by the actual length,
merged by the last split to finish (semaphores) or by a second kernel."""
import functools
import itertools
import math

import pytest
import torch

from infergraft.kernels.kv_write import quantize_int8_torch
from infergraft.kernels import paged_attention as pa
from infergraft.kernels import paged_plan
from infergraft.kernels._triton import next_pow2
from infergraft.kernels.paged_attention import (launch_plan, paged_attention_torch,
                                                paged_attention_triton, split_len, split_plan)

from .tolerances import assert_close


def _paged(randn, gen, lens, hkv, d, bs, dtype, int8, device, width=0):
    """A cache whose unused blocks and slots are NaN, and each sequence's K/V in order;
    table entries past a sequence's blocks (at least ``width`` columns) name a NaN block."""
    need = [math.ceil(n / bs) for n in lens]
    nb = sum(need) + 3  # spare blocks: never referenced, poisoned
    order = torch.randperm(nb, generator=gen)
    tables = torch.full((len(lens), max(max(need), width)), int(order[-1]), dtype=torch.int32)
    k = randn(nb, bs, hkv, d, dtype=dtype)
    v = randn(nb, bs, hkv, d, dtype=dtype)
    k[:], v[:] = float("nan"), float("nan")
    ks = vs = None
    if int8:
        kq, vq = (torch.zeros(nb, bs, hkv, d, dtype=torch.int8, device=device) for _ in "kv")
        ks, vs = (torch.full((nb, bs, hkv), float("nan"), device=device) for _ in "kv")
    seqs, used = [], 0
    for b, (n, m) in enumerate(zip(lens, need)):
        blocks = order[used:used + m]
        used += m
        tables[b, :m] = blocks
        kb, vb = randn(n, hkv, d, dtype=dtype), randn(n, hkv, d, dtype=dtype)
        pos = torch.arange(n)
        idx0, idx1 = blocks[pos // bs].to(device), (pos % bs).to(device)
        if int8:
            for x, c, s in ((kb, kq, ks), (vb, vq, vs)):
                qx, sx = quantize_int8_torch(x)
                c[idx0, idx1], s[idx0, idx1] = qx, sx
            kb = (quantize_int8_torch(kb)[0].float() * quantize_int8_torch(kb)[1][..., None])
            vb = (quantize_int8_torch(vb)[0].float() * quantize_int8_torch(vb)[1][..., None])
        else:
            k[idx0, idx1], v[idx0, idx1] = kb, vb
        seqs.append((kb.float().cpu(), vb.float().cpu()))
    if int8:
        k, v = kq, vq
    return k, v, ks, vs, tables.to(device), seqs


def _naive(q, seqs, scale, window):
    """Per sequence and head, softmax(q k^T) v in float64 over the visible keys."""
    out = []
    for qb, (kb, vb) in zip(q.double(), seqs):
        n, group = kb.shape[0], q.shape[1] // kb.shape[1]
        lo = max(0, n - window) if window else 0
        kk = kb[lo:].double().repeat_interleave(group, 1)  # [L, Hq, D]
        vv = vb[lo:].double().repeat_interleave(group, 1)
        p = (torch.einsum("hd,lhd->hl", qb, kk) * scale).softmax(-1)
        out.append(torch.einsum("hl,lhd->hd", p, vv))
    return torch.stack(out)


CASES = [  # (Hq, Hkv, D, block_size, lens)
    (4, 4, 16, 16, [1, 37, 80]),     # MHA
    (6, 2, 24, 5, [9, 1, 33, 64]),   # GQA 3, odd head_dim and block size
    (8, 2, 64, 16, [70, 16, 17]),    # GQA 4, lengths at block edges
    (8, 1, 32, 8, [3, 41]),          # MQA, ratio 8
]


@pytest.mark.parametrize("int8", [False, True], ids=["float", "int8"])
@pytest.mark.parametrize("window", [None, 7, 1], ids=["full", "window7", "window1"])
@pytest.mark.parametrize("hq,hkv,d,bs,lens", CASES, ids=["mha", "gqa3", "gqa4", "mqa8"])
def test_paged_attention_matches_reference(device, dtype, randn, gen, poisoned_empty,
                                           hq, hkv, d, bs, lens, window, int8):
    k, v, ks, vs, tables, seqs = _paged(randn, gen, lens, hkv, d, bs, dtype, int8, device)
    q = randn(len(lens), hq, d, dtype=dtype)
    ctx = torch.tensor(lens, dtype=torch.int32, device=device)
    scale = d ** -0.5
    out = paged_attention_triton(q, k, v, tables, ctx, scale, window, ks, vs)
    ref = paged_attention_torch(q, k, v, tables, ctx, scale, window, ks, vs)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close(out, ref, f"Hq={hq} Hkv={hkv} window={window} int8={int8}")
    # and the reference is the plain math (float64, one sequence and head at a time)
    torch.testing.assert_close(ref.double().cpu(), _naive(q.cpu(), seqs, scale, window).to(ref.dtype).double(),
                               atol=2e-3 if dtype != torch.float32 else 1e-5,
                               rtol=2e-3 if dtype != torch.float32 else 1e-5)


def test_window_longer_than_sequence_is_full_attention(device, randn, gen):
    k, v, _, _, tables, _ = _paged(randn, gen, [5, 12], 2, 16, 4, torch.float32, False, device)
    q = randn(2, 4, 16)
    ctx = torch.tensor([5, 12], device=device)
    full = paged_attention_triton(q, k, v, tables, ctx, 0.25)
    assert_close(paged_attention_triton(q, k, v, tables, ctx, 0.25, window=100), full)
    assert not torch.allclose(paged_attention_triton(q, k, v, tables, ctx, 0.25, window=3), full)


def test_paged_attention_rejects_bad_inputs(device, randn, gen):
    k, v, _, _, tables, _ = _paged(randn, gen, [5, 9], 2, 16, 4, torch.float32, False, device)
    q = randn(2, 4, 16)
    ctx = torch.tensor([5, 9], dtype=torch.int32, device=device)
    with pytest.raises(AssertionError, match="not a multiple of Hkv"):
        paged_attention_triton(randn(2, 3, 16), k, v, tables, ctx, 0.25)
    with pytest.raises(AssertionError, match="must equal q dtype"):
        paged_attention_triton(q.half(), k, v, tables, ctx, 0.25)
    with pytest.raises(AssertionError, match="int8 K/V need k_scale"):
        paged_attention_triton(q, k.to(torch.int8), v.to(torch.int8), tables, ctx, 0.25)
    with pytest.raises(AssertionError, match="block_tables must be"):
        paged_attention_triton(q, k, v, tables[:1], ctx, 0.25)
    with pytest.raises(AssertionError, match="context_lens must be"):
        paged_attention_triton(q, k, v, tables, ctx.float(), 0.25)
    with pytest.raises(AssertionError, match="window"):
        paged_attention_triton(q, k, v, tables, ctx, 0.25, window=0)
    with pytest.raises(AssertionError, match="num_splits"):
        paged_attention_triton(q, k, v, tables, ctx, 0.25, num_splits=0)
    with pytest.raises(AssertionError, match="block_n"):
        paged_attention_triton(q, k, v, tables, ctx, 0.25, block_n=24)


SPLIT_CASES = [  # (Hq, Hkv, D, block_size, lens, table width in blocks, block_n)
    (4, 4, 16, 4, [1, 5, 37], 40, 16),           # MHA; contexts much shorter than the table
    (8, 2, 32, 16, [1, 17, 63, 100], 8, 32),     # GQA 4; lengths off block and tile edges
    (6, 2, 24, 5, [2, 49], 20, 64),              # GQA 3, odd head_dim and block size
]


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, None], ids=lambda s: f"S{s or 'auto'}")
@pytest.mark.parametrize("window", [None, 5, 37], ids=["full", "window5", "window37"])
@pytest.mark.parametrize("int8", [False, True], ids=["float", "int8"])
@pytest.mark.parametrize("hq,hkv,d,bs,lens,width,block_n", SPLIT_CASES, ids=["mha", "gqa4", "gqa3"])
def test_split_kv_matches_reference(device, dtype, randn, gen, poisoned_empty, hq, hkv, d, bs,
                                    lens, width, block_n, window, int8, num_splits):
    # unused cache blocks, table padding and the (torch.empty) scratch are all NaN
    k, v, ks, vs, tables, seqs = _paged(randn, gen, lens, hkv, d, bs, dtype, int8, device, width)
    q = randn(len(lens), hq, d, dtype=dtype)
    ctx = torch.tensor(lens, dtype=torch.int32, device=device)
    scale = d ** -0.5
    out = paged_attention_triton(q, k, v, tables, ctx, scale, window, ks, vs,
                                 num_splits=num_splits, block_n=block_n)
    ref = paged_attention_torch(q, k, v, tables, ctx, scale, window, ks, vs)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close(out, ref, f"S={num_splits} block_n={block_n} window={window} int8={int8}")


@pytest.mark.parametrize("block_n,num_warps,num_stages", [(16, 8, 2), (128, 4, 1)])
def test_tuning_knobs(device, randn, gen, poisoned_empty, block_n, num_warps, num_stages):
    k, v, _, _, tables, _ = _paged(randn, gen, [3, 150], 2, 32, 16, torch.float32, False, device, 12)
    q = randn(2, 4, 32)
    ctx = torch.tensor([3, 150], dtype=torch.int32, device=device)
    out = paged_attention_triton(q, k, v, tables, ctx, 0.2, block_n=block_n, num_warps=num_warps,
                                 num_stages=num_stages)
    assert_close(out, paged_attention_torch(q, k, v, tables, ctx, 0.2))


def test_split_plan_depends_on_shapes_only():
    # LLaMA-2-7B decode on an H200 (132 SMs): table of 576 tokens, BLOCK_N 64 -> 9 tiles
    assert split_plan(1, 32, 576, None, 132, 64) == 9      # one tile per split
    assert split_plan(8, 32, 576, None, 132, 64) == 5      # 1,280 programs
    assert split_plan(16, 32, 576, None, 132, 32) == 3     # 512 pairs: under 4 per SM
    assert split_plan(32, 32, 576, None, 132, 32) == 1     # 1,024 pairs: enough already
    assert split_plan(64, 32, 576, None, 132, 64) == 1
    assert split_plan(1, 8, 576, 100, 132, 64) == 2        # splits the window length
    assert split_plan(1, 8, 40, 4096, 132, 64) == 1        # window wider than the table
    assert split_plan(1, 32, 2048, None, 132, 32) == 32    # 33 wanted: 2 of 64 tiles each
    assert split_plan(4, 2, 576, None, 4, 64, num_splits=7) == 7  # forced S kept
    assert split_plan(4, 2, 64, None, 4, 64, num_splits=3) == 3   # even if some are empty
    for bsz in (1, 3, 8, 32, 64, 256):
        for width in (16, 100, 576, 4096):
            for window in (None, 1, 37, 1000):
                s = split_plan(bsz, 8, width, window, 132, 32)
                span = min(window, width) if window else width
                p = split_len(span, s, 32)  # at the longest span no split is empty
                assert s >= 1 and p % 32 == 0 and s * p >= span and (s - 1) * p < span
    for visible in range(1, 200):  # whole tiles, as few as cover the keys
        for s in (1, 2, 3, 7, 16):
            p = split_len(visible, s, 16)
            assert p % 16 == 0 and s * p >= visible and p - 16 < -(-visible // s)


def test_launch_plan_takes_two_wave_tiles_for_mid_sized_steps():
    # an H200 (132 SMs), 576-token table, 32 query heads: (S, keys per tile, warps, stages)
    def plan(bsz, hkv=32, window=None, wide=True, **forced):
        s, bn, tune = launch_plan(bsz, hkv, 576, window, 132, group=32 // hkv, wide_tiles=wide,
                                  **forced)
        return s, bn, tune["num_warps"], tune["num_stages"]
    assert plan(1) == (18, 32, 4, 2)        # few pairs: split_plan, 32-key tiles
    assert plan(4) == (9, 32, 4, 2)         # 128 pairs: under 1.5 x SMs
    assert plan(8) == (2, 64, 4, 2)         # LLaMA-2-7B (MHA), 256 pairs: 3 per SM
    assert plan(32, hkv=8) == (1, 128, 8, 2)              # GQA, 256 pairs: 1 per SM
    assert plan(12) == (1, 64, 4, 2)        # 384 pairs
    assert plan(48, hkv=8) == (2, 32, 2, 4)
    assert plan(16) == plan(64, hkv=8) == (1, 64, 4, 3)   # 512 pairs: 2 per SM, both
    assert plan(32) == plan(64) == (1, 32, 2, 4)          # >= 4 x SMs: unsplit, as before
    assert plan(48, hkv=8, window=20) == (1, 32, 2, 4)    # a 20-key window fills one tile
    assert plan(8, wide=False) == (5, 32, 4, 2)           # float32 / int8 K/V, head_dim > 128
    assert plan(8, num_splits=3) == (3, 32, 4, 2)         # forced knobs keep split_plan
    assert plan(8, block_n=128) == (5, 128, 4, 2)
    assert plan(8, num_warps=8)[:3] == (2, 64, 8)         # warps / stages alone: overridden
    for bsz, hkv, width, window in itertools.product((1, 3, 8, 12, 16, 40, 64), (1, 8, 32),
                                                     (16, 100, 576, 4096), (None, 1, 37, 1000)):
        for group in (1, 4):
            s, bn, _ = launch_plan(bsz, hkv, width, window, 132, group=group, wide_tiles=True)
            span = min(window, width) if window else width
            assert s >= 1 and bn in (32, 64, 128) and s <= -(-span // bn), (bsz, hkv, width, window)


@pytest.mark.parametrize("pairs_per_sm", [1.6, 2.6, 3.5], ids=["lo", "mid", "hi"])
@pytest.mark.parametrize("hq", [2, 4], ids=["mha", "gqa2"])
@pytest.mark.parametrize("window", [None, 40], ids=["full", "window40"])
def test_mid_plans_match_reference(device, dtype, randn, gen, poisoned_empty, pairs_per_sm, hq,
                                   window):
    # batches that land in each MID_PLANS(_MHA) row on this device (4 "SMs" in the interpreter)
    hkv, d, bs = 2, 32, 16
    sms = pa._sm_count(torch.device(device))
    bsz = math.ceil(pairs_per_sm * sms / hkv)
    lens = torch.randint(1, 200, (bsz,), generator=gen).tolist()
    k, v, _, _, tables, _ = _paged(randn, gen, lens, hkv, d, bs, dtype, False, device, 13)
    q = randn(bsz, hq, d, dtype=dtype)
    ctx = torch.tensor(lens, dtype=torch.int32, device=device)
    out = paged_attention_triton(q, k, v, tables, ctx, d ** -0.5, window)
    assert_close(out, paged_attention_torch(q, k, v, tables, ctx, d ** -0.5, window),
                 f"{bsz} sequences, window {window}")
    s, bn, _ = launch_plan(bsz, hkv, 13 * bs, window, sms, group=hq // hkv,
                           wide_tiles=dtype != torch.float32)
    if dtype != torch.float32:  # the mid-sized plans are for 16-bit K/V only
        table = paged_plan.MID_PLANS_MHA if hq == hkv else paged_plan.MID_PLANS
        want = table[[1.6, 2.6, 3.5].index(pairs_per_sm)][1]
        assert (s, bn) == (min(want[0], -(-min(window or 208, 208) // want[1])), want[1])


def _combine_launches(monkeypatch) -> list:
    """Record launches of the second (combine) kernel."""
    launches, real = [], pa._paged_combine_kernel
    spy = type("Spy", (), {"__getitem__": lambda self, grid: launches.append(grid) or real[grid]})
    monkeypatch.setattr(pa, "_paged_combine_kernel", spy())
    return launches


@pytest.fixture
def shared_counters(monkeypatch):
    """An empty shared counter pool for this test only."""
    pool = paged_plan.CounterPool()
    monkeypatch.setattr(paged_plan, "SHARED_COUNTERS", pool)
    monkeypatch.setattr(pa, "SHARED_COUNTERS", pool)
    return pool


WIDE = 2048  # table tokens: a graph captured for long contexts, replayed with short ones


@pytest.mark.parametrize("num_splits", [1, 3, 16, None], ids=lambda s: f"S{s or 'auto'}")
@pytest.mark.parametrize("window", [None, 20], ids=["full", "window20"])
@pytest.mark.parametrize("int8", [False, True], ids=["float", "int8"])
def test_short_contexts_in_a_wide_table(device, dtype, randn, gen, poisoned_empty, num_splits,
                                        window, int8):
    lens, bs = [1, 5, 33, 576], 16
    k, v, ks, vs, tables, _ = _paged(randn, gen, lens, 1, 16, bs, dtype, int8, device, WIDE // bs)
    q = randn(len(lens), 2, 16, dtype=dtype)
    ctx = torch.tensor(lens, dtype=torch.int32, device=device)
    out = paged_attention_triton(q, k, v, tables, ctx, 0.25, window, ks, vs, num_splits=num_splits)
    assert_close(out, paged_attention_torch(q, k, v, tables, ctx, 0.25, window, ks, vs),
                 f"S={num_splits} window={window} int8={int8}")


@pytest.mark.parametrize("window", [None, 20], ids=["full", "window20"])
def test_splits_follow_the_actual_length(device, randn, gen, poisoned_empty, monkeypatch, window):
    # the two-kernel path's scratch m [B, Hq, S]: finite where a split had keys
    lens, bs, nsplit = [576, 33, 1], 16, 16
    k, v, _, _, tables, _ = _paged(randn, gen, lens, 1, 16, bs, torch.float32, False, device,
                                   WIDE // bs)
    q = randn(len(lens), 1, 16)
    ctx = torch.tensor(lens, dtype=torch.int32, device=device)
    scratch, real_empty = [], torch.empty

    def empty(*args, **kwargs):
        scratch.append(real_empty(*args, **kwargs))
        return scratch[-1]
    monkeypatch.setattr(torch, "empty", empty)
    out = paged_attention_triton(q, k, v, tables, ctx, 0.25, window, num_splits=nsplit,
                                 fused_combine=False)
    assert_close(out, paged_attention_torch(q, k, v, tables, ctx, 0.25, window))
    m = next(t for t in scratch if t.shape == (2, len(lens), 1, nsplit))[0, :, 0].cpu()  # [B, S]
    for b, n in enumerate(lens):
        visible = min(n, window or n)
        busy = -(-visible // split_len(visible, nsplit, 32))  # 9 of 16 for 576 keys (not 5)
        assert torch.isfinite(m[b, :busy]).all() and (m[b, busy:] == float("-inf")).all(), (n, m[b])


FUSED_CASES = [  # (Hq, Hkv, D, block_size, lens, table width in blocks, num_splits, window)
    (6, 2, 24, 5, [9, 1, 33, 64], 20, 4, None),  # GQA 3: a padding head in the merge
    (8, 1, 32, 8, [3, 41], 10, 5, 7),            # MQA, ratio 8, a window
    (2, 2, 16, 16, [1, 80], 8, None, None),      # MHA, automatic S (few pairs: split)
]


@pytest.mark.parametrize("merge", ["default", "one-head", "too-big"])
@pytest.mark.parametrize("hq,hkv,d,bs,lens,width,num_splits,window", FUSED_CASES,
                         ids=["gqa3", "mqa8", "mha"])
def test_fused_combine_matches_two_kernels(device, dtype, randn, gen, poisoned_empty, monkeypatch,
                                           shared_counters, hq, hkv, d, bs, lens, width,
                                           num_splits, window, merge):
    nsplit, _, _ = launch_plan(len(lens), hkv, width * bs, window,
                               pa._sm_count(torch.device(device)), group=hq // hkv,
                               wide_tiles=dtype != torch.float32, num_splits=num_splits)
    one_head = next_pow2(nsplit) * max(16, next_pow2(d))  # [1, S, D]: a loop over the group
    monkeypatch.setattr(pa, "MERGE_ELEMS", {"default": pa.MERGE_ELEMS, "one-head": one_head,
                                            "too-big": one_head - 1}[merge])
    k, v, _, _, tables, _ = _paged(randn, gen, lens, hkv, d, bs, dtype, False, device, width)
    q = randn(len(lens), hq, d, dtype=dtype)
    ctx = torch.tensor(lens, dtype=torch.int32, device=device)
    launches = _combine_launches(monkeypatch)
    run = functools.partial(paged_attention_triton, q, k, v, tables, ctx, d ** -0.5, window,
                            num_splits=num_splits)
    fused = run(fused_combine=True)
    assert len(launches) == (merge == "too-big")  # else no second kernel
    two = run(fused_combine=False)
    assert len(launches) == 1 + (merge == "too-big")
    ref = paged_attention_torch(q, k, v, tables, ctx, d ** -0.5, window)
    assert_close(fused, ref, "fused")
    assert_close(two, ref, "two kernels")
    assert_close(fused, two, "fused vs two kernels")


def test_semaphores_are_zero_again_for_the_next_call(device, randn, gen, poisoned_empty,
                                                     shared_counters):
    # the same buffers with new lengths written in place: what a CUDA graph replay does
    k, v, _, _, tables, _ = _paged(randn, gen, [128] * 3, 2, 16, 8, torch.float32, False, device)
    q = randn(3, 4, 16)
    ctx = torch.zeros(3, dtype=torch.int32, device=device)
    for lens in ([100, 7, 64], [3, 90, 1], [128, 128, 128]):
        ctx.copy_(torch.tensor(lens))
        out = paged_attention_triton(q, k, v, tables, ctx, 0.25, num_splits=4)
        assert_close(out, paged_attention_torch(q, k, v, tables, ctx, 0.25), f"lens {lens}")
        (sems,) = shared_counters._buffers.values()  # one buffer, allocated by the first call
        assert sems.dtype == torch.int32 and (sems == 0).all(), sems[:6]


def test_callers_own_counter_pools_share_no_counters(device, randn, gen, poisoned_empty,
                                                     shared_counters):
    # two engines (each cache its own pool) replaying on two streams must not count on
    # the same counters: each call takes its caller's pool, the shared one stays unused
    k, v, _, _, tables, _ = _paged(randn, gen, [70, 33], 2, 16, 8, torch.float32, False, device, 16)
    q = randn(2, 4, 16)
    ctx = torch.tensor([70, 33], dtype=torch.int32, device=device)
    ref = paged_attention_torch(q, k, v, tables, ctx, 0.25)
    pools = [paged_plan.CounterPool(), paged_plan.CounterPool()]
    for pool in pools:
        out = paged_attention_triton(q, k, v, tables, ctx, 0.25, num_splits=3, counters=pool)
        assert_close(out, ref)
    (a,), (b,) = (list(p._buffers.values()) for p in pools)
    assert a is not b and a.data_ptr() != b.data_ptr() and (a == 0).all() and (b == 0).all()
    assert not shared_counters._buffers  # the shared pool was never drawn on


def test_capture_that_would_grow_the_semaphores_falls_back(device, randn, gen, poisoned_empty,
                                                           monkeypatch, shared_counters):
    k, v, _, _, tables, _ = _paged(randn, gen, [50, 9], 2, 16, 8, torch.float32, False, device, 16)
    q = randn(2, 4, 16)  # the buffers are keyed by a tensor's device (cuda:0, not cuda)
    ctx = torch.tensor([50, 9], dtype=torch.int32, device=device)
    ref = paged_attention_torch(q, k, v, tables, ctx, 0.25)
    launches = _combine_launches(monkeypatch)
    small = torch.zeros(3, dtype=torch.int32, device=device)
    shared_counters._buffers[q.device] = small
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert_close(paged_attention_triton(q, k, v, tables, ctx, 0.25, num_splits=3), ref)
    assert len(launches) == 1  # needs 2 x 2 counters: two kernels, no allocation in the capture
    assert shared_counters._buffers[q.device] is small and not shared_counters._retired
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert_close(paged_attention_triton(q, k, v, tables, ctx, 0.25, num_splits=3), ref)
    grown = shared_counters._buffers[q.device]
    assert len(launches) == 1 and grown.numel() >= 4  # grown outside a capture: fused
    assert len(shared_counters._retired) == 1 and shared_counters._retired[0] is small  # kept alive
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert_close(paged_attention_triton(q, k, v, tables, ctx, 0.25, num_splits=3), ref)
    assert len(launches) == 1 and shared_counters._buffers[q.device] is grown  # fused, as is
    assert (grown == 0).all()
