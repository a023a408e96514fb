"""Varlen paged attention: a whole mixed step (prompt chunks and decode tokens) in one launch.

Sequence ``b`` owns query rows ``cu_seqlens_q[b] : cu_seqlens_q[b + 1]`` of q (q_len_b of
them, 0 for a padding sequence); rows from ``cu_seqlens_q[B]`` to T are padding (CUDA-graph
buckets) and come out zero. ``context_lens[b]`` counts its tokens after this step, whose
K/V are already in the cache, so its row i sits at position ``context_lens[b] - q_len_b + i``
and sees keys at positions ``<= `` its own (and ``> pos - W`` with a sliding window ``W``);
with a softcap ``c`` (Gemma 2) each score ``s = q.k * scale`` becomes ``c * tanh(s / c)``.
Cache layout, GQA and int8 / e4m3 K/V as ``paged_attention``: token ``p`` at
``cache[block_tables[b, p // BS], p % BS]``, query head ``h`` reads kv head
``h // (Hq // Hkv)``, ``k = k_q * k_scale``.

The Triton path (as vLLM's unified Triton attention): a program per (query tile, kv head,
split) takes BLOCK_Q tokens of one sequence x the GROUP query heads of its kv head, so a
tl.dot tile has BLOCK_M = BLOCK_Q x GROUP rows. Sequence b's tiles start at
``cu[b] // BLOCK_Q + b``, so ``cdiv(T, BLOCK_Q) + B`` programs cover any step of T rows:
the grid comes from shapes only, and each program finds its sequence by binary search
over ``cu_seqlens_q``. Beside prompts and chunks in 64-row tiles, B more programs take the
sequences of a few tokens (decode) in 16-row ones, all in the one launch
(``varlen_plan.varlen_plan``).
"""
from __future__ import annotations

import torch

from ._triton import HAVE_TRITON, interpreting, next_pow2, pdl_enter, pdl_launch, tl, triton
from .kv8 import as_words, widen_mode
from .paged_attention import MERGE_ELEMS, _merge_splits
from .attention_ref import sdpa
from .paged_plan import _sm_count, counters_for
from .varlen_plan import check_args, tile_counts, varlen_plan
from .varlen_tile import _attend_tile, _find_seq


