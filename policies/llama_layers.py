"""The LLaMA layers every family reuses, registered through ``infergraft_register_layers``
(core/layer.py): attention ``llama`` (one fused qkv projection, RoPE, GQA, o; GPT-2's
too, without RoPE), MLPs ``gated`` (SwiGLU over one fused gate_up projection) and
``plain`` (GPT-2's fc_in, GELU), norms ``rms`` and ``layer`` (with the residual add).

The attention and the gated MLP also run in the fused decode layer (steps of at most
``ops.fuse_max_rows`` rows, 16-bit weights, 8-bit rows or int4 groups): the norm's
statistic in the GEMM prologues (its weight folded into qkv / gate_up, or given as ``norm``
where int4 keeps it: ``DecoderLayer.input_norm``), SwiGLU and the residual adds inside the
GEMMs, RoPE and the K/V write in the qkv GEMM's epilogue (kernels/fused_linear.py). A
variant subclasses one of them and registers under a name of its own.
"""
from __future__ import annotations

import torch
from torch import nn

from infergraft.core.errors import UnsupportedModelError
from infergraft.core.hookspecs import hookimpl
from infergraft.core.layer import LayerImpl
from infergraft.core.runner.layers import Linear, gemm_operands, row_sum_sq
from infergraft.core.spec import split_qkv


class LlamaAttention:
    """qkv GEMM -> RoPE -> ``cache.attention`` (writes K/V, attends) -> o GEMM. Slots:
    ``qkv`` (q | k | v rows, and its bias where the spec has one), ``o``."""

    input_projection = "qkv"
    fuses = True
    #: RoPE and the K/V write may run in the qkv GEMM's epilogue (``ops.normed_qkv_rope``):
    #: a variant that changes q or k between the projection and RoPE sets it False
    rope_in_qkv_epilogue = True

    def __init__(self, layer, spec, ops):
        self.spec, self.ops = spec, ops
        layer.qkv = Linear(ops)
        layer.o = Linear(ops, _partials(layer, spec))  # o feeds an add+RMSNorm: split-K partials

    def fusable(self, layer) -> bool:
        return all(gemm_operands(m) is not None for m in (layer.qkv, layer.o))

    def forward(self, layer, x, layer_idx, positions, rope, cache, meta):
        attn = self.attend(layer, layer.qkv(x), layer_idx, positions, rope, cache, meta)  # [T, q]
        return layer.o(attn)  # [T, H] or partials [S, T, H]

    def forward_fused(self, layer, stream, sum_sq, layer_idx, positions, rope, cache, meta):
        """stream [T, H] and its sum of squares per row (partials [P, T]) -> (stream +
        attention, its sums [P, T])."""
        s, ops = self.spec, self.ops
        (wqkv, bqkv, sqkv), (wo, bo, so) = gemm_operands(layer.qkv), gemm_operands(layer.o)
        norm = layer.input_norm("attn_norm")  # {} where folded into qkv's weight
        slots_of = getattr(cache, "decode_kv_slots", None)  # third-party caches may lack it
        slots = None if rope is None or slots_of is None or not self.rope_in_qkv_epilogue \
            else slots_of(layer_idx, meta)
        if slots is not None:  # RoPE and the K/V write in the qkv GEMM's epilogue
            q = ops.normed_qkv_rope(stream, wqkv, bqkv, sum_sq, s.norm_eps, rope[0], rope[1],
                                    positions, s.num_heads, *slots, scale=sqkv,
                                    **norm)  # [T, Hq, D]
            attn = cache.attention(layer_idx, q, None, None, meta).reshape(-1, s.q_size)
        else:
            qkv = ops.normed_linear(stream, wqkv, bqkv, sum_sq, s.norm_eps, scale=sqkv,
                                    **norm)  # [T, q + 2kv]
            attn = self.attend(layer, qkv, layer_idx, positions, rope, cache, meta)  # [T, q]
        return add_to_stream(layer, attn, wo, bo, so, stream, True)  # [T, H], [P, T]

    def rotate_inputs(self, layer, q, k):
        """q [T, Hq, D], k [T, Hkv, D] as RoPE receives them: the projection's rows here;
        a variant's own transform (Qwen3's per-head norms) in its override."""
        return q, k

    def attend(self, layer, qkv, layer_idx, positions, rope, cache, meta):
        """qkv [T, q + 2kv] -> attention output [T, q] (the cache writes K/V, RoPE first)."""
        s = self.spec
        t = qkv.shape[0]
        q, k, v = split_qkv(qkv, s.num_heads, s.num_kv_heads, s.head_dim)
        q, k = self.rotate_inputs(layer, q, k)
        if rope is None:
            attn = cache.attention(layer_idx, q, k, v, meta)  # [T, Hq, D]
        elif getattr(cache, "fuses_rotary", False):  # the cache rotates q, k (with its K/V write)
            attn = cache.attention(layer_idx, q, k, v, meta, rope=(rope[0], rope[1], positions))
        else:
            q, k = self.ops.rotary(q, k, rope[0], rope[1], positions)
            attn = cache.attention(layer_idx, q, k, v, meta)
        return attn.reshape(t, s.q_size)


