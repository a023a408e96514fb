"""paged_plan: the split count and tiles of a decode-attention call (from shapes only,
checked against the torch reference where a plan changes the kernel) and the merge
counters (``CounterPool``: zero again after each call, one pool per caller, no growth
inside a CUDA graph capture)."""
import itertools
import math

import pytest
import torch

from infergraft.kernels import paged_attention as pa
from infergraft.kernels import paged_plan
from infergraft.kernels.paged_attention import (launch_plan, paged_attention_torch,
                                                paged_attention_triton, split_len, split_plan)

from .test_paged_attention import _combine_launches, _paged
from .tolerances import assert_close

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
    assert plan(96, hkv=8) == (1, 32, 2, 4)               # GQA, 768 pairs: the same
    assert plan(128, hkv=8) == plan(256, hkv=8) == (1, 64, 4, 2)  # GQA from 7.5 x SMs
    assert plan(128, hkv=8, window=20) == (1, 64, 4, 2)   # one tile either way
    assert plan(128) == (1, 32, 2, 4)                     # MHA keeps 2-warp tiles
    assert plan(128, hkv=8, wide=False) == plan(128, hkv=8, block_n=32) == (1, 32, 2, 4)
    assert plan(48, hkv=8, window=20) == (1, 32, 2, 4)    # a 20-key window fills one tile
    assert plan(8, wide=False) == (5, 32, 4, 2)           # float32 / int8 K/V, head_dim > 128
    assert plan(8, num_splits=3) == (3, 32, 4, 2)         # forced knobs keep split_plan
    assert plan(8, block_n=128) == (5, 128, 4, 2)
    assert plan(8, num_warps=8)[:3] == (2, 64, 8)         # warps / stages alone: overridden
    for bsz, hkv, width, window in itertools.product((1, 3, 8, 12, 16, 40, 64, 128, 256),
                                                     (1, 8, 32),
                                                     (16, 100, 576, 4096), (None, 1, 37, 1000)):
        for group in (1, 4):
            s, bn, _ = launch_plan(bsz, hkv, width, window, 132, group=group, wide_tiles=True)
            span = min(window, width) if window else width
            assert s >= 1 and bn in (32, 64, 128) and s <= -(-span // bn), (bsz, hkv, width, window)


def _plan_vs_reference(device, dtype, randn, gen, pairs_per_sm, hq, window):
    """Decode attention for a batch of ``pairs_per_sm`` x this device's SMs of (sequence, kv
    head) pairs (4 "SMs" in the interpreter), checked against the torch reference; returns
    the call's plan (S, keys per tile, warps, stages)."""
    hkv, d, bs = 2, 32, 16
    sms = pa._sm_count(torch.device(device))
    bsz = math.ceil(pairs_per_sm * sms / hkv)
    lens = torch.randint(1, 200, (bsz,), generator=gen).tolist()
    k, v, _, _, tables, _ = _paged(randn, gen, lens, hkv, d, bs, dtype, None, device, 13)
    q = randn(bsz, hq, d, dtype=dtype)
    ctx = torch.tensor(lens, dtype=torch.int32, device=device)
    out = paged_attention_triton(q, k, v, tables, ctx, d ** -0.5, window)
    assert_close(out, paged_attention_torch(q, k, v, tables, ctx, d ** -0.5, window),
                 f"{bsz} sequences, window {window}")
    s, bn, tune = launch_plan(bsz, hkv, 13 * bs, window, sms, group=hq // hkv,
                              wide_tiles=dtype != torch.float32)
    return s, bn, tune["num_warps"], tune["num_stages"]


@pytest.mark.parametrize("pairs_per_sm", [1.6, 2.6, 3.5], ids=["lo", "mid", "hi"])
@pytest.mark.parametrize("hq", [2, 4], ids=["mha", "gqa2"])
@pytest.mark.parametrize("window", [None, 40], ids=["full", "window40"])
def test_mid_plans_match_reference(device, dtype, randn, gen, poisoned_empty, pairs_per_sm, hq,
                                   window):
    # batches that land in each MID_PLANS(_MHA) row
    s, bn, _, _ = _plan_vs_reference(device, dtype, randn, gen, pairs_per_sm, hq, window)
    if dtype != torch.float32:  # the mid-sized plans are for 16-bit K/V only
        table = paged_plan.MID_PLANS_MHA if hq == 2 else paged_plan.MID_PLANS
        want = table[[1.6, 2.6, 3.5].index(pairs_per_sm)][1]
        assert (s, bn) == (min(want[0], -(-min(window or 208, 208) // want[1])), want[1])


@pytest.mark.parametrize("window", [None, 40], ids=["full", "window40"])
def test_large_gqa_plan_matches_reference(device, dtype, randn, gen, poisoned_empty, window):
    # past LARGE_PLAN_GQA's threshold: one program per pair, 64-key tiles (16-bit K/V)
    plan = _plan_vs_reference(device, dtype, randn, gen, paged_plan.LARGE_PLAN_GQA[0], 4, window)
    assert plan == ((1, 64, 4, 2) if dtype != torch.float32 else (1, 32, 2, 4))


def test_semaphores_are_zero_again_for_the_next_call(device, randn, gen, poisoned_empty,
                                                     shared_counters):
    # the same buffers with new lengths written in place: what a CUDA graph replay does
    k, v, _, _, tables, _ = _paged(randn, gen, [128] * 3, 2, 16, 8, torch.float32, None, device)
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
    k, v, _, _, tables, _ = _paged(randn, gen, [70, 33], 2, 16, 8, torch.float32, None, device, 16)
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
    k, v, _, _, tables, _ = _paged(randn, gen, [50, 9], 2, 16, 8, torch.float32, None, device, 16)
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
