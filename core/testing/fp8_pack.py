"""Writing fp8 checkpoints for tests (no hub access): a model's decoder projections rounded
to e4m3 by our own quantiser, in the layout ``core.loading.fp8_checkpoint`` reads (its
docstring describes it), with per-tensor or per-channel ``weight_scale`` tensors."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from ..quantize.pack import PROJECTIONS

#: ``scales=`` of ``write_fp8`` -> the shape of each weight_scale (n: the output rows)
SCALE_SHAPES = {"tensor": (), "tensor1": (1,), "channel": ("n",), "channel2d": ("n", 1)}


def quantize(weight: torch.Tensor, scales: str) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (q float8_e4m3fn [N, K], weight_scale of ``SCALE_SHAPES[scales]``),
    weight ~= q * weight_scale (one scale for the tensor, or one a row)."""
    from infergraft.kernels.fp8_linear import FP8_MAX, quantize_fp8

    n = weight.shape[0]
    shape = tuple(n if d == "n" else d for d in SCALE_SHAPES[scales])
    if scales.startswith("tensor"):
        amax = weight.float().abs().max()
        s = amax / FP8_MAX if amax > 0 else torch.ones(())
        q = (weight.float() / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return q, s.float().reshape(shape)
    q, s = quantize_fp8(weight)
    return q, s.reshape(shape)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 [N, K] weight of ``quantize``'s output."""
    s = scale.float().reshape(-1, 1) if scale.numel() > 1 else scale.float().reshape(())
    return q.float() * s


def write_fp8(hf_model, path, scales: str = "channel", activation_scheme: str = "dynamic",
              config_overrides: dict | None = None):
    """Write ``hf_model`` to ``path`` as an fp8 safetensors checkpoint (``scales``: a key of
    ``SCALE_SHAPES``; "static" also writes an ``input_scale`` per projection); returns a
    copy of ``hf_model`` whose projections hold the dequantised weights (the reference its
    build must match)."""
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
        q, s = quantize(t, scales)
        tensors[key], tensors[f"{module}.weight_scale"] = q.contiguous(), s.contiguous()
        if activation_scheme == "static":
            tensors[f"{module}.input_scale"] = torch.tensor(0.05)
        with torch.no_grad():
            ref.get_submodule(module).weight.copy_(dequantize(q, s))
    save_file(tensors, str(path / "model.safetensors"))
    config = hf_model.config.to_dict()
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": activation_scheme,
                                     "ignored_layers": ["lm_head"], **(config_overrides or {})}
    (path / "config.json").write_text(json.dumps(config, indent=2, default=str))
    return ref
