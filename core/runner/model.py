"""Our own small module tree of fused layers, built from a ModelSpec.

Slot names (``layers.3.qkv.weight``) are what policies' weight maps point at; weights
arrive later through ``core.weights.load_weights``. Hot path shapes: T = tokens in the
step (all sequences concatenated), H = hidden, D = head_dim.
"""
from __future__ import annotations

import inspect
import types

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed.vocab import VocabParallel
from ..rope import rope_cos_sin
from ..slots import folded, slot_layout  # noqa: F401  (slot_layout: imported from here too)
from ..spec import ModelSpec, split_qkv

# the weight streamer of a model whose layers all stay on the device: nothing to copy
_RESIDENT = types.SimpleNamespace(begin=lambda: None, before=lambda i: None, after=lambda i: None)


class Linear(nn.Module):
    """y = x W^T + b (skinny Triton GEMM at decode on CUDA). Quantisers replace the module.
    ``partials``: the output feeds an add+RMSNorm, so it may come as split-K float32
    partial sums [S, T, N] that the norm adds up (kernels/linear.py)."""

    def __init__(self, ops, partials: bool = False):
        super().__init__()
        self.linear = ops.linear_partials if partials else ops.linear
        self.register_buffer("weight", None)
        self.register_buffer("bias", None)

    def forward(self, x):
        return self.linear(x, self.weight, self.bias)


class QuantizedLinear(nn.Module):
    """y = quantizer.matmul(x, packed) (+ b): a weight quantiser's packed projection
    (core/quant.py); ``core.build`` swaps it in for a ``Linear`` as the weight loads."""

    def __init__(self, quantizer, packed, bias, ops):
        super().__init__()
        self.quantizer, self.packed = quantizer, packed
        self._kw = {"ops": ops} if "ops" in inspect.signature(quantizer.matmul).parameters else {}
        self.register_buffer("bias", bias)

    def forward(self, x):
        y = self.quantizer.matmul(x, self.packed, **self._kw)  # [T, K] -> [T, N]
        return y if self.bias is None else y + self.bias

    def scaled_rows(self):
        """(q [N, K] int8 or float8_e4m3fn, scale float32 [N]) when the quantiser packs that
        form (the fused decode GEMMs read it: ``Quantizer.scaled_rows``), else None."""
        return self.quantizer.scaled_rows(self.packed)


def gemm_operands(lin):
    """(weight, bias, scale) of a projection for the fused decode GEMMs: a Linear's weight
    (scale None), or a quantised one's 8-bit rows and their scales; None if neither."""
    if type(lin) is Linear:
        return lin.weight, lin.bias, None
    rows = lin.scaled_rows() if isinstance(lin, QuantizedLinear) else None
    return None if rows is None else (rows[0], lin.bias, rows[1])


