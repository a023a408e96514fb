"""Writing GPTQ- and AWQ-format checkpoints for tests (no hub access): a model's decoder
projections quantised by our own round to nearest, packed in the public layouts that
``core.loading.gptq`` reads (its docstring describes them). The codes and the packing live
in ``core.quantize.pack`` (the ``quantize`` tool writes through them too); their names stay
importable from here."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from ..quantize.pack import (PROJECTIONS, dequantize, pack_awq, pack_gptq,  # noqa: F401
                             pack_int32, quantization_config, rtn_int4)


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
