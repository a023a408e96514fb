"""Slot names and shapes of the fused module tree (``slot_layout``: what policies' weight
maps fill and planners cut), and norm weights folded into projections."""
from __future__ import annotations

import torch

from .spec import ModelSpec


def folded(weight: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
    """W g: a norm weight g [K] moved into the columns of W [N, K]. A new tensor, never in
    place (loaded weights may share the caller's storage); a 16-bit product rounds once,
    like the float32 one cast back (no float32 copy)."""
    return weight * norm_weight.to(weight.dtype)[None, :]


def expert_slots(experts, hidden: int) -> dict:
    """The slots of a mixture-of-experts layer (``core.spec.ExpertSpec``): the router
    [E, H], and the experts' projections stacked as one matrix each, an expert's rows after
    another's, so that a checkpoint's per-expert tensors fill them part by part (and tensor
    parallelism cuts every part, as it cuts gate_up's): ``experts_gate_up`` [E * 2I, H]
    (parts gate_0, up_0, gate_1, ...: I rows each), ``experts_down`` [E * H, I] (parts:
    H rows an expert)."""
    e, i, h = experts.num_experts, experts.intermediate_size, hidden
    return {"router.weight": ((e, h), None),
            "experts_gate_up.weight": ((e * 2 * i, h), (i,) * (2 * e)),
            "experts_down.weight": ((e * h, i), (h,) * e)}


def slot_layout(spec: ModelSpec) -> dict[str, tuple[tuple[int, ...], tuple[int, ...] | None]]:
    """slot -> (shape, sizes of its fused parts along dim 0, or None if unfused)."""
    h, i, q, kv = spec.hidden_size, spec.intermediate_size, spec.q_size, spec.kv_size
    layer_norm = spec.norm == "layer"
    out = {"embed.weight": ((spec.vocab_size, h), None)}
    if spec.position == "learned":
        out["pos_embed.weight"] = ((spec.max_position, h), None)
    for n in range(spec.num_layers):
        p = f"layers.{n}."
        post = ("attn_post_norm", "mlp_post_norm") if spec.layer(n).post_norms else ()
        for norm in ("attn_norm", "mlp_norm") + post:
            out[p + norm + ".weight"] = ((h,), None)
            if layer_norm:
                out[p + norm + ".bias"] = ((h,), None)
        out[p + "qkv.weight"] = ((q + 2 * kv, h), (q, kv, kv))
        if spec.qkv_bias:
            out[p + "qkv.bias"] = ((q + 2 * kv,), (q, kv, kv))
        out[p + "o.weight"] = ((h, q), None)
        if spec.o_bias:
            out[p + "o.bias"] = ((h,), None)
        layer = spec.layer(n)
        if layer.experts is not None:  # a mixture of experts in place of the dense MLP
            out.update({p + name: slot for name, slot in expert_slots(layer.experts, h).items()})
        elif spec.gated_mlp:
            out[p + "gate_up.weight"] = ((2 * i, h), (i, i))
            if spec.mlp_bias:
                out[p + "gate_up.bias"] = ((2 * i,), (i, i))
        else:
            out[p + "fc_in.weight"] = ((i, h), None)
            if spec.mlp_bias:
                out[p + "fc_in.bias"] = ((i,), None)
        if layer.experts is None:
            out[p + "down.weight"] = ((h, i), None)
            if spec.mlp_bias:
                out[p + "down.bias"] = ((h,), None)
        for name, shape in layer.slots:  # what the layer's own parts add
            out[p + name] = (shape, None)
    out["final_norm.weight"] = ((h,), None)
    if layer_norm:
        out["final_norm.bias"] = ((h,), None)
    if not spec.tie_embeddings:
        out["lm_head.weight"] = ((spec.vocab_size, h), None)
    return out
