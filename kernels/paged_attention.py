"""Paged decode attention: one query token per sequence against K/V stored in blocks.

Token ``p`` of sequence ``b`` lives at ``cache[block_tables[b, p // BS], p % BS]``.
GQA: query head ``h`` reads kv head ``h // (Hq // Hkv)`` (HF ``repeat_kv`` order).
Sliding window ``W``: the query at position ``p = len - 1`` sees keys in ``(p - W, p]``.
Softcap ``c`` (Gemma 2): each score ``s = q.k * scale`` becomes ``c * tanh(s / c)``.
int8 or e4m3 K/V carry float32 scales per (token, head): ``k = k_q * k_scale``.

Flash-decoding: the Triton path splits each sequence's visible keys over S programs per
(sequence, kv head) so small batches fill the GPU. S comes from shapes (CUDA graphs); the
split points from the actual lengths, in the kernel. The partial softmaxes are merged by
the last program of each (sequence, kv head) to finish (a semaphore), or a second kernel.
"""
from __future__ import annotations

import torch

from . import switches
from ._triton import (HAVE_TRITON, interpreting, last_to_arrive, next_pow2, pdl_enter,
                      pdl_launch, soft_cap, tl, triton)
from .attention_ref import sdpa
from .kv_write import QUANT_KV_DTYPES
from .kv8 import accumulate_values, as_words, join4, key_scores, q_operand, split4, widen_mode
from .paged_plan import (_sm_count, check_cache_args, counters_for, launch_plan,  # noqa: F401
                         split_len, split_plan)

#: float32 elements (heads x splits x head_dim) per step of the fused merge: 64 registers
#: a thread at 4 warps; a larger S x head_dim is merged by the second kernel instead
MERGE_ELEMS = 8192


