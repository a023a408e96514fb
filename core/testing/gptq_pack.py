"""Writing GPTQ- and AWQ-format checkpoints for tests (no hub access): a model's decoder
projections quantised by our own round to nearest, packed in the public layouts that
``core.loading.gptq`` reads (its docstring describes them)."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from ..loading.gptq import AWQ_ORDER, SHIFTS

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def rtn_int4(weight: torch.Tensor, group_size: int, sym: bool = False, min_zero: int = 0):
    """weight [N, K] -> (q uint8 [N, K], zeros uint8 [N, G], scales float16 [N, G]),
    weight ~= (q - zero) * scale per row and group of ``group_size`` columns. ``sym``: zero
    8 (GPTQ's symmetric); ``min_zero`` 1 keeps GPTQ v1's zero - 1 representable."""
    n, k = weight.shape
    groups = -(-k // group_size)
    w = torch.nn.functional.pad(weight.float(), (0, groups * group_size - k))
    w = w.reshape(n, groups, group_size)
    if sym:
        scale = (w.abs().amax(dim=2) / 7).clamp(min=1e-8).half().float()
        zero = torch.full_like(scale, 8)
    else:
        lo, hi = w.amin(dim=2).clamp(max=0), w.amax(dim=2).clamp(min=0)
        scale = ((hi - lo) / 15).clamp(min=1e-8).half().float()
        zero = torch.round(-lo / scale).clamp(min_zero, 15)
    q = (torch.round(w / scale[..., None]) + zero[..., None]).clamp(0, 15)
    q = q.reshape(n, -1)[:, :k]
    return q.to(torch.uint8), zero.to(torch.uint8), scale.half()


def dequantize(q, zeros, scales, group_size: int) -> torch.Tensor:
    """The float32 [N, K] weight of ``rtn_int4``'s output."""
    cols = torch.arange(q.shape[1]) // group_size
    return (q.float() - zeros.float()[:, cols]) * scales.float()[:, cols]


def pack_int32(nibbles: torch.Tensor) -> torch.Tensor:
    """uint8 [R, C, 8] of values 0..15 -> int32 [R, C], nibble i in bits 4i..4i+3."""
    out = torch.zeros(nibbles.shape[:2], dtype=torch.int64)
    for i, shift in enumerate(SHIFTS):
        out |= (nibbles[..., i].long() & 0xF) << shift
    return torch.where(out >= 2 ** 31, out - 2 ** 32, out).to(torch.int32)  # as int32 bits


def pack_gptq(q, zeros, scales, group_size: int, v1: bool = True) -> dict:
    """GPTQ tensors of one projection (v1: zero - 1 stored, masked to a nibble)."""
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
    if method == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": group_size,
                "desc_act": False, "sym": sym, "checkpoint_format": "gptq" if v1 else "gptq_v2"}
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
            "version": "gemm"}


def write_quantized(hf_model, path, method: str, group_size: int = 32, sym: bool = False,
                    v1: bool = True, config_overrides: dict | None = None):
    """Write ``hf_model`` to ``path`` as a ``method`` ("gptq" / "awq") safetensors
    checkpoint; returns a copy of ``hf_model`` whose projections hold the dequantised
    weights (the reference its build must match)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    ref = copy.deepcopy(hf_model)
    tensors = {}
    for key, t in hf_model.state_dict().items():
        module, _, leaf = key.rpartition(".")
        if leaf != "weight" or module.rpartition(".")[2] not in PROJECTIONS:
            tensors[key] = t.contiguous()
            continue
        q, zeros, scales = rtn_int4(t, group_size, sym=sym and method == "gptq",
                                    min_zero=1 if method == "gptq" and v1 else 0)
        parts = pack_gptq(q, zeros, scales, group_size, v1) if method == "gptq" else \
            pack_awq(q, zeros, scales)
        tensors.update({f"{module}.{p}": v for p, v in parts.items()})
        with torch.no_grad():
            ref.get_submodule(module).weight.copy_(dequantize(q, zeros, scales, group_size))
    save_file(tensors, str(path / "model.safetensors"))
    config = hf_model.config.to_dict()
    config["quantization_config"] = {**quantization_config(method, group_size, sym, v1),
                                     **(config_overrides or {})}
    (path / "config.json").write_text(json.dumps(config, indent=2, default=str))
    return ref
