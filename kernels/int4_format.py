"""The int4 format (W4A16, group-wise, asymmetric): W[n, k] ~= (q[n, k] - z[n, g]) *
s[n, g], g = k // group_size, 4-bit codes q two a byte, a float32 scale s and a uint8
zero-point z per (row, group of ``group_size`` columns).

``Int4Weight`` is the packed form (the GPTQ / AWQ loaders convert into exactly it, and
every int4 kernel reads it as loaded: ``int4_linear.py``, ``int4_gemv.py``, ``int4_mma.py``):
column 2c in a byte's low nibble, 2c + 1 in its high one, a padded last column (odd K) 0;
the last group may be partial (K = 576 is 4.5 groups of 128). ``quantize_int4`` is our
round-to-nearest quantiser (per group min / max, the range widened to hold 0).
"""
import attrs
import torch
import torch.nn.functional as F

GROUP_SIZES = (32, 64, 128)


@attrs.frozen
class Int4Weight:
    qweight: torch.Tensor  # uint8 [N, ceil(K / 2)]: column 2c low nibble, 2c + 1 high; pad 0
    scales: torch.Tensor  # float32 [N, G], G = ceil(K / group_size)
    zeros: torch.Tensor  # uint8 [N, G]: the zero-point, 0..15; w ~= (q - zero) * scale
    group_size: int  # 32, 64 or 128
    in_features: int  # K (the last group may be partial)
    dtype: torch.dtype  # of the weight it came from
    perm: torch.Tensor | None = None  # act-order: x[..., perm] is what the columns multiply


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
