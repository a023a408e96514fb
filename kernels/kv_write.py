"""Scatter new K/V rows into a cache: cache[idx0[t], idx1[t]] = kv[t].

The cache is any 4-D view ``[N0, N1, Hkv, D]`` (strides free): contiguous caches pass
(row, position), paged caches pass (block, offset).
"""
import torch

from ._triton import HAVE_TRITON, next_pow2, tl, triton


def kv_write_torch(k, v, k_cache, v_cache, idx0, idx1) -> None:
    # k, v: [T, Hkv, D]; k_cache, v_cache: [N0, N1, Hkv, D]; idx0, idx1: [T] int
    k_cache[idx0, idx1] = k.to(k_cache.dtype)
    v_cache[idx0, idx1] = v.to(v_cache.dtype)


if HAVE_TRITON:

    @triton.jit
    def _write_heads(src_ptr, dst_ptr, tok, slot, stride_t, stride_h, stride_ch,
                     H, D, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        # src: [H, D] of one token -> dst slot: [H, D] (head stride free, dims contiguous)
        heads = tl.arange(0, BLOCK_H)[:, None]
        dims = tl.arange(0, BLOCK_D)[None, :]
        mask = (heads < H) & (dims < D)                                  # [BLOCK_H, BLOCK_D]
        x = tl.load(src_ptr + tok * stride_t + heads * stride_h + dims, mask=mask)
        tl.store(dst_ptr + slot + heads * stride_ch + dims,
                 x.to(dst_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _kv_write_kernel(
        k_ptr, v_ptr, kc_ptr, vc_ptr, idx0_ptr, idx1_ptr,
        stride_kt, stride_kh, stride_vt, stride_vh,
        stride_k0, stride_k1, stride_kch, stride_v0, stride_v1, stride_vch,
        H, D, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        # One program per token writes all its K and V heads.
        tok = tl.program_id(0).to(tl.int64)
        # int64 offsets: a large cache holds more than 2**31 elements
        i0 = tl.load(idx0_ptr + tok).to(tl.int64)
        i1 = tl.load(idx1_ptr + tok).to(tl.int64)
        _write_heads(k_ptr, kc_ptr, tok, i0 * stride_k0 + i1 * stride_k1, stride_kt, stride_kh,
                     stride_kch, H, D, BLOCK_H, BLOCK_D)
        _write_heads(v_ptr, vc_ptr, tok, i0 * stride_v0 + i1 * stride_v1, stride_vt, stride_vh,
                     stride_vch, H, D, BLOCK_H, BLOCK_D)


def kv_write_triton(k, v, k_cache, v_cache, idx0, idx1) -> None:
    """Same contract as ``kv_write_torch``: writes in place, returns None."""
    # k, v: [T, Hkv, D]; k_cache, v_cache: [N0, N1, Hkv, D] any strides; idx0, idx1: [T] int
    assert k.dim() == 3 and k.shape == v.shape, \
        f"k and v must both be [T, Hkv, D], got {tuple(k.shape)} and {tuple(v.shape)}"
    t, h, d = k.shape
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        assert c.dim() == 4 and c.shape[2:] == (h, d), \
            f"{name} must be [N0, N1, {h}, {d}], got {tuple(c.shape)}"
        assert d <= 1 or c.stride(3) == 1, f"{name} must be contiguous in its last dim, strides {c.stride()}"
    for name, x in (("k", k), ("v", v)):
        assert d <= 1 or x.stride(2) == 1, f"{name} must be contiguous in its last dim, strides {x.stride()}"
    for name, ix in (("idx0", idx0), ("idx1", idx1)):
        assert ix.shape == (t,), f"{name} must be [{t}], got {tuple(ix.shape)}"
        assert ix.dtype in (torch.int32, torch.int64), f"{name} must be int32 or int64, got {ix.dtype}"
    for name, x in (("v", v), ("k_cache", k_cache), ("v_cache", v_cache), ("idx0", idx0), ("idx1", idx1)):
        assert x.device == k.device, f"{name} on {x.device} but k on {k.device}"
    if t == 0 or h == 0 or d == 0:
        return None
    idx0, idx1 = idx0.contiguous(), idx1.contiguous()
    block_h, block_d = next_pow2(h), next_pow2(d)
    _kv_write_kernel[(t,)](
        k, v, k_cache, v_cache, idx0, idx1,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        h, d, BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=4 if block_h * block_d <= 2048 else 8,
    )
    return None
