"""Paged decode attention: one query token per sequence against K/V stored in blocks.

Token ``p`` of sequence ``b`` lives at ``cache[block_tables[b, p // BS], p % BS]``.
GQA: query head ``h`` reads kv head ``h // (Hq // Hkv)`` (HF ``repeat_kv`` order).
Sliding window ``W``: the query at position ``p = len - 1`` sees keys in ``(p - W, p]``.
int8 K/V carry float32 scales per (token, head): ``k = k_int8 * k_scale``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._triton import HAVE_TRITON, next_pow2, tl, triton


def paged_attention_torch(q, k_cache, v_cache, block_tables, context_lens, scale: float,
                          window: int | None = None, k_scale=None, v_scale=None):
    # q: [B, Hq, D]; k_cache, v_cache: [NB, BS, Hkv, D]; block_tables: [B, MB] int;
    # context_lens: [B] int (>= 1); k_scale, v_scale: [NB, BS, Hkv] float32 for int8
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
    if k_cache.dtype == torch.int8:
        k = k.float() * k_scale[blocks, offs][..., None]
        v = v.float() * v_scale[blocks, offs][..., None]
    mask = live
    if window:
        mask = mask & (pos[None, :] > lens[:, None] - 1 - window)
    elif longest == int(lens.min()):
        mask = None  # every row full: the same call the contiguous cache makes
    if mask is not None:
        mask = mask[:, None, None, :]                                   # [B, 1, 1, L]
    out = F.scaled_dot_product_attention(
        q.float().unsqueeze(2), k.float().transpose(1, 2), v.float().transpose(1, 2),
        attn_mask=mask, scale=scale, enable_gqa=True)                  # [B, Hq, 1, D]
    return out.squeeze(2).to(q.dtype)


if HAVE_TRITON:

    @triton.jit
    def _paged_decode_kernel(
        q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, bt_ptr, lens_ptr, out_ptr,
        stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        stride_ksb, stride_kss, stride_ksh, stride_vsb, stride_vss, stride_vsh,
        stride_btb, stride_ob, stride_oh,
        scale, window, BS, GROUP, D,
        QUANT: tl.constexpr, IEEE: tl.constexpr,
        BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        # One program per (sequence, kv head) serves the GROUP query heads sharing it.
        b = tl.program_id(0).to(tl.int64)
        hkv = tl.program_id(1).to(tl.int64)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        gmask, dmask = g < GROUP, d < D
        qh = hkv * GROUP + g
        q = tl.load(q_ptr + b * stride_qb + qh[:, None] * stride_qh + d[None, :],
                    mask=gmask[:, None] & dmask[None, :], other=0.0)   # [G, D]
        length = tl.load(lens_ptr + b).to(tl.int32)
        start = tl.where(window > 0, tl.maximum(length - window, 0), 0)
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l = tl.full([BLOCK_G], 0.0, tl.float32)  # tl.zeros fails in the 3.9 interpreter
        acc = tl.full([BLOCK_G, BLOCK_D], 0.0, tl.float32)
        for n0 in range((start // BLOCK_N) * BLOCK_N, length, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            valid = (pos >= start) & (pos < length)                      # [N]
            blk = tl.load(bt_ptr + b * stride_btb + pos // BS, mask=valid, other=0).to(tl.int64)
            off = (pos % BS).to(tl.int64)
            kv_mask = valid[:, None] & dmask[None, :]
            k = tl.load(kc_ptr + blk[:, None] * stride_kb + off[:, None] * stride_ks
                        + hkv * stride_kh + d[None, :], mask=kv_mask, other=0)   # [N, D]
            v = tl.load(vc_ptr + blk[:, None] * stride_vb + off[:, None] * stride_vs
                        + hkv * stride_vh + d[None, :], mask=kv_mask, other=0)   # [N, D]
            kf = tl.trans(k.to(q.dtype))                                  # [D, N]
            if IEEE:
                s = tl.dot(q, kf, input_precision="ieee")                 # [G, N] f32
            else:
                s = tl.dot(q, kf)
            if QUANT:
                ksc = tl.load(ks_ptr + blk * stride_ksb + off * stride_kss + hkv * stride_ksh,
                              mask=valid, other=0.0)
                s = s * ksc[None, :]
            s = tl.where(valid[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])                                # [G, N]
            l = l * alpha + tl.sum(p, 1)
            if QUANT:
                vsc = tl.load(vs_ptr + blk * stride_vsb + off * stride_vss + hkv * stride_vsh,
                              mask=valid, other=0.0)
                p = p * vsc[None, :]
            if IEEE:  # float32 K/V: exact float32 product
                pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")  # [G, D]
            else:  # 16-bit: p rounded to q's dtype, on tensor cores (an fp32 IEEE dot runs
                # on the FMA units and made the kernel compute-bound: 1.6 TB/s at batch 32)
                pv = tl.dot(p.to(q.dtype), v.to(q.dtype))                  # [G, D]
            acc = acc * alpha[:, None] + pv
            m = m_new
        out = acc / l[:, None]
        tl.store(out_ptr + b * stride_ob + qh[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=gmask[:, None] & dmask[None, :])


def paged_attention_triton(q, k_cache, v_cache, block_tables, context_lens, scale: float,
                           window: int | None = None, k_scale=None, v_scale=None):
    """Same contract as ``paged_attention_torch``; returns a new [B, Hq, D] tensor."""
    assert q.dim() == 3, f"q must be [B, Hq, D], got {tuple(q.shape)}"
    bsz, hq, d = q.shape
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, \
        f"k_cache and v_cache must both be [NB, BS, Hkv, D], got {tuple(k_cache.shape)} " \
        f"and {tuple(v_cache.shape)}"
    nb, bs, hkv, dk = k_cache.shape
    assert dk == d, f"q head_dim {d} != cache head_dim {dk}"
    assert hkv >= 1 and hq % hkv == 0, f"Hq={hq} is not a multiple of Hkv={hkv}"
    assert q.dtype in (torch.float32, torch.float16, torch.bfloat16), f"q dtype {q.dtype}"
    quant = k_cache.dtype == torch.int8
    if quant:
        assert v_cache.dtype == torch.int8, f"k_cache is int8 but v_cache is {v_cache.dtype}"
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            assert s is not None and s.shape == (nb, bs, hkv) and s.dtype == torch.float32, \
                f"int8 K/V need {name} float32 [{nb}, {bs}, {hkv}], got " \
                f"{None if s is None else (tuple(s.shape), s.dtype)}"
    else:
        assert k_cache.dtype == v_cache.dtype == q.dtype, \
            f"cache dtype {k_cache.dtype}/{v_cache.dtype} must equal q dtype {q.dtype} (or int8)"
        assert k_scale is None and v_scale is None, "scales are only for int8 K/V"
    assert block_tables.dim() == 2 and block_tables.shape[0] == bsz, \
        f"block_tables must be [{bsz}, max_blocks], got {tuple(block_tables.shape)}"
    assert block_tables.dtype in (torch.int32, torch.int64), f"block_tables dtype {block_tables.dtype}"
    assert context_lens.shape == (bsz,) and context_lens.dtype in (torch.int32, torch.int64), \
        f"context_lens must be int [{bsz}], got {tuple(context_lens.shape)} {context_lens.dtype}"
    assert window is None or (isinstance(window, int) and window >= 1), f"window {window!r}"
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
    _paged_decode_kernel[(bsz, hkv)](
        q, k_cache, v_cache, ks, vs, block_tables, context_lens, out,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), *sks, *svs,
        block_tables.stride(0), out.stride(0), out.stride(1),
        float(scale), int(window or 0), bs, hq // hkv, d,
        QUANT=quant, IEEE=q.dtype == torch.float32,
        BLOCK_G=max(16, next_pow2(hq // hkv)), BLOCK_D=max(16, next_pow2(d)), BLOCK_N=64,
        num_warps=4,
    )
    return out
