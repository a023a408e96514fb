"""Scatter new K/V rows into a cache: cache[idx0[t], idx1[t]] = kv[t].

The cache is any 4-D view ``[N0, N1, Hkv, D]`` (strides free): contiguous caches pass
(row, position), paged caches pass (block, offset). A row whose ``idx0`` is negative is
skipped: the padding rows of a prefill captured for a longer prompt write nowhere.
"""
import torch

from ._triton import HAVE_TRITON, next_pow2, pdl_enter, pdl_launch, tl, triton


def _live_rows(idx0, *rows):
    """Drop the rows whose idx0 is negative (padding); the reference may sync, the kernel not."""
    keep = idx0 >= 0
    if bool(keep.all()):
        return (idx0, *rows)
    return tuple(x[keep] for x in (idx0, *rows))


def kv_write_torch(k, v, k_cache, v_cache, idx0, idx1) -> None:
    # k, v: [T, Hkv, D]; k_cache, v_cache: [N0, N1, Hkv, D]; idx0, idx1: [T] int (idx0 < 0: skip)
    idx0, idx1, k, v = _live_rows(idx0, idx1, k, v)
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
        H, D, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
        pdl_enter(PDL)
        # One program per token writes all its K and V heads.
        tok = tl.program_id(0).to(tl.int64)
        # int64 offsets: a large cache holds more than 2**31 elements
        i0 = tl.load(idx0_ptr + tok).to(tl.int64)
        i1 = tl.load(idx1_ptr + tok).to(tl.int64)
        if i0 >= 0:  # negative: a padding row, written nowhere
            _write_heads(k_ptr, kc_ptr, tok, i0 * stride_k0 + i1 * stride_k1, stride_kt,
                         stride_kh, stride_kch, H, D, BLOCK_H, BLOCK_D)
            _write_heads(v_ptr, vc_ptr, tok, i0 * stride_v0 + i1 * stride_v1, stride_vt,
                         stride_vh, stride_vch, H, D, BLOCK_H, BLOCK_D)


def kv_write_triton(k, v, k_cache, v_cache, idx0, idx1) -> None:
    """Same contract as ``kv_write_torch``: writes in place, returns None."""
    # k, v: [T, Hkv, D]; k_cache, v_cache: [N0, N1, Hkv, D] any strides; idx0, idx1: [T] int
    t, h, d = _check_kv_write(k, v, k_cache, v_cache, idx0, idx1)
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
        **pdl_launch(k.device))
    return None


# -- quantised variants: each (token, head) row of D values scaled on the way in ---------
# scale = amax(|x|) * fp32(1 / QMAX), stored beside the values; y = x / scale, |y| <= QMAX;
# int8 (QMAX 127): q = round_half_even(y); e4m3 (QMAX 448): q = e4m3(y), round to nearest
# even. An all-zero row gets scale 0 and q = 0. Dequantise: q * scale.
# (A multiply, not "/ QMAX": torch on CUDA divides by a scalar through its reciprocal,
# so only the multiply rounds the same in torch on every device and in the kernel.)
INV_127 = 1.0 / 127.0
INV_448 = 1.0 / 448.0
#: the K/V quantisers' formats (``Quantizer.kv_dtype``) -> the caches' storage dtype
KV_STORAGE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
QUANT_KV_DTYPES = tuple(KV_STORAGE_DTYPES.values())


def quantize_kv_torch(x, dtype=torch.int8):
    """x: [..., D] -> (``dtype`` [..., D], float32 scale [...]), the kernel's exact math;
    ``dtype`` int8 or float8_e4m3fn."""
    assert dtype in QUANT_KV_DTYPES, f"K/V quantise to int8 or float8_e4m3fn, not {dtype}"
    fp8 = dtype == torch.float8_e4m3fn
    xf = x.float()
    scale = xf.abs().amax(-1) * (INV_448 if fp8 else INV_127)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = xf / safe[..., None]
    if fp8:
        return y.clamp_(-448.0, 448.0).to(dtype), scale
    return torch.round(y).clamp_(-127, 127).to(dtype), scale  # round: half to even


def quantize_int8_torch(x):
    """x: [..., D] -> (int8 [..., D], float32 scale [...]), the kernel's exact math."""
    return quantize_kv_torch(x, torch.int8)