def paged_attention_torch(q, k_cache, v_cache, block_tables, context_lens, scale: float,
                          window: int | None = None, k_scale=None, v_scale=None, *,
                          softcap: float | None = None, counters=None):
    # q: [B, Hq, D]; k_cache, v_cache: [NB, BS, Hkv, D]; block_tables: [B, MB] int;
    # context_lens: [B] int (>= 1); k_scale, v_scale: [NB, BS, Hkv] float32 for int8 / e4m3
    bsz, bs = q.shape[0], k_cache.shape[1]
    lens = context_lens.to(q.device, torch.long)
    longest = int(lens.max()) if bsz else 0
    pos = torch.arange(longest, device=q.device)                       # [L]
    live = pos[None, :] < lens[:, None]                                 # [B, L]
    # positions past a sequence's length read its token 0 (masked out below): never a
    # padding entry or a stale slot, whose contents may be anything (NaN included)
    blocks = torch.where(live, block_tables.long()[:, pos // bs], block_tables.long()[:, :1])
    offs = torch.where(live, pos % bs, 0)                              # [B, L]
    k, v = k_cache[blocks, offs], v_cache[blocks, offs]                # [B, L, Hkv, D]
    if k_cache.dtype in QUANT_KV_DTYPES:
        k = k.float() * k_scale[blocks, offs][..., None]
        v = v.float() * v_scale[blocks, offs][..., None]
    mask = live
    if window:
        mask = mask & (pos[None, :] > lens[:, None] - 1 - window)
    elif longest == int(lens.min()):
        mask = None  # every row full: the same call the contiguous cache makes
    if mask is not None:
        mask = mask[:, None, None, :]                                   # [B, 1, 1, L]
    out = sdpa(q.float().unsqueeze(2), k.float().transpose(1, 2), v.float().transpose(1, 2),
               attn_mask=mask, scale=scale, softcap=softcap)            # [B, Hq, 1, D]
    return out.squeeze(2).to(q.dtype)


if HAVE_TRITON:

    @triton.jit
    def _merge_splits(acc_ptr, m_ptr, l_ptr, row0, nh, out_ptr, stride_oh, NSPLIT, D,
                      BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
        """Normalised output of nh query heads from their NSPLIT partials (rows
        row0 + h * NSPLIT + s), BLOCK_H heads at a time. Loads are .cg (L2, never a stale
        L1 line): in the fused path other programs wrote the partials during this kernel."""
        hr = tl.arange(0, BLOCK_H)
        s = tl.arange(0, BLOCK_S)
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        for h0 in range(0, nh, BLOCK_H):
            h = h0 + hr
            hs = (h < nh)[:, None] & (s < NSPLIT)[None, :]                  # [H, S]
            row = row0 + h[:, None] * NSPLIT + s[None, :]                   # [H, S]
            m = tl.load(m_ptr + row, mask=hs, other=float("-inf"), cache_modifier=".cg")
            m = tl.where((h < nh)[:, None], m, 0.0)  # padding heads: 0 / 1, not NaN
            l = tl.load(l_ptr + row, mask=hs, other=1.0, cache_modifier=".cg")
            acc = tl.load(acc_ptr + row[:, :, None] * D + d[None, None, :],
                          mask=hs[:, :, None] & dmask[None, None, :], other=0.0,
                          cache_modifier=".cg")                              # [H, S, D]
            # empty splits (m = -inf) weigh 0; each head has >= 1 split that is not empty
            w = tl.exp(m - tl.max(m, 1)[:, None])                           # [H, S]
            out = tl.sum(acc * w[:, :, None], 1) / tl.sum(l * w, 1)[:, None]  # [H, D]
            tl.store(out_ptr + h[:, None] * stride_oh + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=(h < nh)[:, None] & dmask[None, :])

    @triton.jit
    def _paged_decode_kernel(
        q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, bt_ptr, lens_ptr, out_ptr, acc_ptr, m_ptr, l_ptr,
        sem_ptr,
        stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        stride_ksb, stride_kss, stride_ksh, stride_vsb, stride_vss, stride_vsh,
        stride_btb, stride_ob, stride_oh,
        scale, window, softcap, BS, GROUP, D,
        QUANT: tl.constexpr, IEEE: tl.constexpr, SPLIT: tl.constexpr, FUSED: tl.constexpr,
        BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr,
        K_T: tl.constexpr = False, SOFTCAP: tl.constexpr = False, WIDEN: tl.constexpr = 0,
        FP8: tl.constexpr = False, ASM: tl.constexpr = False):
        pdl_enter(PDL)
        # One program per (sequence, kv head, split) serves the GROUP query heads sharing
        # the kv head over its split's tokens. SPLIT=False: one split, normalised output;
        # SPLIT=True: un-normalised acc and (m, l) per query head, merged by the last
        # program of the (sequence, kv head) to finish (FUSED) or the combine kernel.
        # WIDEN: how 8-bit K/V reach the dots (kv8.py; the word modes read int32 words).
        b = tl.program_id(0).to(tl.int64)
        hkv = tl.program_id(1).to(tl.int64)
        sp, nsplit = tl.program_id(2), tl.num_programs(2)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        gmask, dmask = g < GROUP, d < D
        qh = hkv * GROUP + g
        q = tl.load(q_ptr + b * stride_qb + qh[:, None] * stride_qh + d[None, :],
                    mask=gmask[:, None] & dmask[None, :], other=0.0)   # [G, D]
        qk, qs = q_operand(q, scale, WIDEN)  # the score dot's q, its rows' factors [G]
        c0, c1, c2, c3 = split4(qk)  # the word modes' column groups (else unused)
        length = tl.load(lens_ptr + b).to(tl.int32)
        start = tl.where(window > 0, tl.maximum(length - window, 0), 0)
        # the visible keys [start, length) in S parts of P whole tiles (from the actual
        # length: a graph captured for a wide table still spreads a short context over
        # all S); split sp covers [start + sp * P, start + (sp + 1) * P), past length none
        per = ((length - start + nsplit - 1) // nsplit + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        lo = start + sp * per
        hi = tl.minimum(lo + per, length)
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l = tl.full([BLOCK_G], 0.0, tl.float32)  # tl.zeros fails in the 3.9 interpreter
        acc = tl.full([BLOCK_G, BLOCK_D], 0.0, tl.float32)
        a0 = tl.full([BLOCK_G, BLOCK_D // 4], 0.0, tl.float32)  # the word modes' p V
        a1, a2, a3 = a0, a0, a0
        for n0 in range(lo, hi, BLOCK_N):  # every tile holds >= 1 valid key: m stays finite
            pos = n0 + tl.arange(0, BLOCK_N)
            valid = pos < hi                                               # [N]
            blk = tl.load(bt_ptr + b * stride_btb + pos // BS, mask=valid, other=0).to(tl.int64)
            off = (pos % BS).to(tl.int64)
            s = key_scores(qk, c0, c1, c2, c3, kc_ptr,
                           blk * stride_kb + off * stride_ks + hkv * stride_kh, valid, d,
                           dmask, D, BLOCK_D, WIDEN, FP8, ASM, IEEE, K_T)  # [G, N] f32
            if QUANT:
                ksc = tl.load(ks_ptr + blk * stride_ksb + off * stride_kss + hkv * stride_ksh,
                              mask=valid, other=0.0)
                s = s * ksc[None, :]
            s = s * qs[:, None]
            if SOFTCAP:  # Gemma 2: c * tanh(s / c), before the mask
                s = soft_cap(s, softcap)
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])                                # [G, N]
            l = l * alpha + tl.sum(p, 1)
            # (16-bit: p on tensor cores; an fp32 IEEE dot runs on the FMA units and makes
            # the kernel compute-bound)
            acc, a0, a1, a2, a3 = accumulate_values(
                acc, a0, a1, a2, a3, alpha, p, vs_ptr,
                blk * stride_vsb + off * stride_vss + hkv * stride_vsh, vc_ptr,
                blk * stride_vb + off * stride_vs + hkv * stride_vh, valid, d, dmask, D,
                BLOCK_D, qk.dtype, QUANT, WIDEN, FP8, ASM, IEEE)
            m = m_new
        if WIDEN >= 2:
            acc = join4(a0, a1, a2, a3)
        gd_mask = gmask[:, None] & dmask[None, :]
        if SPLIT:  # scratch rows ((b * Hq + qh) * S + sp): an empty split stores m=-inf, l=0, acc=0
            hq = tl.num_programs(1) * GROUP
            row = (b * hq + qh) * nsplit + sp                                # [G]
            tl.store(acc_ptr + row[:, None] * D + d[None, :], acc, mask=gd_mask)
            tl.store(m_ptr + row, m, mask=gmask)
            tl.store(l_ptr + row, l, mask=gmask)
            if FUSED:
                cnt = sem_ptr + b * tl.num_programs(1) + hkv  # this (sequence, kv head)
                if last_to_arrive(cnt, nsplit):
                    # last to finish: the other S - 1 partials are visible (acquire)
                    h0 = hkv * GROUP
                    _merge_splits(acc_ptr, m_ptr, l_ptr, (b * hq + h0) * nsplit, GROUP,
                                  out_ptr + b * stride_ob + h0 * stride_oh, stride_oh,
                                  nsplit, D, BLOCK_H, BLOCK_S, BLOCK_D)
                    tl.store(cnt, 0)  # zero again for the next call or graph replay
        else:
            out = acc / l[:, None]
            tl.store(out_ptr + b * stride_ob + qh[:, None] * stride_oh + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=gd_mask)

    @triton.jit
    def _paged_combine_kernel(acc_ptr, m_ptr, l_ptr, out_ptr, stride_ob, stride_oh, NSPLIT, D,
                              BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
        pdl_enter(PDL)
        # One program per (sequence, query head): merge its splits' partial softmaxes.
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        _merge_splits(acc_ptr, m_ptr, l_ptr, (b * tl.num_programs(1) + h) * NSPLIT, 1,
                      out_ptr + b * stride_ob + h * stride_oh, stride_oh, NSPLIT, D,
                      1, BLOCK_S, BLOCK_D)


def paged_attention_triton(q, k_cache, v_cache, block_tables, context_lens, scale: float,
                           window: int | None = None, k_scale=None, v_scale=None, *,
                           softcap: float | None = None,
                           num_splits: int | None = None, block_n: int | None = None,
                           num_warps: int | None = None, num_stages: int | None = None,
                           fused_combine: bool = True, counters=None):
    """Same contract as ``paged_attention_torch``; returns a new [B, Hq, D] tensor.

    Flash-decoding: with S > 1 splits of the sequence (``num_splits``, automatic when
    None) each program writes a partial softmax to scratch; with ``fused_combine`` the
    last program of each (sequence, kv head) to finish merges them (counted on
    ``counters``, a ``paged_plan.CounterPool`` the caller owns, or the shared one), else a
    second kernel does (also when the counters would have to grow during a CUDA graph
    capture, or S x D exceeds ``MERGE_ELEMS``). S = 1 is one kernel.
    ``block_n`` (keys per tile), ``num_warps`` and ``num_stages`` are tuning knobs
    (defaults: ``paged_plan.launch_plan``)."""
    assert q.dim() == 3, f"q must be [B, Hq, D], got {tuple(q.shape)}"
    bsz, hq, d = q.shape
    quant = check_cache_args(q, k_cache, v_cache, k_scale, v_scale)
    nb, bs, hkv, _ = k_cache.shape
    assert block_tables.dim() == 2 and block_tables.shape[0] == bsz, \
        f"block_tables must be [{bsz}, max_blocks], got {tuple(block_tables.shape)}"
    assert block_tables.dtype in (torch.int32, torch.int64), f"block_tables dtype {block_tables.dtype}"
    assert context_lens.shape == (bsz,) and context_lens.dtype in (torch.int32, torch.int64), \
        f"context_lens must be int [{bsz}], got {tuple(context_lens.shape)} {context_lens.dtype}"
    assert window is None or (isinstance(window, int) and window >= 1), f"window {window!r}"
    assert softcap is None or softcap > 0, f"softcap {softcap!r}"
    assert num_splits is None or (isinstance(num_splits, int) and num_splits >= 1), \
        f"num_splits {num_splits!r}"
    assert block_n is None or (block_n >= 16 and block_n & (block_n - 1) == 0), \
        f"block_n {block_n} must be a power of 2 >= 16"
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        assert x.stride(-1) == 1, f"{name} must be contiguous in its last dim, strides {x.stride()}"
    others = [("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables),
              ("context_lens", context_lens)] + ([("k_scale", k_scale), ("v_scale", v_scale)] if quant else [])
    for name, x in others:
        assert x.device == q.device, f"{name} on {x.device} but q on {q.device}"
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if bsz == 0:
        return out
    block_tables, context_lens = block_tables.contiguous(), context_lens.contiguous()
    ks, vs = (k_scale, v_scale) if quant else (k_cache, v_cache)  # unused when not QUANT
    sks = ks.stride() if quant else (0, 0, 0)
    svs = vs.stride() if quant else (0, 0, 0)
    group, block_d = hq // hkv, max(16, next_pow2(d))
    widen = widen_mode(q, k_cache)  # kv8.py: how 8-bit K/V reach the dots
    nsplit, block_n, tune = launch_plan(
        bsz, hkv, block_tables.shape[1] * bs, window, _sm_count(q.device), group=group,
        wide_tiles=(not quant or widen > 0) and q.element_size() == 2 and d <= 128,
        kv_bytes=k_cache.element_size() if widen > 0 else 2, num_splits=num_splits,
        block_n=block_n, num_warps=num_warps, num_stages=num_stages)
    kc, vc = as_words(k_cache, widen), as_words(v_cache, widen)
    block_s, sems = next_pow2(nsplit), None
    if nsplit > 1:  # scratch: acc [B, Hq, S, D], m and l [B, Hq, S] (float32)
        acc = torch.empty((bsz, hq, nsplit, d), dtype=torch.float32, device=q.device)
        ml = torch.empty((2, bsz, hq, nsplit), dtype=torch.float32, device=q.device)
        m, l = ml[0], ml[1]
        # fused: counters [B, Hkv]; not for a merge too large for registers (it would
        # lower the occupancy of the whole decode kernel)
        if fused_combine and block_s * block_d <= MERGE_ELEMS:
            sems = counters_for(counters, q.device, bsz * hkv)
    else:
        acc = m = l = out  # unused when not SPLIT
    # the fused merge takes BLOCK_H of the GROUP heads at a time ([H, S, D] in registers)
    block_h = min(next_pow2(group), max(1, MERGE_ELEMS // (block_s * block_d)))
    _paged_decode_kernel[(bsz, hkv, nsplit)](
        q, kc, vc, ks, vs, block_tables, context_lens, out, acc, m, l,
        out if sems is None else sems,  # counters unused when not FUSED
        q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), kc.stride(2),
        vc.stride(0), vc.stride(1), vc.stride(2), *sks, *svs,
        block_tables.stride(0), out.stride(0), out.stride(1),
        float(scale), int(window or 0), float(softcap or 1.0), bs, group, d,
        QUANT=quant, IEEE=q.dtype == torch.float32, SPLIT=nsplit > 1, FUSED=sems is not None,
        BLOCK_G=max(16, next_pow2(group)), BLOCK_D=block_d, BLOCK_N=block_n,
        BLOCK_H=block_h, BLOCK_S=block_s, **tune, **pdl_launch(q.device),
        K_T=quant and switches.value("INFERGRAFT_KV_LOAD_T"), SOFTCAP=softcap is not None,
        WIDEN=widen, FP8=k_cache.dtype == torch.float8_e4m3fn, ASM=not interpreting())
    if nsplit > 1 and sems is None:
        _paged_combine_kernel[(bsz, hq)](
            acc, m, l, out, out.stride(0), out.stride(1), nsplit, d,
            BLOCK_S=block_s, BLOCK_D=block_d, num_warps=4, **pdl_launch(acc.device))
    return out