class Norm(nn.Module):
    """RMSNorm or LayerNorm, optionally fused with the residual add."""

    def __init__(self, kind: str, eps: float, ops):
        super().__init__()
        self.kind, self.eps, self.ops = kind, eps, ops
        self.register_buffer("weight", None)
        self.register_buffer("bias", None)

    def forward(self, x, residual=None):
        """Returns (normed, new residual); the residual is x (+ residual)."""
        if self.kind == "rms":
            if residual is None:
                return self.ops.rms_norm(x, self.weight, self.eps), x
            return self.ops.add_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return self.ops.layer_norm(x, self.weight, self.bias, self.eps), x
        return self.ops.add_layer_norm(x, residual, self.weight, self.bias, self.eps)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, ops):
        super().__init__()
        self.spec, self.ops = spec, ops
        self.attn_norm = Norm(spec.norm, spec.norm_eps, ops)
        partials = spec.norm == "rms"  # o and down feed an add+RMSNorm
        self.qkv = Linear(ops)
        self.o = Linear(ops, partials)
        self.mlp_norm = Norm(spec.norm, spec.norm_eps, ops)
        if spec.gated_mlp:
            self.gate_up = Linear(ops)
        else:
            self.fc_in = Linear(ops)
        self.down = Linear(ops, partials)

    def fusable(self) -> bool:
        """RMSNorm + SwiGLU, every projection our own Linear or 8-bit rows (other quantised
        forms have their own forward), and norms the fused layer can drop: a Linear
        takes them at ``fold_norm_weights``, packed weights only before packing
        (``core.quant.SlotPacker``). The shape ``forward_fused`` knows."""
        s = self.spec
        return s.norm == "rms" and s.gated_mlp and all(
            gemm_operands(m) is not None for m in (self.qkv, self.o, self.gate_up, self.down)) \
            and all(n in self.folded_norms or type(getattr(self, p)) is Linear
                    for n, p in self.NORM_FEEDS)

    NORM_FEEDS = (("attn_norm", "qkv"), ("mlp_norm", "gate_up"))
    tp = None  # core.parallel.TensorParallelGroup: o and down outputs summed over ranks
    folded_norms = frozenset()  # norms whose weights already live in their projection

    @torch.no_grad()
    def fold_norm_weights(self) -> None:
        """rms_norm(x, g) W^T == rms_norm(x, 1) (W g)^T: the norm weights move into the
        qkv and gate_up columns, so the fused layer runs no norm kernel (the plain
        layer's norms then multiply by ones)."""
        for name, proj in self.NORM_FEEDS:
            if name not in self.folded_norms:
                lin = getattr(self, proj)
                lin.weight = folded(lin.weight, getattr(self, name).weight)
                self.mark_norm_folded(name)

    def mark_norm_folded(self, name: str) -> None:
        """Norm ``name``'s weight now lives in the projection it feeds: it multiplies by ones."""
        norm = getattr(self, name)
        norm.weight = torch.ones_like(norm.weight)
        self.folded_norms = self.folded_norms | {name}

    def forward_fused(self, stream, layer_idx, positions, rope, cache, meta, sum_sq,
                      want_next: bool):
        """The layer at few tokens, norms folded into the GEMMs, SwiGLU and the residual
        adds inside them (kernels/fused_linear.py): stream [T, H] (the residual stream)
        and its sum of squares per row (partials [P, T]) -> (the next stream, its sums
        or None without ``want_next``)."""
        s, ops = self.spec, self.ops
        (wqkv, bqkv, sqkv), (wo, bo, so), (wgu, bgu, sgu), (wd, bd, sd) = (
            gemm_operands(m) for m in (self.qkv, self.o, self.gate_up, self.down))
        slots_of = getattr(cache, "decode_kv_slots", None)  # third-party caches may lack it
        slots = None if rope is None or slots_of is None else slots_of(layer_idx, meta)
        if slots is not None:  # RoPE and the K/V write in the qkv GEMM's epilogue
            q = ops.normed_qkv_rope(stream, wqkv, bqkv, sum_sq, s.norm_eps, rope[0], rope[1],
                                    positions, s.num_heads, *slots, scale=sqkv)  # [T, Hq, D]
            attn = cache.attention(layer_idx, q, None, None, meta).reshape(-1, s.q_size)
        else:
            qkv = ops.normed_linear(stream, wqkv, bqkv, sum_sq, s.norm_eps,
                                    scale=sqkv)  # [T, q + 2kv]
            attn = self._attend(qkv, layer_idx, positions, rope, cache, meta)  # [T, q]
        stream, sum_sq = ops.linear_residual(attn, wo, bo, stream, sum_sq=True,
                                             scale=so)  # [T, H], [P, T]
        act = ops.normed_swiglu(stream, wgu, bgu, sum_sq, s.norm_eps, scale=sgu)  # [T, I]
        out = ops.linear_residual(act, wd, bd, stream, sum_sq=want_next, scale=sd)
        return out if want_next else (out, None)

    def forward(self, h, residual, layer_idx, positions, rope, cache, meta):
        x, residual = self.attn_norm(h, residual)  # [T, H]
        attn = self._attend(self.qkv(x), layer_idx, positions, rope, cache, meta)  # [T, q]
        h = self.o(attn)  # [T, H] or partials [S, T, H]
        if self.tp is not None:  # each rank's heads contributed a share of o's output
            h = self.tp.all_reduce(h)
        x, residual = self.mlp_norm(h, residual)
        if self.spec.gated_mlp:
            x = self.ops.silu_mul(self.gate_up(x))  # [T, 2I] -> [T, I]
        else:
            x = self.ops.gelu(self.fc_in(x), self.spec.activation)
        out = self.down(x)  # [T, H] or partials [S, T, H]
        return (out if self.tp is None else self.tp.all_reduce(out)), residual

    def _attend(self, qkv, layer_idx, positions, rope, cache, meta):
        """qkv [T, q + 2kv] -> attention output [T, q] (the cache writes K/V, RoPE first)."""
        s = self.spec
        t = qkv.shape[0]
        q, k, v = split_qkv(qkv, s.num_heads, s.num_kv_heads, s.head_dim)
        if rope is None:
            attn = cache.attention(layer_idx, q, k, v, meta)  # [T, Hq, D]
        elif getattr(cache, "fuses_rotary", False):  # the cache rotates q, k (with its K/V write)
            attn = cache.attention(layer_idx, q, k, v, meta, rope=(rope[0], rope[1], positions))
        else:
            q, k = self.ops.rotary(q, k, rope[0], rope[1], positions)
            attn = cache.attention(layer_idx, q, k, v, meta)
        return attn.reshape(t, s.q_size)


