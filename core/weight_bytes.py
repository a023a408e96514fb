"""The bytes a model's weights take, from its spec alone: all of them (packed where a
weight quantiser packs them, with the dense copies it keeps where its own matmul is the
slower: ``Quantizer.dense_on``), and, for a mixture of experts, the active ones a token
runs through (what a batch-1 decode step reads)."""
from __future__ import annotations

import math
from typing import Optional

import torch

from .units import element_bytes


def weight_bytes(spec, dtype: torch.dtype, weight_quantizer=None, device=None,
                 kernels: Optional[str] = None) -> int:
    """Bytes of all the model's weights (the quantised slots packed when quantised; on
    ``device`` with ``kernels``, with the dequantised copies the quantiser keeps there:
    ``Quantizer.dense_on``)."""
    if weight_quantizer is not None:
        return weight_quantizer.weight_bytes(spec, element_bytes(dtype), device, kernels)
    return spec.param_count * element_bytes(dtype)


def step_read_bytes(spec, dtype: torch.dtype, weight_quantizer, device,
                    kernels: Optional[str]) -> Optional[int]:
    """Bytes of weights a decode step reads where that differs from what is held: where the
    quantiser keeps dequantised copies (``Quantizer.dense_on``) the GEMMs read those, in the
    model's dtype, not the packed forms beside them: every weight as if unquantised. None
    where the step reads all that is held."""
    q = weight_quantizer
    if q is None or device is None or not q.dense_on(torch.device(device), kernels):
        return None
    return spec.param_count * element_bytes(dtype)


def active_weight_bytes(spec, dtype: torch.dtype, weight_quantizer=None) -> int:
    """``weight_bytes`` less, in each mixture-of-experts layer, the experts a token does
    not route to (all but ``top_k``): the bytes of the active parameters, which a
    batch-1 decode step reads (of the embeddings, one row). Equal to ``weight_bytes``
    without experts."""
    from .slots import slot_layout

    e, layout, idle = element_bytes(dtype), slot_layout(spec), 0
    for i in range(spec.num_layers):
        x = spec.layer(i).experts
        for slot in () if x is None else (f"layers.{i}.experts_gate_up.weight",
                                          f"layers.{i}.experts_down.weight"):
            shape = layout[slot][0]
            quantized = weight_quantizer is not None and weight_quantizer.quantizes(slot)
            size = weight_quantizer.packed_bytes_of(shape, e) if quantized \
                else math.prod(shape) * e
            idle += size * (x.num_experts - x.top_k) // x.num_experts
    return weight_bytes(spec, dtype, weight_quantizer) - idle


def expert_counts(spec, dtype, weight_quantizer) -> dict:
    """MemoryPlan's fields of a mixture of experts (none without experts)."""
    if not getattr(spec, "has_experts", False):
        return {}
    kinds = sorted({(x.experts.top_k, x.experts.num_experts) for x in spec.layers if x.experts})
    return dict(param_count=spec.param_count, active_param_count=spec.active_param_count,
                active_weight_bytes=active_weight_bytes(spec, dtype, weight_quantizer),
                experts=", ".join(f"top-{k} of {e}" for k, e in kinds) + " experts a layer")
