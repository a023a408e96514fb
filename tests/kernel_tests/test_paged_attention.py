"""paged_attention: Triton vs the torch reference (and the reference vs plain math),
random block tables, GQA ratios 1/3/4/8, sliding windows, int8 and e4m3 K/V, and split-KV
(flash-decoding) with forced and automatic split counts, split by the actual length,
merged by the last split to finish (counters) or by a second kernel. Split counts, tiles
and the counter pools themselves: test_paged_plan.py."""
import functools
import math

import pytest
import torch

from infergraft.kernels.kv_write import quantize_kv_torch
from infergraft.kernels import paged_attention as pa
from infergraft.kernels._triton import next_pow2
from infergraft.kernels.paged_attention import (launch_plan, paged_attention_torch,
                                                paged_attention_triton, split_len)

from .tolerances import assert_close

KV_QUANT = pytest.mark.parametrize("kv_quant", [None, torch.int8, torch.float8_e4m3fn],
                                   ids=["float", "int8", "fp8"])


def _paged(randn, gen, lens, hkv, d, bs, dtype, kv_quant, device, width=0):
    """A cache whose unused blocks and slots are NaN, and each sequence's K/V in order;
    table entries past a sequence's blocks (at least ``width`` columns) name a NaN block.
    ``kv_quant`` (torch.int8, float8_e4m3fn or None): the cache's quantised format."""
    need = [math.ceil(n / bs) for n in lens]
    nb = sum(need) + 3  # spare blocks: never referenced, poisoned
    order = torch.randperm(nb, generator=gen)
    tables = torch.full((len(lens), max(max(need), width)), int(order[-1]), dtype=torch.int32)
    k = randn(nb, bs, hkv, d, dtype=dtype)
    v = randn(nb, bs, hkv, d, dtype=dtype)
    k[:], v[:] = float("nan"), float("nan")
    ks = vs = None
    if kv_quant is not None:
        kq, vq = (torch.zeros(nb, bs, hkv, d, dtype=kv_quant, device=device) for _ in "kv")
        ks, vs = (torch.full((nb, bs, hkv), float("nan"), device=device) for _ in "kv")
    seqs, used = [], 0
    for b, (n, m) in enumerate(zip(lens, need)):
        blocks = order[used:used + m]
        used += m
        tables[b, :m] = blocks
        kb, vb = randn(n, hkv, d, dtype=dtype), randn(n, hkv, d, dtype=dtype)
        pos = torch.arange(n)
        idx0, idx1 = blocks[pos // bs].to(device), (pos % bs).to(device)
        if kv_quant is not None:
            for x, c, s in ((kb, kq, ks), (vb, vq, vs)):
                qx, sx = quantize_kv_torch(x, kv_quant)
                c[idx0, idx1], s[idx0, idx1] = qx, sx
            kb, vb = (qx.float() * sx[..., None] for qx, sx in
                      (quantize_kv_torch(kb, kv_quant), quantize_kv_torch(vb, kv_quant)))
        else:
            k[idx0, idx1], v[idx0, idx1] = kb, vb
        seqs.append((kb.float().cpu(), vb.float().cpu()))
    if kv_quant is not None:
        k, v = kq, vq
    return k, v, ks, vs, tables.to(device), seqs


def _naive(q, seqs, scale, window, softcap=None):
    """Per sequence and head, softmax(q k^T) v in float64 over the visible keys (each
    score capped to softcap * tanh(score / softcap) where a softcap is given)."""
    out = []
    for qb, (kb, vb) in zip(q.double(), seqs):
        n, group = kb.shape[0], q.shape[1] // kb.shape[1]
        lo = max(0, n - window) if window else 0
        kk = kb[lo:].double().repeat_interleave(group, 1)  # [L, Hq, D]
        vv = vb[lo:].double().repeat_interleave(group, 1)
        s = torch.einsum("hd,lhd->hl", qb, kk) * scale
        p = (s if softcap is None else softcap * torch.tanh(s / softcap)).softmax(-1)
        out.append(torch.einsum("hl,lhd->hd", p, vv))
    return torch.stack(out)


CASES = [  # (Hq, Hkv, D, block_size, lens)
    (4, 4, 16, 16, [1, 37, 80]),     # MHA
    (6, 2, 24, 5, [9, 1, 33, 64]),   # GQA 3, odd head_dim and block size
    (8, 2, 64, 16, [70, 16, 17]),    # GQA 4, lengths at block edges
    (8, 1, 32, 8, [3, 41]),          # MQA, ratio 8
]


@KV_QUANT
@pytest.mark.parametrize("window", [None, 7, 1], ids=["full", "window7", "window1"])
@pytest.mark.parametrize("hq,hkv,d,bs,lens", CASES, ids=["mha", "gqa3", "gqa4", "mqa8"])
def test_paged_attention_matches_reference(device, dtype, randn, gen, poisoned_empty,
                                           hq, hkv, d, bs, lens, window, kv_quant):
    k, v, ks, vs, tables, seqs = _paged(randn, gen, lens, hkv, d, bs, dtype, kv_quant, device)
    q = randn(len(lens), hq, d, dtype=dtype)
    ctx = torch.tensor(lens, dtype=torch.int32, device=device)
    scale = d ** -0.5
    out = paged_attention_triton(q, k, v, tables, ctx, scale, window, ks, vs)
    ref = paged_attention_torch(q, k, v, tables, ctx, scale, window, ks, vs)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close(out, ref, f"Hq={hq} Hkv={hkv} window={window} kv={kv_quant}")
    # and the reference is the plain math (float64, one sequence and head at a time)
    torch.testing.assert_close(ref.double().cpu(), _naive(q.cpu(), seqs, scale, window).to(ref.dtype).double(),
                               atol=2e-3 if dtype != torch.float32 else 1e-5,
                               rtol=2e-3 if dtype != torch.float32 else 1e-5)


@pytest.mark.parametrize("window,kv_quant,num_splits", [(None, None, 1), (7, torch.int8, 3)],
                         ids=["full", "window7-int8-S3"])
@pytest.mark.parametrize("hq,hkv,d,bs,lens", CASES[1:3], ids=["gqa3", "gqa4"])
def test_softcap_matches_reference(device, dtype, randn, gen, poisoned_empty, hq, hkv, d, bs,
                                   lens, window, kv_quant, num_splits):
    """Gemma 2's cap on the scores (c * tanh(s / c) before the softmax): q scaled up so
    that the cap bites, in one split and across three."""
    k, v, ks, vs, tables, seqs = _paged(randn, gen, lens, hkv, d, bs, dtype, kv_quant, device)
    q = 8 * randn(len(lens), hq, d, dtype=dtype)
    ctx = torch.tensor(lens, dtype=torch.int32, device=device)
    scale, cap = d ** -0.5, 3.0
    out = paged_attention_triton(q, k, v, tables, ctx, scale, window, ks, vs, softcap=cap,
                                 num_splits=num_splits)
    ref = paged_attention_torch(q, k, v, tables, ctx, scale, window, ks, vs, softcap=cap)
    assert_close(out, ref, f"Hq={hq} Hkv={hkv} window={window} kv={kv_quant} softcap={cap}")
    tol = 2e-3 if dtype != torch.float32 else 1e-5
    torch.testing.assert_close(ref.double().cpu(), _naive(q.cpu(), seqs, scale, window, cap)
                               .to(ref.dtype).double(), atol=tol, rtol=tol)
    uncapped = paged_attention_torch(q, k, v, tables, ctx, scale, window, ks, vs)
    assert (ref.float() - uncapped.float()).abs().max() > 0.1, "the cap changed nothing"


def test_window_longer_than_sequence_is_full_attention(device, randn, gen):
    k, v, _, _, tables, _ = _paged(randn, gen, [5, 12], 2, 16, 4, torch.float32, None, device)
    q = randn(2, 4, 16)
    ctx = torch.tensor([5, 12], device=device)
    full = paged_attention_triton(q, k, v, tables, ctx, 0.25)
    assert_close(paged_attention_triton(q, k, v, tables, ctx, 0.25, window=100), full)
    assert not torch.allclose(paged_attention_triton(q, k, v, tables, ctx, 0.25, window=3), full)


def test_paged_attention_rejects_bad_inputs(device, randn, gen):
    k, v, _, _, tables, _ = _paged(randn, gen, [5, 9], 2, 16, 4, torch.float32, None, device)
    q = randn(2, 4, 16)
    ctx = torch.tensor([5, 9], dtype=torch.int32, device=device)
    with pytest.raises(AssertionError, match="not a multiple of Hkv"):
        paged_attention_triton(randn(2, 3, 16), k, v, tables, ctx, 0.25)
    with pytest.raises(AssertionError, match="must equal q dtype"):
        paged_attention_triton(q.half(), k, v, tables, ctx, 0.25)
    with pytest.raises(AssertionError, match="torch.int8 K/V need k_scale"):
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
@KV_QUANT
@pytest.mark.parametrize("hq,hkv,d,bs,lens,width,block_n", SPLIT_CASES, ids=["mha", "gqa4", "gqa3"])
def test_split_kv_matches_reference(device, dtype, randn, gen, poisoned_empty, hq, hkv, d, bs,
                                    lens, width, block_n, window, kv_quant, num_splits):
    # unused cache blocks, table padding and the (torch.empty) scratch are all NaN
    k, v, ks, vs, tables, seqs = _paged(randn, gen, lens, hkv, d, bs, dtype, kv_quant, device, width)
    q = randn(len(lens), hq, d, dtype=dtype)
    ctx = torch.tensor(lens, dtype=torch.int32, device=device)
    scale = d ** -0.5
    out = paged_attention_triton(q, k, v, tables, ctx, scale, window, ks, vs,
                                 num_splits=num_splits, block_n=block_n)
    ref = paged_attention_torch(q, k, v, tables, ctx, scale, window, ks, vs)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close(out, ref, f"S={num_splits} block_n={block_n} window={window} kv={kv_quant}")


@pytest.mark.parametrize("block_n,num_warps,num_stages", [(16, 8, 2), (128, 4, 1)])
def test_tuning_knobs(device, randn, gen, poisoned_empty, block_n, num_warps, num_stages):
    k, v, _, _, tables, _ = _paged(randn, gen, [3, 150], 2, 32, 16, torch.float32, None, device, 12)
    q = randn(2, 4, 32)
    ctx = torch.tensor([3, 150], dtype=torch.int32, device=device)
    out = paged_attention_triton(q, k, v, tables, ctx, 0.2, block_n=block_n, num_warps=num_warps,
                                 num_stages=num_stages)
    assert_close(out, paged_attention_torch(q, k, v, tables, ctx, 0.2))


def _combine_launches(monkeypatch) -> list:
    """Record launches of the second (combine) kernel."""
    launches, real = [], pa._paged_combine_kernel
    spy = type("Spy", (), {"__getitem__": lambda self, grid: launches.append(grid) or real[grid]})
    monkeypatch.setattr(pa, "_paged_combine_kernel", spy())
    return launches


WIDE = 2048  # table tokens: a graph captured for long contexts, replayed with short ones


@pytest.mark.parametrize("num_splits", [1, 3, 16, None], ids=lambda s: f"S{s or 'auto'}")
@pytest.mark.parametrize("window", [None, 20], ids=["full", "window20"])
@KV_QUANT
def test_short_contexts_in_a_wide_table(device, dtype, randn, gen, poisoned_empty, num_splits,
                                        window, kv_quant):
    lens, bs = [1, 5, 33, 576], 16
    k, v, ks, vs, tables, _ = _paged(randn, gen, lens, 1, 16, bs, dtype, kv_quant, device, WIDE // bs)
    q = randn(len(lens), 2, 16, dtype=dtype)
    ctx = torch.tensor(lens, dtype=torch.int32, device=device)
    out = paged_attention_triton(q, k, v, tables, ctx, 0.25, window, ks, vs, num_splits=num_splits)
    assert_close(out, paged_attention_torch(q, k, v, tables, ctx, 0.25, window, ks, vs),
                 f"S={num_splits} window={window} kv={kv_quant}")


@pytest.mark.parametrize("window", [None, 20], ids=["full", "window20"])
def test_splits_follow_the_actual_length(device, randn, gen, poisoned_empty, monkeypatch, window):
    # the two-kernel path's scratch m [B, Hq, S]: finite where a split had keys
    lens, bs, nsplit = [576, 33, 1], 16, 16
    k, v, _, _, tables, _ = _paged(randn, gen, lens, 1, 16, bs, torch.float32, None, device,
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
    k, v, _, _, tables, _ = _paged(randn, gen, lens, hkv, d, bs, dtype, None, device, width)
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


@pytest.mark.parametrize("kv_quant", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_k_read_transposed_matches_reference(device, dtype, randn, gen, poisoned_empty,
                                             monkeypatch, kv_quant, num_splits):
    # INFERGRAFT_KV_LOAD_T=1: 8-bit K tiles read as [D, N] (read at each launch)
    monkeypatch.setenv("INFERGRAFT_KV_LOAD_T", "1")
    lens = [1, 37, 80]
    k, v, ks, vs, tables, seqs = _paged(randn, gen, lens, 2, 32, 16, dtype, kv_quant, device)
    q = randn(len(lens), 6, 32, dtype=dtype)
    ctx = torch.tensor(lens, dtype=torch.int32, device=device)
    out = paged_attention_triton(q, k, v, tables, ctx, 0.2, None, ks, vs, num_splits=num_splits)
    assert_close(out, paged_attention_torch(q, k, v, tables, ctx, 0.2, None, ks, vs),
                 f"K read transposed, S={num_splits}")