class DecoderModel(nn.Module):
    def __init__(self, spec: ModelSpec, ops, device, max_position: int | None = None,
                 tp=None, stage=None):
        """``spec``: what this process runs: one rank's share under ``tp`` (a
        ``core.parallel.TensorParallelGroup``), one stage's layers under ``stage`` (a
        ``core.stages.PipelineStage``: the stream comes from and goes to its neighbours)."""
        super().__init__()
        self.spec, self.ops, self.tp, self.stage = spec, ops, tp, stage
        # tp: the embeddings and head hold this rank's rows of the vocab (spec: the whole's)
        self.vocab = None if tp is None else VocabParallel(spec.vocab_size, tp)
        from infergraft.kernels.paged_plan import CounterPool  # not at import: it imports triton

        self.counters = CounterPool()  # this engine's own: engines on other streams share none
        self.embed = nn.Module()
        self.embed.register_buffer("weight", None)
        if spec.position == "learned":
            self.pos_embed = nn.Module()
            self.pos_embed.register_buffer("weight", None)
        self.layers = nn.ModuleList(DecoderLayer(spec, ops) for _ in range(spec.num_layers))
        for layer in self.layers:
            layer.tp = tp
        self.final_norm = Norm(spec.norm, spec.norm_eps, ops)
        if not spec.tie_embeddings:
            self.lm_head = Linear(ops)
        self.norms_folded = False  # fold_norm_weights() turns the fused decode layer on
        self.streamer = None  # runner.weight_stream.WeightStreamer: layers in host memory
        self.rope = None
        if spec.position == "rope":
            self.rope = rope_cos_sin(spec.rope, spec.head_dim, max_position or spec.max_position,
                                     device)

    def _fused(self, tokens: int) -> bool:
        return self.norms_folded and tokens <= getattr(self.ops, "fuse_max_rows", 0)

    def will_fuse(self, dtype) -> bool:
        """Whether the fused decode layer can run for this spec, ops and weight dtype
        (known before any weight loads): RMSNorm + SwiGLU, ops that fuse, 16-bit weights
        (float32 GEMMs stay on cuBLAS: the plain layer is the fast one)."""
        s = self.spec  # (the fused layer adds the residual inside o / down: no all-reduce)
        return s.norm == "rms" and s.gated_mlp and bool(getattr(self.ops, "fuse_max_rows", 0)) \
            and dtype in (torch.float16, torch.bfloat16) and self.tp is None and self.stage is None

    def fold_norm_weights(self) -> bool:
        """Move each layer's norm weights into its GEMMs (after the weights are loaded)
        where the ops fuse and every layer can: the fused decode layer then runs. Returns
        whether it did."""
        if self.norms_folded or not self.will_fuse(self.dtype) or not all(
                layer.fusable() for layer in self.layers):
            return self.norms_folded
        for layer in self.layers:
            layer.fold_norm_weights()
        self.norms_folded = True
        return True

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype (every stage holds a layer; not every one the embeddings)."""
        return self.layers[0].attn_norm.weight.dtype

    @property
    def lm_head_weight(self):
        return self.embed.weight if self.spec.tie_embeddings else self.lm_head.weight

    def forward(self, tokens, cache, meta, logits_index=None, greedy_out=None):
        """tokens: [T] -> logits [len(logits_index) or T, V] float32 (None on a pipeline
        stage before the last, and under tp on every rank but the group's first).
        ``greedy_out``: an int64 buffer [n] that receives each row's argmax (the decode
        graphs' next tokens, written in the same kernel that widens the logits)."""
        positions = meta.positions
        fused = self._fused(tokens.shape[0])
        residual, stage = None, self.stage
        streamer = self.streamer or _RESIDENT  # copies streamed layers in, layer by layer
        streamer.begin()  # the first ones' copies start while the resident layers run
        if stage is not None and not stage.first:  # the previous stage's stream: [T, H] x 2
            h, residual = stage.recv(tokens.shape[0], self.spec.hidden_size, self.dtype,
                                     tokens.device)
        elif fused and self.spec.position != "learned":  # one kernel: rows and their statistic
            h, sum_sq = self.ops.embed_sum_sq(tokens, self.embed.weight)  # [T, H], [1, T]
        else:
            # tp: each rank's rows, summed over the group
            h = F.embedding(tokens, self.embed.weight) if self.vocab is None \
                else self.vocab.embed(tokens, self.embed.weight)  # [T, H]
            if self.spec.position == "learned":
                h = h + F.embedding(positions, self.pos_embed.weight)
            sum_sq = h.float().square().sum(-1)[None] if fused else None
        if fused:  # h is the residual stream throughout; sum_sq: the next norm's statistic
            last = len(self.layers) - 1
            for i, layer in enumerate(self.layers):
                streamer.before(i)
                h, sum_sq = layer.forward_fused(h, i, positions, self.rope, cache, meta, sum_sq,
                                                want_next=i < last)
                streamer.after(i)
        else:
            for i, layer in enumerate(self.layers):
                streamer.before(i)
                h, residual = layer(h, residual, i, positions, self.rope, cache, meta)
                streamer.after(i)
        if stage is not None and not stage.last:
            stage.send(h, residual)
            return None  # the last stage has the logits
        if logits_index is not None:  # only the rows we sample from
            h = h[..., logits_index, :]
            residual = None if residual is None else residual[logits_index]
        x, _ = self.final_norm(h, residual)
        y = self.ops.lm_head(x, self.lm_head_weight)  # [n, V] (tp: [n, V_pad / tp]), model dtype
        if self.vocab is not None:  # gathered to the group's rank 0, which samples: else None
            return self.vocab.logits(y, greedy_out)  # [n, V] float32
        if greedy_out is None:
            return y.float()
        # float32 [n, V]; argmax -> greedy_out (split rows merge on this model's counters)
        return self.ops.logits_argmax(y, greedy_out, counters=self.counters)
