"""GPTQ over a whole model, layer by layer: the calibration batch runs through an HF
LLaMA-family model (``LlamaForCausalLM``, ``MistralForCausalLM``) whose earlier
projections are already replaced by their dequantised 4-bit weights, so each projection
is quantised against the inputs the quantised model will really feed it.

Inside a layer the projections go in four stages ("true sequential"), each stage's inputs
computed with the stages before it already quantised: q, k, v (the attention norm's
output) -> o (the attention's output) -> gate, up (the MLP norm's output) -> down (SiLU(gate)
* up). Each stage's projections share their inputs, hence one Hessian, and are quantised as
one matrix (GPTQ treats rows independently). A layer's matmuls run once, with the
quantised weights: the stages compute the layer's forward piece by piece
(``run_layer``, which relies on the LLaMA layer: h = x + attn(norm1(x)), out = h +
mlp(norm2(h))).
"""
from __future__ import annotations

from typing import Callable

import torch

from .gptq import Hessian, gptq_quantize
from .pack import dequantize

#: the projections of one stage, in order (module names under a decoder layer)
STAGES = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          ("self_attn.o_proj",),
          ("mlp.gate_proj", "mlp.up_proj"),
          ("mlp.down_proj",))


class _Stop(Exception):
    """Raised by the hook that catches the first layer's inputs."""


def first_layer_inputs(hf, ids: torch.Tensor, batch_size: int) -> list[tuple]:
    """Per batch of ``batch_size`` calibration sequences (ids [n, S]): (the hidden states
    entering layer 0 [b, S, H], the keyword arguments the model gives its layers:
    position embeddings, attention mask, ...). The model stops at layer 0."""
    caught = []

    def catch(module, args, kwargs):
        kwargs = dict(kwargs)
        x = args[0] if args else kwargs.pop("hidden_states")
        caught.append((x, kwargs))
        raise _Stop

    handle = hf.model.layers[0].register_forward_pre_hook(catch, with_kwargs=True)
    try:
        for batch in ids.split(batch_size):
            try:
                hf.model(input_ids=batch, use_cache=False)
            except _Stop:
                pass
    finally:
        handle.remove()
    return caught


def run_layer(layer, batches: list[tuple], quantize: Callable) -> list[tuple]:
    """One decoder layer over every batch (x [b, S, H], layer kwargs), stage by stage:
    ``quantize(names, inputs)`` gets each stage's projection names and inputs (one
    [b, S, K] a batch) and may change those projections' weights before the stage's
    output is computed with them. Returns the layer's outputs with their kwargs."""
    attn, mlp = layer.self_attn, layer.mlp
    xs = [x for x, _ in batches]
    # 1) q, k, v read the attention norm's output.
    quantize(STAGES[0], [layer.input_layernorm(x) for x in xs])
    # 2) o reads the attention's output: the attention run with o_proj taken out.
    o_proj = attn.o_proj
    attn.o_proj = torch.nn.Identity()
    try:
        heads = [attn(hidden_states=layer.input_layernorm(x), **kw)[0]  # [b, S, heads * D]
                 for x, kw in batches]
    finally:
        attn.o_proj = o_proj
    quantize(STAGES[1], heads)
    mids = [x + o_proj(a) for x, a in zip(xs, heads)]  # [b, S, H]
    del heads
    # 3) gate and up read the MLP norm's output; 4) down reads SiLU(gate) * up.
    normed = [layer.post_attention_layernorm(m) for m in mids]
    quantize(STAGES[2], normed)
    acts = [mlp.act_fn(mlp.gate_proj(h)) * mlp.up_proj(h) for h in normed]  # [b, S, I]
    del normed
    quantize(STAGES[3], acts)
    return [(m + mlp.down_proj(a), kw) for m, a, (_, kw) in zip(mids, acts, batches)]


def gptq_model(hf, ids: torch.Tensor, group_size: int, min_zero: int = 0,
               act_order: bool = False, batch_size: int = 8,
               progress: bool = False) -> dict[str, tuple]:
    """Quantise every decoder projection of ``hf`` (its weights replaced by their
    dequantised codes as it goes) on calibration ``ids`` [n, S] (``act_order``: as
    ``gptq.gptq_quantize`` takes it). Returns
    {"model.layers.i.self_attn.q_proj": (q, zeros, scales), ...} (``pack.rtn_int4``'s
    shapes)."""
    from tqdm.auto import tqdm

    codes: dict[str, tuple] = {}
    with torch.no_grad():
        batches = first_layer_inputs(hf, ids, batch_size)
        layers = hf.model.layers
        for index, layer in enumerate(tqdm(layers, desc="GPTQ", unit="layer",
                                           disable=not progress)):
            def quantize(names, inputs, index=index, layer=layer):
                hessian = Hessian(inputs[0].shape[-1])
                for x in inputs:
                    hessian.add(x)
                mods = [layer.get_submodule(n) for n in names]
                w = torch.cat([m.weight for m in mods])  # [sum N, K]
                q, zeros, scales = gptq_quantize(w, hessian.value(), group_size, min_zero,
                                                 act_order=act_order)
                deq = dequantize(q, zeros, scales, group_size)
                row = 0
                for name, m in zip(names, mods):
                    rows = slice(row, row + m.weight.shape[0])
                    codes[f"model.layers.{index}.{name}"] = (q[rows], zeros[rows], scales[rows])
                    m.weight.copy_(deq[rows])
                    row = rows.stop

            batches = run_layer(layer, batches, quantize)
    return codes
