"""4-bit codes of a projection and their GPTQ / AWQ checkpoint tensors: the asymmetric
grid of a group (scale, integer zero-point), round to nearest on it, and the public
layouts that ``core.loading.gptq`` reads (its docstring describes them). Used by the
``quantize`` tool (``core.quantize``) and by the test checkpoints of
``core.testing.gptq_pack``.

Codes are ``q`` uint8 [N, K] (0..15), ``zeros`` uint8 [N, G] and ``scales`` float16 [N, G]
for G = ceil(K / group_size) groups of input columns: w[n, k] ~= (q - zero) * scale of
group k // group_size. GPTQ's v1 format (``checkpoint_format`` "gptq", the one
transformers and the GPTQ kernels read) stores zero - 1 in a nibble, so a zero-point of 0
cannot be written there: ``min_zero=1`` keeps zero-points in 1..15 (a group that would need
0 gets the grid [-scale, 14 scale] instead, ``int4_grid``).
"""
from __future__ import annotations

import torch

from ..loading.gptq import AWQ_ORDER, SHIFTS

#: the decoder projections of the LLaMA / Mistral family (HF module names)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def int4_grid(w: torch.Tensor, min_zero: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The asymmetric 4-bit grid of each group of the last dimension: w [..., gs] ->
    (scale [...], zero [...]) float32, the scale rounded to float16 as it is stored.

    The group's [min, max] widened to hold 0; scale = (max - min) / 15, zero =
    round(-min / scale) in min_zero..15. Where the zero would fall below ``min_zero``
    the scale grows to max / (15 - min_zero), so that the group's max stays on the grid.
    An all-zero group gets scale 1 (its codes are its zero)."""
    lo = w.amin(dim=-1).clamp(max=0.0)
    hi = w.amax(dim=-1).clamp(min=0.0)
    scale = torch.maximum((hi - lo) / 15, hi / (15 - min_zero)).half().float()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = torch.round(-lo / scale).clamp(min_zero, 15)
    return scale, zero


def round_to_grid(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The codes (float, 0..15) of ``w`` on the grid (``scale``, ``zero`` broadcast to it)."""
    return (torch.round(w / scale) + zero).clamp(0, 15)


def rtn_int4(weight: torch.Tensor, group_size: int, sym: bool = False, min_zero: int = 0):
    """Round to nearest: weight [N, K] -> (q uint8 [N, K], zeros uint8 [N, G], scales
    float16 [N, G]), per row and group of ``group_size`` columns (a partial last group
    padded with zeros, which leaves its grid as it is: the grid holds 0). ``sym``: zero 8
    (GPTQ's symmetric); ``min_zero`` 1 keeps GPTQ v1's zero - 1 representable."""
    n, k = weight.shape
    groups = -(-k // group_size)
    w = torch.nn.functional.pad(weight.float(), (0, groups * group_size - k))
    w = w.reshape(n, groups, group_size)
    if sym:
        scale = (w.abs().amax(dim=2) / 7).half().float()
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        zero = torch.full_like(scale, 8)
    else:
        scale, zero = int4_grid(w, min_zero)
    q = round_to_grid(w, scale[..., None], zero[..., None])
    q = q.reshape(n, -1)[:, :k]
    return q.to(torch.uint8), zero.to(torch.uint8), scale.half()


def dequantize(q, zeros, scales, group_size: int) -> torch.Tensor:
    """The float32 [N, K] weight of codes ``q`` with their ``zeros`` and ``scales``."""
    cols = torch.arange(q.shape[1], device=q.device) // group_size
    return (q.float() - zeros.float()[:, cols]) * scales.float()[:, cols]


def pack_int32(nibbles: torch.Tensor) -> torch.Tensor:
    """uint8 [R, C, 8] of values 0..15 -> int32 [R, C], nibble i in bits 4i..4i+3."""
    out = torch.zeros(nibbles.shape[:2], dtype=torch.int64)
    for i, shift in enumerate(SHIFTS):
        out |= (nibbles[..., i].long() & 0xF) << shift
    return torch.where(out >= 2 ** 31, out - 2 ** 32, out).to(torch.int32)  # as int32 bits


def pack_gptq(q, zeros, scales, group_size: int, v1: bool = True) -> dict:
    """GPTQ tensors of one projection (v1: zero - 1 stored, masked to a nibble): qweight
    int32 [K/8, N], qzeros int32 [G, N/8], scales [G, N], g_idx int32 [K]. N and K must be
    multiples of 8."""
    n, k = q.shape
    stored = (zeros.to(torch.int16) - (1 if v1 else 0)) & 0xF
    return {"qweight": pack_int32(q.t().reshape(k // 8, 8, n).permute(0, 2, 1)),
            "qzeros": pack_int32(stored.t().reshape(-1, n // 8, 8)),
            "scales": scales.t().contiguous(),
            "g_idx": (torch.arange(k) // group_size).to(torch.int32)}


def pack_awq(q, zeros, scales) -> dict:
    """AWQ (GEMM) tensors of one projection: nibble i of an int32 holds column ORDER[i]."""
    order = list(AWQ_ORDER)
    n, k = q.shape
    return {"qweight": pack_int32(q.t().reshape(k, n // 8, 8)[..., order]),
            "qzeros": pack_int32(zeros.t().reshape(-1, n // 8, 8)[..., order]),
            "scales": scales.t().contiguous()}


def quantization_config(method: str, group_size: int, sym: bool = False,
                        v1: bool = True) -> dict:
    """config.json's ``quantization_config`` of a 4-bit ``method`` ("gptq" / "awq")
    checkpoint in groups of ``group_size``."""
    if method == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": group_size,
                "desc_act": False, "sym": sym, "checkpoint_format": "gptq" if v1 else "gptq_v2"}
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
            "version": "gemm"}
