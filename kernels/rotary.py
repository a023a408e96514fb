"""Rotary position embedding (rotate-half layout, as HF LLaMA/Mistral/Qwen2).

``rotary_kv_write`` fuses the decode step's RoPE with the K/V cache write: rotated q is
returned, rotated k and v go straight to their cache slots (one kernel instead of two).
"""
import torch

from ._triton import HAVE_TRITON, next_pow2, pdl_enter, pdl_launch, tl, triton
from .kv_write import _check_kv_write, kv_write_torch


def rotary_torch(q, k, cos, sin, positions):
    """q: [T, Hq, D], k: [T, Hkv, D]; cos/sin: [P, R/2] float32; positions: [T].

    Rotates the first R dims of every head (R = 2 * cos.shape[1] <= D); returns new
    (q, k) in the input dtype.
    """
    half = cos.shape[1]
    c = cos[positions].unsqueeze(1)  # [T, 1, R/2]
    s = sin[positions].unsqueeze(1)

    def rot(x):
        xf = x.float()
        x1, x2, rest = xf[..., :half], xf[..., half:2 * half], xf[..., 2 * half:]
        out = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], dim=-1)
        return out.to(x.dtype)

    return rot(q), rot(k)


if HAVE_TRITON:

    @triton.jit
    def rotated_heads(x_ptr, tok, stride_t, stride_h, H, D, c, s, partner, sign, rot, cols,
                      BLOCK_H: tl.constexpr):
        # x: [H, D] of one token; c, s, partner, sign, rot: [BLOCK_D], shared by all heads
        # -> (rotated x in float32, its mask), both [BLOCK_H, BLOCK_D]
        heads = tl.arange(0, BLOCK_H)
        mask = (heads[:, None] < H) & (cols[None, :] < D)                  # [BLOCK_H, BLOCK_D]
        row = x_ptr + tok * stride_t + heads[:, None] * stride_h
        x = tl.load(row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        # the rotate-half partner of each dim (itself beyond R); an L1 hit, not new traffic
        xp = tl.load(row + partner[None, :], mask=mask, other=0.0).to(tl.float32)
        out = x * c[None, :] + sign[None, :] * xp * s[None, :]
        return tl.where(rot[None, :], out, x), mask  # exact pass-through, even for inf/nan

    @triton.jit
    def _rotate_heads(x_ptr, o_ptr, tok, stride_t, stride_h, H, D,
                      c, s, partner, sign, rot, cols, BLOCK_H: tl.constexpr,
                      o_base=-1, stride_oh=0):
        # rotated_heads, stored to o: [T, H, D] contiguous, or one cache slot (o_base)
        heads = tl.arange(0, BLOCK_H)
        out, mask = rotated_heads(x_ptr, tok, stride_t, stride_h, H, D, c, s, partner, sign,
                                  rot, cols, BLOCK_H)
        if o_base < 0:  # a contiguous [T, H, D] output
            optr = o_ptr + (tok * H + heads[:, None]) * D + cols[None, :]
        else:  # one cache slot: heads at stride_oh
            optr = o_ptr + o_base + heads[:, None] * stride_oh + cols[None, :]
        tl.store(optr, out.to(o_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _cos_sin(cos_ptr, sin_ptr, pos, stride_cs, HALF, BLOCK_D: tl.constexpr):
        """Per-dim cos, sin, rotate-half partner, sign and rotated-or-not of one position."""
        cols = tl.arange(0, BLOCK_D)                                     # [BLOCK_D]
        rot = cols < 2 * HALF
        lo = cols < HALF
        j = tl.where(lo, cols, cols - HALF)                               # index into cos/sin
        c = tl.load(cos_ptr + pos * stride_cs + j, mask=rot, other=1.0)
        s = tl.load(sin_ptr + pos * stride_cs + j, mask=rot, other=0.0)
        partner = tl.where(lo, cols + HALF, tl.where(rot, cols - HALF, cols))
        sign = tl.where(lo, -1.0, 1.0)
        return cols, c, s, partner, sign, rot

    @triton.jit
    def _token_and_q(q_ptr, qo_ptr, cos_ptr, sin_ptr, pos_ptr, stride_qt, stride_qh, stride_cs,
                     HQ, D, HALF, BLOCK_HQ: tl.constexpr, BLOCK_D: tl.constexpr):
        """This program's token and its cos/sin terms, with q already rotated into qo."""
        tok = tl.program_id(0).to(tl.int64)
        pos = tl.load(pos_ptr + tok).to(tl.int64)
        cols, c, s, partner, sign, rot = _cos_sin(cos_ptr, sin_ptr, pos, stride_cs, HALF, BLOCK_D)
        _rotate_heads(q_ptr, qo_ptr, tok, stride_qt, stride_qh, HQ, D,
                      c, s, partner, sign, rot, cols, BLOCK_HQ)
        return tok, cols, c, s, partner, sign, rot

    @triton.jit
    def _rotary_kv_write_kernel(
        q_ptr, k_ptr, v_ptr, qo_ptr, kc_ptr, vc_ptr, cos_ptr, sin_ptr, pos_ptr, idx0_ptr, idx1_ptr,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs,
        stride_k0, stride_k1, stride_kch, stride_v0, stride_v1, stride_vch,
        HQ, HKV, D, HALF,
        BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
        pdl_enter(PDL)
        # One program per token: rotate q (to qo), rotate k into its cache slot, copy v.
        tok, cols, c, s, partner, sign, rot = _token_and_q(
            q_ptr, qo_ptr, cos_ptr, sin_ptr, pos_ptr, stride_qt, stride_qh, stride_cs, HQ, D,
            HALF, BLOCK_HQ, BLOCK_D)
        i0 = tl.load(idx0_ptr + tok).to(tl.int64)
        i1 = tl.load(idx1_ptr + tok).to(tl.int64)
        if i0 >= 0:  # negative: a padding row, written nowhere
            _rotate_heads(k_ptr, kc_ptr, tok, stride_kt, stride_kh, HKV, D, c, s, partner, sign,
                          rot, cols, BLOCK_HKV, i0 * stride_k0 + i1 * stride_k1, stride_kch)
            heads = tl.arange(0, BLOCK_HKV)[:, None]
            mask = (heads < HKV) & (cols[None, :] < D)
            x = tl.load(v_ptr + tok * stride_vt + heads * stride_vh + cols[None, :], mask=mask)
            tl.store(vc_ptr + i0 * stride_v0 + i1 * stride_v1 + heads * stride_vch + cols[None, :],
                     x.to(vc_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def rope_pair_store(a, b, rm, rmask, head, j0, HALF, q_ptr, stride_qm, pos_ptr, cos_ptr,
                        sin_ptr, stride_cs, idx0_ptr, idx1_ptr, kc_ptr, vc_ptr, stride_c0,
                        stride_c1, stride_ch, HQ, HKV, BLOCK_N: tl.constexpr):
        """Epilogue of the fused decode qkv GEMM (kernels/linear.py, ROPE): a, b [BM, BN]
        float32 are dims j0.. of head ``head`` (q heads, then k, then v) and their
        rotate-half partners (+ HALF) for rows rm; q and k are rotated at each row's
        position; q goes to q_ptr [M, HQ, 2 * HALF], k and v to cache[idx0, idx1] (rows
        with idx0 < 0: nowhere), as rotary_kv_write stores them."""
        j = j0 + tl.arange(0, BLOCK_N)
        if head < HQ + HKV:
            pos = tl.load(pos_ptr + rm, mask=rmask, other=0).to(tl.int64)
            cs = pos[:, None] * stride_cs + j[None, :]                     # [BM, BN]
            c = tl.load(cos_ptr + cs, mask=rmask[:, None], other=1.0)
            s = tl.load(sin_ptr + cs, mask=rmask[:, None], other=0.0)
            a_rot = a * c - b * s
            b = b * c + a * s
            a = a_rot
        if head < HQ:
            dst = q_ptr + rm[:, None] * stride_qm + head * 2 * HALF + j[None, :]
            tl.store(dst, a.to(q_ptr.dtype.element_ty), mask=rmask[:, None])
            tl.store(dst + HALF, b.to(q_ptr.dtype.element_ty), mask=rmask[:, None])
        else:
            i0 = tl.load(idx0_ptr + rm, mask=rmask, other=-1).to(tl.int64)
            i1 = tl.load(idx1_ptr + rm, mask=rmask, other=0).to(tl.int64)
            mask = (rmask & (i0 >= 0))[:, None]
            kv = head - HQ
            off = i0[:, None] * stride_c0 + i1[:, None] * stride_c1 \
                + (kv % HKV).to(tl.int64) * stride_ch + j[None, :]          # [BM, BN]
            if kv < HKV:
                tl.store(kc_ptr + off, a.to(kc_ptr.dtype.element_ty), mask=mask)
                tl.store(kc_ptr + off + HALF, b.to(kc_ptr.dtype.element_ty), mask=mask)
            else:
                tl.store(vc_ptr + off, a.to(vc_ptr.dtype.element_ty), mask=mask)
                tl.store(vc_ptr + off + HALF, b.to(vc_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rotary_kernel(
        q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr, pos_ptr,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
        HQ, HKV, D, HALF,
        BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
        pdl_enter(PDL)
        # One program per token: cos/sin are read once and applied to all q and k heads.
        tok, cols, c, s, partner, sign, rot = _token_and_q(
            q_ptr, qo_ptr, cos_ptr, sin_ptr, pos_ptr, stride_qt, stride_qh, stride_cs, HQ, D,
            HALF, BLOCK_HQ, BLOCK_D)
        _rotate_heads(k_ptr, ko_ptr, tok, stride_kt, stride_kh, HKV, D,
                      c, s, partner, sign, rot, cols, BLOCK_HKV)

else:
    rope_pair_store = None


def _check_heads(name, x, t, d, device):
    assert x.dim() == 3, f"{name} must be [T, H, D], got shape {tuple(x.shape)}"
    assert x.shape[0] == t and x.shape[2] == d, \
        f"{name} shape {tuple(x.shape)} does not match [T={t}, H, D={d}]"
    assert x.device == device, f"{name} on {x.device}, expected {device}"
    assert x.is_floating_point(), f"{name} must be floating point, got {x.dtype}"
    assert d <= 1 or x.stride(2) == 1, f"{name} must be contiguous in its last dim, strides {x.stride()}"


def _check_rotary(q, k, cos, sin, positions):
    """Shape/dtype/device checks shared by both launchers; returns (T, Hq, D, R/2)."""
    assert q.dim() == 3, f"q must be [T, Hq, D], got shape {tuple(q.shape)}"
    t, hq, d = q.shape
    _check_heads("q", q, t, d, q.device)
    _check_heads("k", k, t, d, q.device)
    assert cos.dim() == 2 and cos.shape == sin.shape, \
        f"cos/sin must both be [P, R/2], got {tuple(cos.shape)} and {tuple(sin.shape)}"
    assert cos.dtype == sin.dtype == torch.float32, f"cos/sin must be float32, got {cos.dtype}/{sin.dtype}"
    assert cos.stride(1) == 1 and sin.stride() == cos.stride(), \
        f"cos/sin must share strides with a contiguous last dim, got {cos.stride()} / {sin.stride()}"
    half = cos.shape[1]
    assert 2 * half <= d, f"rotary dims R={2 * half} exceed head dim D={d}"
    assert positions.shape == (t,), f"positions must be [{t}], got {tuple(positions.shape)}"
    assert not positions.is_floating_point(), f"positions must be integer, got {positions.dtype}"
    for name, x in (("cos", cos), ("sin", sin), ("positions", positions)):
        assert x.device == q.device, f"{name} on {x.device}, expected {q.device}"
    return t, hq, d, half


def qkv_rope_epilogue(q, num_heads, cos, sin, positions, k_cache, v_cache, idx0, idx1):
    """For a qkv GEMM whose epilogue rotates q and k and stores k and v (the fused layer's
    and int4's): the checks of the rotary and K/V-write kernels it replaces, on q [T, Hq x
    D] (a cache slot, broadcast to [T, Hkv, D], stands in for the k and v it never
    stores), and the epilogue's arguments."""
    m, hkv, d = q.shape[0], k_cache.shape[2], k_cache.shape[3]
    kv_like = k_cache[0, 0].expand(m, hkv, d)  # a view, never written
    _check_rotary(q.view(m, num_heads, d), kv_like, cos, sin, positions)
    _check_kv_write(kv_like, kv_like, k_cache, v_cache, idx0, idx1)
    return (positions.contiguous(), cos, sin, idx0.contiguous(), idx1.contiguous(), k_cache,
            v_cache, num_heads, hkv)


def _warps(block_d, *blocks_h):
    tile = block_d * max(blocks_h)
    return 4 if tile <= 2048 else 8 if tile <= 8192 else 16


def rotary_triton(q, k, cos, sin, positions):
    """Same contract as ``rotary_torch``; q/k may be strided views (e.g. of a fused qkv)."""
    # q: [T, Hq, D], k: [T, Hkv, D]; cos, sin: [P, R/2] float32; positions: [T] int
    t, hq, d, half = _check_rotary(q, k, cos, sin, positions)
    hkv = k.shape[1]
    q_out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    k_out = torch.empty((t, hkv, d), dtype=k.dtype, device=k.device)
    if t == 0 or d == 0:
        return q_out, k_out
    positions = positions.contiguous()
    block_d, block_hq, block_hkv = next_pow2(d), next_pow2(hq), next_pow2(hkv)
    _rotary_kernel[(t,)](
        q, k, q_out, k_out, cos, sin, positions,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        cos.stride(0),
        hq, hkv, d, half,
        BLOCK_HQ=block_hq, BLOCK_HKV=block_hkv, BLOCK_D=block_d,
        num_warps=_warps(block_d, block_hq, block_hkv), **pdl_launch(q.device))
    return q_out, k_out


def rotary_kv_write_torch(q, k, v, cos, sin, positions, k_cache, v_cache, idx0, idx1):
    """RoPE on q and k, then k and v written to ``cache[idx0[t], idx1[t]]`` (rows with
    idx0 < 0 skipped, as ``kv_write``); returns the rotated q [T, Hq, D]."""
    q_rot, k_rot = rotary_torch(q, k, cos, sin, positions)
    kv_write_torch(k_rot, v, k_cache, v_cache, idx0, idx1)
    return q_rot


def rotary_kv_write_triton(q, k, v, cos, sin, positions, k_cache, v_cache, idx0, idx1):
    """Same contract as ``rotary_kv_write_torch``, in one kernel."""
    t, hq, d, half = _check_rotary(q, k, cos, sin, positions)
    _check_kv_write(k, v, k_cache, v_cache, idx0, idx1)
    assert k_cache.dtype != torch.int8, "int8 caches quantise on write: use rotary + kv_write_quant"
    hkv = k.shape[1]
    q_out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    if t == 0 or d == 0:
        return q_out
    positions, idx0, idx1 = positions.contiguous(), idx0.contiguous(), idx1.contiguous()
    block_d, block_hq, block_hkv = next_pow2(d), next_pow2(hq), next_pow2(hkv)
    _rotary_kv_write_kernel[(t,)](
        q, k, v, q_out, k_cache, v_cache, cos, sin, positions, idx0, idx1,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        hq, hkv, d, half,
        BLOCK_HQ=block_hq, BLOCK_HKV=block_hkv, BLOCK_D=block_d,
        num_warps=_warps(block_d, block_hq, block_hkv), **pdl_launch(q.device))
    return q_out
