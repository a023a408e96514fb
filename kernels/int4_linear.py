"""int4 weight-only linear (W4A16, group-wise, asymmetric): y = x W^T + b with W stored as
4-bit codes q, two a byte, and per (row, group of ``group_size`` columns) a float32 scale
s and a zero-point z: W[n, k] ~= (q[n, k] - z[n, g]) * s[n, g], g = k // group_size.

``Int4Weight`` is the packed format (the GPTQ / AWQ loaders convert into exactly it):
column 2c in a byte's low nibble, 2c + 1 in its high one, a padded last column (odd K)
0; the last group may be partial (K = 576 is 4.5 groups of 128). ``quantize_int4`` is our
round-to-nearest quantiser (per group min / max, the range widened to hold 0).

The kernel streams the bytes (a quarter of bf16's), unpacks the nibbles in registers,
subtracts the zero-points (q - z is exact in x's dtype: |q - z| <= 15) and multiplies each
K tile's float32 dot by its group's scale (a tile never straddles two groups), summing in
float32: the float32 math of ``int4_linear_torch`` up to summation order.
"""
import attrs
import torch
import torch.nn.functional as F

from ._triton import HAVE_TRITON, next_pow2, pdl_launch, pdl_release, pdl_wait, tl, triton
from ._rows import gemm_rows

GROUP_SIZES = (32, 64, 128)