def kv_write_quant_torch(k, v, k_cache, v_cache, k_scale, v_scale, idx0, idx1) -> None:
    # k, v: [T, Hkv, D]; *_cache: int8 | e4m3 [N0, N1, Hkv, D]; *_scale: f32 [N0, N1, Hkv]
    idx0, idx1, k, v = _live_rows(idx0, idx1, k, v)
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        q, s = quantize_kv_torch(x, cache.dtype)
        cache[idx0, idx1] = q
        scale[idx0, idx1] = s


if HAVE_TRITON:

    @triton.jit
    def _round_e4m3(y):
        # y (float32, |y| <= 448) to the nearest e4m3 value, ties to even, still float32:
        # a step of 2^(e - 3) in the binade [2^e, 2^(e+1)), 2^-9 below 2^-6 (subnormals).
        # Rounded here so the store converts exact values only (the 3.9 interpreter's
        # float32 -> e4m3 loses the carry into the exponent: 31.97 -> 16).
        e = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127          # floor(log2 |y|)
        step = ((tl.maximum(e, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)
        v = y / step                     # exact (a power of two), |v| < 16
        r = (v + 12582912.0) - 12582912.0  # 1.5 * 2^23: float32 rounds v to even
        return r * step

    @triton.jit
    def quant_store_heads(x, mask, dst_ptr, scale_ptr, slot, sslot, stride_ch, stride_sh, H,
                          BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr,
                          INV: tl.constexpr):
        # x: [BLOCK_H, BLOCK_D] float32, one token's heads (0 where masked) -> the cache
        # slot's rows (int8 or e4m3, by dst's type) and one scale a head
        heads = tl.arange(0, BLOCK_H)[:, None]
        dims = tl.arange(0, BLOCK_D)[None, :]
        scale = tl.max(tl.abs(x), axis=1) * INV                           # [BLOCK_H]
        safe = tl.where(scale > 0, scale, 1.0)
        y = tl.math.div_rn(x, safe[:, None])                             # |y| <= QMAX
        if FP8:
            r = _round_e4m3(tl.minimum(tl.maximum(y, -448.0), 448.0))
        else:
            r = tl.floor(y + 0.5)  # exact for |y| <= 127; then ties go to even, like torch
            odd = (r - 2.0 * tl.floor(r * 0.5)) != 0
            r = tl.where(((r - y) == 0.5) & odd, r - 1.0, r)
            r = tl.minimum(tl.maximum(r, -127.0), 127.0)
        tl.store(dst_ptr + slot + heads * stride_ch + dims, r.to(dst_ptr.dtype.element_ty),
                 mask=mask)
        h1 = tl.arange(0, BLOCK_H)
        tl.store(scale_ptr + sslot + h1 * stride_sh, scale, mask=h1 < H)

    @triton.jit
    def _quant_write_heads(src_ptr, dst_ptr, scale_ptr, tok, slot, sslot, stride_t, stride_h,
                           stride_ch, stride_sh, H, D, BLOCK_H: tl.constexpr,
                           BLOCK_D: tl.constexpr, FP8: tl.constexpr, INV: tl.constexpr):
        heads = tl.arange(0, BLOCK_H)[:, None]
        dims = tl.arange(0, BLOCK_D)[None, :]
        mask = (heads < H) & (dims < D)                                  # [BLOCK_H, BLOCK_D]
        x = tl.load(src_ptr + tok * stride_t + heads * stride_h + dims, mask=mask,
                    other=0.0).to(tl.float32)
        quant_store_heads(x, mask, dst_ptr, scale_ptr, slot, sslot, stride_ch, stride_sh, H,
                          BLOCK_H, BLOCK_D, FP8, INV)

    @triton.jit
    def _kv_write_quant_kernel(
        k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, idx0_ptr, idx1_ptr,
        stride_kt, stride_kh, stride_vt, stride_vh,
        stride_k0, stride_k1, stride_kch, stride_v0, stride_v1, stride_vch,
        stride_ks0, stride_ks1, stride_ksh, stride_vs0, stride_vs1, stride_vsh,
        H, D, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr,
        INV: tl.constexpr, PDL: tl.constexpr):
        pdl_enter(PDL)
        # One program per token quantises and writes all its K and V heads.
        tok = tl.program_id(0).to(tl.int64)
        i0 = tl.load(idx0_ptr + tok).to(tl.int64)
        i1 = tl.load(idx1_ptr + tok).to(tl.int64)
        if i0 >= 0:  # negative: a padding row, written nowhere
            _quant_write_heads(k_ptr, kc_ptr, ks_ptr, tok, i0 * stride_k0 + i1 * stride_k1,
                               i0 * stride_ks0 + i1 * stride_ks1, stride_kt, stride_kh,
                               stride_kch, stride_ksh, H, D, BLOCK_H, BLOCK_D, FP8, INV)
            _quant_write_heads(v_ptr, vc_ptr, vs_ptr, tok, i0 * stride_v0 + i1 * stride_v1,
                               i0 * stride_vs0 + i1 * stride_vs1, stride_vt, stride_vh,
                               stride_vch, stride_vsh, H, D, BLOCK_H, BLOCK_D, FP8, INV)


def kv_write_quant_triton(k, v, k_cache, v_cache, k_scale, v_scale, idx0, idx1) -> None:
    """Same contract as ``kv_write_quant_torch``: writes in place, returns None."""
    t, h, d = check_quant_write(k, v, k_cache, v_cache, k_scale, v_scale, idx0, idx1)
    if t == 0 or h == 0 or d == 0:
        return None
    idx0, idx1 = idx0.contiguous(), idx1.contiguous()
    block_h, block_d = next_pow2(h), next_pow2(d)
    _kv_write_quant_kernel[(t,)](
        k, v, k_cache, v_cache, k_scale, v_scale, idx0, idx1,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        k_scale.stride(0), k_scale.stride(1), k_scale.stride(2),
        v_scale.stride(0), v_scale.stride(1), v_scale.stride(2),
        h, d, BLOCK_H=block_h, BLOCK_D=block_d, **quant_format(k_cache),
        num_warps=4 if block_h * block_d <= 2048 else 8,
        **pdl_launch(k.device))
    return None


def quant_format(cache) -> dict:
    """The quantising kernels' FP8 and INV (1 / QMAX) meta-parameters for ``cache``'s dtype."""
    fp8 = cache.dtype == torch.float8_e4m3fn
    return dict(FP8=fp8, INV=INV_448 if fp8 else INV_127)


def check_quant_write(k, v, k_cache, v_cache, k_scale, v_scale, idx0, idx1):
    """``_check_kv_write`` for int8 / e4m3 caches and their scales; returns (T, Hkv, D)."""
    t, h, d = _check_kv_write(k, v, k_cache, v_cache, idx0, idx1, quant=True)
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        assert s.shape == k_cache.shape[:3], \
            f"{name} must be [{', '.join(map(str, k_cache.shape[:3]))}], got {tuple(s.shape)}"
        assert s.dtype == torch.float32, f"{name} must be float32, got {s.dtype}"
        assert s.device == k.device, f"{name} on {s.device} but k on {k.device}"
    return t, h, d


def _check_kv_write(k, v, k_cache, v_cache, idx0, idx1, quant: bool = False):
    """Shape/stride/dtype/device checks shared by both launchers; returns (T, Hkv, D)."""
    # k, v: [T, Hkv, D]; k_cache, v_cache: [N0, N1, Hkv, D] any strides; idx0, idx1: [T] int
    assert k.dim() == 3 and k.shape == v.shape, \
        f"k and v must both be [T, Hkv, D], got {tuple(k.shape)} and {tuple(v.shape)}"
    t, h, d = k.shape
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        assert c.dim() == 4 and c.shape[2:] == (h, d), \
            f"{name} must be [N0, N1, {h}, {d}], got {tuple(c.shape)}"
        assert not quant or c.dtype == k_cache.dtype in QUANT_KV_DTYPES, \
            f"{name} must be int8 or float8_e4m3fn (both alike), got {c.dtype}"
        assert d <= 1 or c.stride(3) == 1, f"{name} must be contiguous in its last dim, strides {c.stride()}"
    for name, x in (("k", k), ("v", v)):
        assert d <= 1 or x.stride(2) == 1, f"{name} must be contiguous in its last dim, strides {x.stride()}"
        assert not quant or x.is_floating_point(), f"{name} must be a float tensor, got {x.dtype}"
    for name, ix in (("idx0", idx0), ("idx1", idx1)):
        assert ix.shape == (t,), f"{name} must be [{t}], got {tuple(ix.shape)}"
        assert ix.dtype in (torch.int32, torch.int64), f"{name} must be int32 or int64, got {ix.dtype}"
    for name, x in (("v", v), ("k_cache", k_cache), ("v_cache", v_cache), ("idx0", idx0), ("idx1", idx1)):
        assert x.device == k.device, f"{name} on {x.device} but k on {k.device}"
    return t, h, d