#: ModelSpec.activation values the gated MLP runs (act(gate) * up)
GATED_ACTIVATIONS = ("silu", "gelu_tanh", "gelu")


class GatedMLP:
    """gate_up GEMM -> act(gate) * up -> down GEMM, act the spec's ``activation``: SiLU
    (SwiGLU; it also runs in the fused decode layer) or GELU (Gemma's GeGLU, the tanh
    approximation or the erf form: the plain layer only). Slots: ``gate_up`` (gate | up
    rows), ``down``."""

    input_projection = "gate_up"
    #: gate_up's rows are two blocks (gate, up) whose row j meets down's column j through an
    #: elementwise product: an act order of down's columns can move into them
    #: (``core.loading.prequantized.fold_act_orders``)
    down_input_blocks = 2

    def __init__(self, layer, spec, ops):
        if spec.activation not in GATED_ACTIVATIONS:
            raise UnsupportedModelError(
                f"{spec.architecture}: the gated MLP runs activations "
                f"{', '.join(GATED_ACTIVATIONS)}, not {spec.activation!r}")
        self.spec, self.ops = spec, ops
        self.fuses = spec.activation == "silu"  # the fused GEMM's epilogue is SwiGLU's
        layer.gate_up = Linear(ops)
        layer.down = Linear(ops, _partials(layer, spec))  # down feeds the next add+RMSNorm

    def fusable(self, layer) -> bool:
        return all(gemm_operands(m) is not None for m in (layer.gate_up, layer.down))

    def forward(self, layer, x):
        gate_up = layer.gate_up(x)  # [T, 2I] -> [T, I] -> [T, H]
        if self.spec.activation == "silu":
            return layer.down(self.ops.silu_mul(gate_up))
        return layer.down(self.ops.gelu_mul(gate_up, self.spec.activation))

    def forward_fused(self, layer, stream, sum_sq, want_next: bool):
        """stream [T, H], its sums [P, T] -> (stream + MLP, its sums or None without
        ``want_next``)."""
        (wgu, bgu, sgu), (wd, bd, sd) = gemm_operands(layer.gate_up), gemm_operands(layer.down)
        act = self.ops.normed_swiglu(stream, wgu, bgu, sum_sq, self.spec.norm_eps, scale=sgu,
                                     **layer.input_norm("mlp_norm"))  # [T, I]
        return add_to_stream(layer, act, wd, bd, sd, stream, want_next)


