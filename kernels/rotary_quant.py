"""``rotary_kv_write_quant``: decode's RoPE and the write into an int8 or e4m3 K/V cache
in one kernel (``rotary_kv_write`` for quantised caches): rotated q is returned, rotated k
and v are quantised per (token, head) into their cache slots with their scales.

The rotated k is rounded to k's dtype before it is quantised, so the cache holds exactly
what ``rotary`` followed by ``kv_write_quant`` (two kernels) would store.
"""
import torch

from ._triton import HAVE_TRITON, next_pow2, pdl_enter, pdl_launch, tl, triton
from .kv_write import check_quant_write, kv_write_quant_torch, quant_format
from .rotary import _check_rotary, _warps, rotary_torch

if HAVE_TRITON:
    from .kv_write import quant_store_heads
    from .rotary import _token_and_q, rotated_heads

    @triton.jit
    def _rotary_kv_write_quant_kernel(
        q_ptr, k_ptr, v_ptr, qo_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, cos_ptr, sin_ptr, pos_ptr,
        idx0_ptr, idx1_ptr,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs,
        stride_k0, stride_k1, stride_kch, stride_v0, stride_v1, stride_vch,
        stride_ks0, stride_ks1, stride_ksh, stride_vs0, stride_vs1, stride_vsh,
        HQ, HKV, D, HALF,
        BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_D: tl.constexpr,
        FP8: tl.constexpr, INV: tl.constexpr, PDL: tl.constexpr):
        pdl_enter(PDL)
        # One program per token: rotate q (to qo); rotate k, quantise k and v into the slot.
        tok, cols, c, s, partner, sign, rot = _token_and_q(
            q_ptr, qo_ptr, cos_ptr, sin_ptr, pos_ptr, stride_qt, stride_qh, stride_cs, HQ, D,
            HALF, BLOCK_HQ, BLOCK_D)
        i0 = tl.load(idx0_ptr + tok).to(tl.int64)
        i1 = tl.load(idx1_ptr + tok).to(tl.int64)
        if i0 >= 0:  # negative: a padding row, written nowhere
            kr, mask = rotated_heads(k_ptr, tok, stride_kt, stride_kh, HKV, D, c, s, partner,
                                     sign, rot, cols, BLOCK_HKV)       # [BLOCK_HKV, BLOCK_D]
            kr = kr.to(k_ptr.dtype.element_ty).to(tl.float32)  # as rotary's output holds it
            heads = tl.arange(0, BLOCK_HKV)[:, None]
            quant_store_heads(kr, mask, kc_ptr, ks_ptr, i0 * stride_k0 + i1 * stride_k1,
                              i0 * stride_ks0 + i1 * stride_ks1, stride_kch, stride_ksh, HKV,
                              BLOCK_HKV, BLOCK_D, FP8, INV)
            v = tl.load(v_ptr + tok * stride_vt + heads * stride_vh + cols[None, :], mask=mask,
                        other=0.0).to(tl.float32)
            quant_store_heads(v, mask, vc_ptr, vs_ptr, i0 * stride_v0 + i1 * stride_v1,
                              i0 * stride_vs0 + i1 * stride_vs1, stride_vch, stride_vsh, HKV,
                              BLOCK_HKV, BLOCK_D, FP8, INV)


def rotary_kv_write_quant_torch(q, k, v, cos, sin, positions, k_cache, v_cache, k_scale,
                                v_scale, idx0, idx1):
    """RoPE on q and k, then k and v quantised into ``cache[idx0[t], idx1[t]]`` with their
    scales (rows with idx0 < 0 skipped); returns the rotated q [T, Hq, D]."""
    # q: [T, Hq, D]; k, v: [T, Hkv, D]; *_cache: int8 | e4m3 [N0, N1, Hkv, D]; *_scale: f32
    q_rot, k_rot = rotary_torch(q, k, cos, sin, positions)
    kv_write_quant_torch(k_rot, v, k_cache, v_cache, k_scale, v_scale, idx0, idx1)
    return q_rot


def rotary_kv_write_quant_triton(q, k, v, cos, sin, positions, k_cache, v_cache, k_scale,
                                 v_scale, idx0, idx1):
    """Same contract as ``rotary_kv_write_quant_torch``, in one kernel."""
    t, hq, d, half = _check_rotary(q, k, cos, sin, positions)
    check_quant_write(k, v, k_cache, v_cache, k_scale, v_scale, idx0, idx1)
    hkv = k.shape[1]
    q_out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    if t == 0 or d == 0:
        return q_out
    positions, idx0, idx1 = positions.contiguous(), idx0.contiguous(), idx1.contiguous()
    block_d, block_hq, block_hkv = next_pow2(d), next_pow2(hq), next_pow2(hkv)
    _rotary_kv_write_quant_kernel[(t,)](
        q, k, v, q_out, k_cache, v_cache, k_scale, v_scale, cos, sin, positions, idx0, idx1,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        k_scale.stride(0), k_scale.stride(1), k_scale.stride(2),
        v_scale.stride(0), v_scale.stride(1), v_scale.stride(2),
        hq, hkv, d, half,
        BLOCK_HQ=block_hq, BLOCK_HKV=block_hkv, BLOCK_D=block_d, **quant_format(k_cache),
        num_warps=_warps(block_d, block_hq, block_hkv), **pdl_launch(q.device))
    return q_out