def varlen_attention_torch(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
                           scale: float, window: int | None = None, k_scale=None, v_scale=None,
                           *, softcap: float | None = None, counters=None):
    # q: [T, Hq, D]; k_cache, v_cache: [NB, BS, Hkv, D]; block_tables: [B, MB] int;
    # cu_seqlens_q: [B + 1] int32; context_lens: [B] int; k_scale, v_scale: [NB, BS, Hkv]
    quant = check_args(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, window,
                       k_scale, v_scale)
    bs = k_cache.shape[1]
    cu, lens = cu_seqlens_q.tolist(), context_lens.tolist()
    assert cu[0] == 0 and all(a <= b for a, b in zip(cu, cu[1:])) and cu[-1] <= q.shape[0], \
        f"cu_seqlens_q must rise from 0 to at most T={q.shape[0]}, got {cu}"
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    for b, n in enumerate(lens):
        q0, qlen = cu[b], cu[b + 1] - cu[b]
        if qlen == 0:
            continue
        assert n >= qlen, f"sequence {b}: context_lens {n} < its {qlen} query rows"
        prefix = n - qlen
        # keys from the first one its first query sees; whole blocks gathered, then cut
        start = max(0, prefix - window + 1) if window else 0
        blocks = block_tables[b, start // bs:-(-n // bs)].long()
        cut = slice(start % bs, start % bs + n - start)
        k = k_cache[blocks].flatten(0, 1)[cut]                          # [L, Hkv, D]
        v = v_cache[blocks].flatten(0, 1)[cut]
        if quant:
            k = k.float() * k_scale[blocks].flatten(0, 1)[cut][..., None]
            v = v.float() * v_scale[blocks].flatten(0, 1)[cut][..., None]
        mask, causal = None, False
        if qlen > 1 and prefix == 0 and (not window or window >= n):
            causal = True  # a fresh prompt: the square causal mask
        elif qlen > 1:
            qpos = torch.arange(prefix, n, device=q.device)[:, None]    # [Q, 1]
            kpos = torch.arange(start, n, device=q.device)[None, :]     # [1, L]
            mask = kpos <= qpos
            if window:
                mask = mask & (kpos > qpos - window)                   # [Q, L]
        o = sdpa(q[q0:q0 + qlen].float().transpose(0, 1), k.float().transpose(0, 1),
                 v.float().transpose(0, 1), attn_mask=mask, is_causal=causal, scale=scale,
                 softcap=softcap)                                      # [Hq, Q, D]
        out[q0:q0 + qlen] = o.transpose(0, 1).to(q.dtype)
    return out


if HAVE_TRITON:

    @triton.jit
    def _varlen_kernel(
        q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, bt_ptr, cu_ptr, lens_ptr, out_ptr,
        acc_ptr, m_ptr, l_ptr, sem_ptr,
        stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        stride_ksb, stride_kss, stride_ksh, stride_vsb, stride_vss, stride_vsh,
        stride_btb, stride_ot, stride_oh,
        scale, window, softcap, num_tokens, nseq, n_long, short_max, BS, D,
        GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        SHORT_Q: tl.constexpr, SHORT_M: tl.constexpr, SHORT_N: tl.constexpr,
        QUANT: tl.constexpr, IEEE: tl.constexpr, SPLIT: tl.constexpr, FUSED: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr,
        SOFTCAP: tl.constexpr = False, WIDEN: tl.constexpr = 0, FP8: tl.constexpr = False,
        ASM: tl.constexpr = False):
        pdl_enter(PDL)
        # The first n_long programs take BLOCK_M-row tiles, the longest first (a sequence's
        # last tiles see the most keys); with SHORT_M > 0, B more take one sequence of 1
        # to SHORT_Q = short_max tokens each (decode tokens) in SHORT_M-row tiles, and the
        # BLOCK_M tiles only the longer ones.
        tile = tl.program_id(0)
        hkv = tl.program_id(1).to(tl.int64)
        kc, vc = kc_ptr + hkv * stride_kh, vc_ptr + hkv * stride_vh
        ks, vs = ks_ptr + hkv * stride_ksh, vs_ptr + hkv * stride_vsh
        if SHORT_M > 0:
            if tile >= n_long:
                b = tile - n_long
                q0 = tl.load(cu_ptr + b)
                qlen = tl.load(cu_ptr + b + 1) - q0
                if (qlen > 0) & (qlen <= SHORT_Q):
                    _attend_tile(
                        q_ptr, kc, vc, ks, vs, bt_ptr + b.to(tl.int64) * stride_btb, out_ptr,
                        acc_ptr, m_ptr, l_ptr, sem_ptr, stride_qt, stride_qh, stride_kb,
                        stride_ks, stride_vb, stride_vs, stride_ksb, stride_kss, stride_vsb,
                        stride_vss, stride_ot, stride_oh, scale, window, softcap, BS, D, hkv,
                        tile, q0, qlen, 0, tl.load(lens_ptr + b).to(tl.int32), GROUP, SHORT_Q,
                        SHORT_M, SHORT_N, BLOCK_D, BLOCK_H, BLOCK_S, QUANT, IEEE, SPLIT, FUSED,
                        SOFTCAP, WIDEN, FP8, ASM)
                return
        # the BLOCK_M tiles: sequence b's start at cu[b] // BLOCK_Q + b; the padding rows
        # after cu[B] take the tiles past the last sequence's
        t = n_long - 1 - tile
        b = _find_seq(cu_ptr, t, nseq, BLOCK_Q)
        q0 = tl.load(cu_ptr + b)
        j = t - (q0 // BLOCK_Q + b)  # this program's tile of sequence b
        if b == nseq:
            if tl.program_id(2) == 0:  # zeros, once
                r = tl.arange(0, BLOCK_M)
                d = tl.arange(0, BLOCK_D)
                pad = q0 + j * BLOCK_Q + r // GROUP
                pmask = (r // GROUP < BLOCK_Q) & (pad < num_tokens)
                tl.store(out_ptr + pad.to(tl.int64)[:, None] * stride_ot
                         + (hkv * GROUP + r % GROUP)[:, None] * stride_oh + d[None, :],
                         tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32).to(out_ptr.dtype.element_ty),
                         mask=pmask[:, None] & (d < D)[None, :])
            return
        qlen = tl.load(cu_ptr + b + 1) - q0
        # a spare tile of this sequence, or a sequence the short tiles took
        if (j * BLOCK_Q >= qlen) | (qlen <= short_max):
            return
        _attend_tile(
            q_ptr, kc, vc, ks, vs, bt_ptr + b.to(tl.int64) * stride_btb, out_ptr, acc_ptr,
            m_ptr, l_ptr, sem_ptr, stride_qt, stride_qh, stride_kb, stride_ks, stride_vb,
            stride_vs, stride_ksb, stride_kss, stride_vsb, stride_vss, stride_ot, stride_oh,
            scale, window, softcap, BS, D, hkv, tile, q0, qlen, j,
            tl.load(lens_ptr + b).to(tl.int32), GROUP, BLOCK_Q, BLOCK_M, BLOCK_N, BLOCK_D,
            BLOCK_H, BLOCK_S, QUANT, IEEE, SPLIT, FUSED, SOFTCAP, WIDEN, FP8, ASM)

    @triton.jit
    def _varlen_combine_kernel(acc_ptr, m_ptr, l_ptr, cu_ptr, out_ptr, stride_ot, stride_oh,
                               nseq, NSPLIT, D, GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
                               BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
        pdl_enter(PDL)
        # One program per (query row, kv head): merge its GROUP heads' splits. Padding
        # rows (after cu[B]) the main kernel has zeroed.
        t = tl.program_id(0).to(tl.int64)
        h0 = tl.program_id(1).to(tl.int64) * GROUP
        if t < tl.load(cu_ptr + nseq):
            hq = tl.num_programs(1) * GROUP
            _merge_splits(acc_ptr, m_ptr, l_ptr, (t * hq + h0) * NSPLIT, GROUP,
                          out_ptr + t * stride_ot + h0 * stride_oh, stride_oh, NSPLIT, D,
                          BLOCK_H, BLOCK_S, BLOCK_D)


def varlen_attention_triton(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
                            scale: float, window: int | None = None, k_scale=None, v_scale=None,
                            *, softcap: float | None = None,
                            num_splits: int | None = None, block_m: int | None = None,
                            block_n: int | None = None, num_warps: int | None = None,
                            num_stages: int | None = None, fused_combine: bool = True,
                            counters=None):
    """Same contract as ``varlen_attention_torch``; returns a new [T, Hq, D] tensor.

    One launch for the step (two with a second-kernel merge); the grid and every tile
    from shapes only (``varlen_plan``), so a CUDA graph replays it with other lengths.
    With S > 1 splits of each tile's keys (``num_splits``, automatic when None) the
    partial softmaxes are merged by the last split of each (tile, kv head) to finish
    (counted on ``counters``, a ``paged_plan.CounterPool``, or the shared one), or with
    ``fused_combine=False`` (also when the counters would have to grow during a capture,
    or S x D exceeds ``MERGE_ELEMS``) by a second kernel. ``block_m`` (rows of the dot
    tile: tokens x query heads per kv head), ``block_n`` (keys per tile), ``num_warps``
    and ``num_stages`` are tuning knobs."""
    quant = check_args(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, window,
                       k_scale, v_scale)
    assert softcap is None or softcap > 0, f"softcap {softcap!r}"
    ntok, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    bsz, group = block_tables.shape[0], hq // hkv
    widen = widen_mode(q, k_cache)  # kv8.py: how 8-bit K/V reach the dots
    plan = varlen_plan(ntok, bsz, hkv, group, block_tables.shape[1] * bs, window,
                       _sm_count(q.device), head_dim=d, elem_bytes=q.element_size(),
                       quant=quant, widen=widen > 0, num_splits=num_splits, block_m=block_m, block_n=block_n,
                       num_warps=num_warps, num_stages=num_stages)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if ntok == 0:
        return out
    if bsz == 0:  # no sequence: every row is padding
        return out.zero_()
    block_tables, context_lens = block_tables.contiguous(), context_lens.contiguous()
    cu_seqlens_q = cu_seqlens_q.contiguous()
    ks, vs = (k_scale, v_scale) if quant else (k_cache, v_cache)  # unused when not QUANT
    sks = ks.stride() if quant else (0, 0, 0)
    svs = vs.stride() if quant else (0, 0, 0)
    nsplit, block_d = plan["nsplit"], max(16, next_pow2(d))
    short = plan["short_m"] > 0
    tiles, _ = tile_counts(ntok, bsz, plan["block_q"], short)
    block_s, sems = next_pow2(nsplit), None
    if nsplit > 1:  # scratch: acc [T, Hq, S, D], m and l [T, Hq, S] (float32)
        acc = torch.empty((ntok, hq, nsplit, d), dtype=torch.float32, device=q.device)
        ml = torch.empty((2, ntok, hq, nsplit), dtype=torch.float32, device=q.device)
        m, l = ml[0], ml[1]
        if fused_combine and block_s * block_d <= MERGE_ELEMS:  # counters [tiles, Hkv]
            sems = counters_for(counters, q.device, tiles * hkv)
    else:
        acc = m = l = out  # unused when not SPLIT
    # a merge takes BLOCK_H of the GROUP heads at a time ([H, S, D] in registers)
    block_h = min(next_pow2(group), max(1, MERGE_ELEMS // (block_s * block_d)))
    kc, vc = as_words(k_cache, widen), as_words(v_cache, widen)
    _varlen_kernel[(tiles, hkv, nsplit)](
        q, kc, vc, ks, vs, block_tables, cu_seqlens_q, context_lens, out, acc, m, l,
        out if sems is None else sems,  # counters unused when not FUSED
        q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), kc.stride(2),
        vc.stride(0), vc.stride(1), vc.stride(2), *sks, *svs,
        block_tables.stride(0), out.stride(0), out.stride(1),
        float(scale), int(window or 0), float(softcap or 1.0), ntok, bsz,
        tiles - (bsz if short else 0),
        plan["short_q"], bs, d,
        GROUP=group, BLOCK_Q=plan["block_q"], BLOCK_M=plan["block_m"], BLOCK_N=plan["block_n"],
        SHORT_Q=plan["short_q"], SHORT_M=plan["short_m"], SHORT_N=plan["short_n"],
        QUANT=quant, IEEE=q.dtype == torch.float32, SPLIT=nsplit > 1, FUSED=sems is not None,
        BLOCK_D=block_d, BLOCK_H=block_h, BLOCK_S=block_s, **plan["tune"],
        **pdl_launch(q.device), SOFTCAP=softcap is not None, WIDEN=widen,
        FP8=k_cache.dtype == torch.float8_e4m3fn, ASM=not interpreting())
    if nsplit > 1 and sems is None:
        _varlen_combine_kernel[(ntok, hkv)](
            acc, m, l, cu_seqlens_q, out, out.stride(0), out.stride(1), bsz, nsplit, d,
            GROUP=group, BLOCK_H=block_h, BLOCK_S=block_s, BLOCK_D=block_d, num_warps=4,
            **pdl_launch(q.device))
    return out