class PlainMLP:
    """fc_in GEMM -> GELU (``spec.activation``) -> down GEMM (GPT-2). Slots: ``fc_in``,
    ``down``. The plain layer only."""

    input_projection = "fc_in"
    fuses = False
    down_input_blocks = 1  # fc_in's row j meets down's column j through GELU (as GatedMLP)

    def __init__(self, layer, spec, ops):
        self.spec, self.ops = spec, ops
        layer.fc_in = Linear(ops)
        layer.down = Linear(ops, _partials(layer, spec))

    def forward(self, layer, x):
        return layer.down(self.ops.gelu(layer.fc_in(x), self.spec.activation))


def _partials(layer, spec) -> bool:
    """Whether the layer's output projections may return split-K partials: the norm after
    them adds the partials up (``DecoderLayer.sums_partials``; a layer built outside the
    runner: the spec's norm is RMSNorm)."""
    return bool(getattr(layer, "sums_partials", spec.norm == "rms"))


def add_to_stream(layer, x, weight, bias, scale, stream, sum_sq: bool):
    """(stream + x W^T + b, its sum of squares per row or None). Under tp each rank's
    heads / columns give a share: summed over the group, the residual added once (by the
    group's rank 0, which holds the bias too), the statistic taken after the sum."""
    tp, ops = layer.tp, layer.ops
    if tp is None:
        out = ops.linear_residual(x, weight, bias, stream, sum_sq=sum_sq, scale=scale)
        return out if sum_sq else (out, None)  # [T, H] (, [P, T])
    base = stream if tp.rank == 0 else torch.zeros_like(stream)
    out = tp.all_reduce(ops.linear_residual(x, weight, bias, base, scale=scale))
    return out, (row_sum_sq(out) if sum_sq else None)  # [T, H], [1, T]


class Norm(nn.Module):
    """RMSNorm or LayerNorm, optionally fused with the residual add. ``unit_offset``: an
    RMSNorm scaling by 1 + weight in float32 (Gemma's; ``kernels/rms_norm.py``)."""

    def __init__(self, kind: str, eps: float, ops, unit_offset: bool = False):
        super().__init__()
        self.kind, self.eps, self.ops, self.unit_offset = kind, eps, ops, unit_offset
        self.register_buffer("weight", None)
        self.register_buffer("bias", None)

    @property
    def folds(self) -> bool:
        """A (LLaMA) RMSNorm: the fused decode layer takes its statistic in the next GEMM's
        prologue and its weight in that GEMM's columns."""
        return self.kind == "rms" and not self.unit_offset

    @property
    def adds_partials(self) -> bool:
        """An RMSNorm: with a residual it also takes x as split-K partials [S, T, H]."""
        return self.kind == "rms"

    def forward(self, x, residual=None):
        """Returns (normed, new residual); the residual is x (+ residual)."""
        if self.kind == "rms":
            offset = {"unit_offset": True} if self.unit_offset else {}
            if residual is None:
                return self.ops.rms_norm(x, self.weight, self.eps, **offset), x
            return self.ops.add_rms_norm(x, residual, self.weight, self.eps, **offset)
        if residual is None:
            return self.ops.layer_norm(x, self.weight, self.bias, self.eps), x
        return self.ops.add_layer_norm(x, residual, self.weight, self.bias, self.eps)


LAYERS = (
    LayerImpl("attention", "llama", LlamaAttention,
              "fused qkv, RoPE (where the spec has it), GQA, o"),
    LayerImpl("mlp", "gated", GatedMLP, "SwiGLU over a fused gate_up, down"),
    LayerImpl("mlp", "plain", PlainMLP, "fc_in, GELU, down (GPT-2)"),
    LayerImpl("norm", "rms", lambda spec, ops: Norm("rms", spec.norm_eps, ops), "RMSNorm"),
    LayerImpl("norm", "layer", lambda spec, ops: Norm("layer", spec.norm_eps, ops),
              "LayerNorm with bias"),
)


@hookimpl
def infergraft_register_layers(register):
    for impl in LAYERS:
        register(impl)