@attrs.frozen
class Int4Weight:
    qweight: torch.Tensor  # uint8 [N, ceil(K / 2)]: column 2c low nibble, 2c + 1 high; pad 0
    scales: torch.Tensor  # float32 [N, G], G = ceil(K / group_size)
    zeros: torch.Tensor  # uint8 [N, G]: the zero-point, 0..15; w ~= (q - zero) * scale
    group_size: int  # 32, 64 or 128
    in_features: int  # K (the last group may be partial)
    dtype: torch.dtype  # of the weight it came from


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """q uint8 [N, K] of values 0..15 -> uint8 [N, ceil(K / 2)] (2c low, 2c + 1 high)."""
    assert q.dim() == 2 and q.dtype == torch.uint8, f"q must be uint8 [N, K], got {q.dtype}"
    if q.shape[1] % 2:
        q = F.pad(q, (0, 1))  # the padded last column is 0
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_nibbles(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """uint8 [N, ceil(K / 2)] -> q uint8 [N, K] (``in_features`` = K)."""
    assert packed.dim() == 2 and packed.dtype == torch.uint8, \
        f"packed must be uint8 [N, ceil(K / 2)], got {tuple(packed.shape)} {packed.dtype}"
    assert packed.shape[1] == -(-in_features // 2), \
        f"{packed.shape[1]} bytes a row do not hold K={in_features} nibbles"
    both = torch.stack([packed & 0xF, packed >> 4], dim=2)  # [N, Kp, 2]
    return both.reshape(packed.shape[0], -1)[:, :in_features]


def _grouped(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N, K] -> [N, G, group_size], a partial last group padded with its last column
    (which leaves the group's min and max as they are)."""
    n, k = w.shape
    pad = -k % group_size
    if pad:
        w = torch.cat([w, w[:, -1:].expand(n, pad)], dim=1)
    return w.reshape(n, -1, group_size)


def quantize_int4(weight: torch.Tensor, group_size: int = 128) -> Int4Weight:
    """Round to nearest, per (row, group) asymmetric: the group's [min, max] widened to
    hold 0, scale = (max - min) / 15, zero = round(-min / scale), q = clamp(round(w /
    scale) + zero, 0, 15); |w - (q - zero) scale| <= scale / 2. An all-zero group gets
    scale 1, zero 0 (q = 0)."""
    assert weight.dim() == 2 and weight.is_floating_point(), \
        f"weight must be a float [N, K] matrix, got {tuple(weight.shape)} {weight.dtype}"
    assert group_size in GROUP_SIZES, f"group_size {group_size} not one of {GROUP_SIZES}"
    n, k = weight.shape
    g = _grouped(weight.float(), group_size)  # [N, G, gs]
    lo = g.amin(dim=2).clamp(max=0.0)
    hi = g.amax(dim=2).clamp(min=0.0)
    scale = torch.where(hi > lo, (hi - lo) / 15.0, torch.ones_like(lo))  # [N, G]
    zero = torch.round(-lo / scale).clamp_(0, 15)
    q = (torch.round(g / scale[..., None]) + zero[..., None]).clamp_(0, 15)
    q = q.reshape(n, -1)[:, :k].to(torch.uint8)
    return Int4Weight(pack_nibbles(q), scale.contiguous(), zero.to(torch.uint8).contiguous(),
                      group_size, k, weight.dtype)


def dequantize_float(qweight, scales, zeros, group_size: int, in_features: int):
    """The float32 weight [N, K] the packed tensors stand for."""
    q = unpack_nibbles(qweight, in_features).float()  # [N, K]
    cols = torch.arange(in_features, device=q.device) // group_size
    return (q - zeros.float()[:, cols]) * scales[:, cols]


def dequantize_int4(packed: Int4Weight) -> torch.Tensor:
    """-> the weight [N, K] in ``packed.dtype`` (computed in float32, then rounded)."""
    return dequantize_float(packed.qweight, packed.scales, packed.zeros, packed.group_size,
                            packed.in_features).to(packed.dtype)


def int4_linear_torch(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                      zeros: torch.Tensor, group_size: int, in_features: int,
                      bias=None) -> torch.Tensor:
    # x: [..., K], qweight: [N, ceil(K / 2)] uint8, scales / zeros: [N, G] -> [..., N] in x's dtype
    w = dequantize_float(qweight, scales, zeros, group_size, in_features)
    y = F.linear(x.float(), w)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


if HAVE_TRITON:

    @triton.jit
    def _int4_linear_kernel(x_ptr, q_ptr, s_ptr, z_ptr, b_ptr, y_ptr, M, N, K, G,
                            stride_xm, stride_qn, stride_ym,
                            GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        pdl_wait(PDL)  # as linear.py: dependents launch after the K loop
        # one program per [BLOCK_M, BLOCK_N] output tile; BLOCK_K divides GROUP
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        mmask, nmask = rm < M, rn < N
        x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm                   # [BM, 1]
        q_rows = q_ptr + rn[:, None].to(tl.int64) * stride_qn                   # [BN, 1]
        sz_rows = rn.to(tl.int64) * G                                           # [BN]
        shift = ((rk % 2) * 4)[None, :]  # even columns in the low nibble      # [1, BK]
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)  # tl.zeros fails in the 3.9 interpreter
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + rk
            kmask = cols < K
            x = tl.load(x_rows + cols[None, :], mask=mmask[:, None] & kmask[None, :],
                        other=0.0)                                              # [BM, BK]
            # each byte is read for both its columns (the second read hits the cache)
            b = tl.load(q_rows + (cols // 2)[None, :], mask=nmask[:, None] & kmask[None, :],
                        other=0)                                                # [BN, BK]
            g = k0 // GROUP
            z = tl.load(z_ptr + sz_rows + g, mask=nmask, other=0)               # [BN]
            s = tl.load(s_ptr + sz_rows + g, mask=nmask, other=0.0)             # [BN]
            nib = (b.to(tl.int32) >> shift) & 0xF
            w = (nib - z.to(tl.int32)[:, None]).to(x.dtype)  # exact: |q - z| <= 15
            if IEEE:
                part = tl.dot(x, tl.trans(w), input_precision="ieee")          # [BM, BN]
            else:
                part = tl.dot(x, tl.trans(w))
            acc += part * s[None, :]
        pdl_release(PDL)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
        y_ptrs = y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


def int4_config(m: int, n: int, k: int, group_size: int) -> dict:
    """Decode (a few rows, the skinny GEMM): one row tile, narrow column tiles so every SM
    streams weight bytes, a whole group per K tile. Prefill: square 64 / 128 tiles. A K
    tile never straddles a group (BLOCK_K divides group_size). Not yet tuned on a GPU."""
    if m <= 64:
        return dict(BLOCK_M=max(16, next_pow2(m)), BLOCK_N=32 if n < 8192 else 64,
                    BLOCK_K=min(group_size, 128), num_warps=4, num_stages=3)
    return dict(BLOCK_M=128 if m >= 256 else 64, BLOCK_N=128, BLOCK_K=min(group_size, 64),
                num_warps=8, num_stages=3)


def int4_linear_triton(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                       zeros: torch.Tensor, group_size: int, in_features: int, bias=None,
                       config=None) -> torch.Tensor:
    """Same contract as ``int4_linear_torch``, one kernel; x may have leading dims."""
    k = in_features
    n, kp = qweight.shape
    g = -(-k // group_size)
    assert group_size in GROUP_SIZES, f"group_size {group_size} not one of {GROUP_SIZES}"
    assert qweight.dtype == torch.uint8 and qweight.is_contiguous() and kp == -(-k // 2), \
        f"qweight must be contiguous uint8 [N, {-(-k // 2)}], got {tuple(qweight.shape)} " \
        f"{qweight.dtype}"
    assert x.shape[-1] == k, f"x has K={x.shape[-1]} but in_features is {k}"
    assert x.dtype in (torch.float32, torch.float16, torch.bfloat16), f"x dtype {x.dtype}"
    assert scales.shape == (n, g) and scales.dtype == torch.float32 and scales.is_contiguous(), \
        f"scales must be contiguous float32 [{n}, {g}], got {tuple(scales.shape)} {scales.dtype}"
    assert zeros.shape == (n, g) and zeros.dtype == torch.uint8 and zeros.is_contiguous(), \
        f"zeros must be contiguous uint8 [{n}, {g}], got {tuple(zeros.shape)} {zeros.dtype}"
    assert bias is None or bias.shape == (n,), f"bias must be [{n}], got {tuple(bias.shape)}"
    for name, t in (("qweight", qweight), ("scales", scales), ("zeros", zeros), ("bias", bias)):
        assert t is None or t.device == x.device, f"{name} on {t.device} but x on {x.device}"
    x2, y, lead = gemm_rows(x, k, n)  # [M, K], [M, N]
    m = x2.shape[0]
    if m == 0 or n == 0:
        return y.reshape(*lead, n)
    cfg = dict(config or int4_config(m, n, k, group_size))
    assert group_size % cfg["BLOCK_K"] == 0, f"BLOCK_K {cfg['BLOCK_K']} must divide {group_size}"
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]))
    _int4_linear_kernel[grid](
        x2, qweight, scales, zeros, qweight if bias is None else bias, y, m, n, k, g,
        x2.stride(0), qweight.stride(0), y.stride(0), GROUP=group_size,
        HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32, **cfg, **pdl_launch(x.device))
    return y.reshape(*lead, n)
