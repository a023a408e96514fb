"""Our own small module tree of fused layers, built from a ModelSpec.

Slot names (``layers.3.qkv.weight``) are what policies' weight maps point at; weights
arrive later through ``core.loading.weights.load_weights``. Hot path shapes: T = tokens in the
step (all sequences concatenated), H = hidden, D = head_dim.
"""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed.vocab import VocabParallel
from ..rope import rope_cos_sin
from ..slots import folded, slot_layout  # noqa: F401  (slot_layout: imported from here too)
from ..spec import ModelSpec, split_qkv
# (Linear, QuantizedLinear, gemm_operands: imported from here too)
from .layers import Linear, Norm, QuantizedLinear, gemm_operands, row_sum_sq  # noqa: F401

# the weight streamer of a model whose layers all stay on the device: nothing to copy
_RESIDENT = types.SimpleNamespace(begin=lambda: None, before=lambda i: None, after=lambda i: None)


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
        (``core.loading.packing.SlotPacker``). The shape ``forward_fused`` knows."""
        s = self.spec
        return s.norm == "rms" and s.gated_mlp and all(
            gemm_operands(m) is not None for m in (self.qkv, self.o, self.gate_up, self.down)) \
            and all(n in self.folded_norms or type(getattr(self, p)) is Linear
                    for n, p in self.NORM_FEEDS)

    NORM_FEEDS = (("attn_norm", "qkv"), ("mlp_norm", "gate_up"))
    # core.distributed.collectives.TensorParallelGroup: o and down outputs summed over ranks
    tp = None
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
        stream, sum_sq = self._add_to_stream(attn, wo, bo, so, stream, True)  # [T, H], [P, T]
        act = ops.normed_swiglu(stream, wgu, bgu, sum_sq, s.norm_eps, scale=sgu)  # [T, I]
        return self._add_to_stream(act, wd, bd, sd, stream, want_next)

    def _add_to_stream(self, x, weight, bias, scale, stream, sum_sq: bool):
        """(stream + x W^T + b, its sum of squares per row or None). Under tp each rank's
        heads / columns give a share: summed over the group, the residual added once (by
        the group's rank 0, which holds the bias too), the statistic taken after the sum."""
        if self.tp is None:
            out = self.ops.linear_residual(x, weight, bias, stream, sum_sq=sum_sq, scale=scale)
            return out if sum_sq else (out, None)  # [T, H] (, [P, T])
        base = stream if self.tp.rank == 0 else torch.zeros_like(stream)
        out = self.tp.all_reduce(self.ops.linear_residual(x, weight, bias, base, scale=scale))
        return out, (row_sum_sq(out) if sum_sq else None)  # [T, H], [1, T]

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
        ``core.distributed.collectives.TensorParallelGroup``), one stage's layers under
        ``stage`` (a ``core.distributed.stages.PipelineStage``: the stream comes from and goes
        to its neighbours)."""
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
        s = self.spec  # (tp: the residual joins o's and down's shares on the group's rank 0)
        return s.norm == "rms" and s.gated_mlp and bool(getattr(self.ops, "fuse_max_rows", 0)) \
            and dtype in (torch.float16, torch.bfloat16)

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
            if fused:  # the fused layer's stream is whole: their sum, and its statistic
                h, residual = h + residual, None
                sum_sq = row_sum_sq(h)  # [1, T]
        elif fused and self.spec.position != "learned" and self.vocab is None:
            # one kernel: the rows and their statistic
            h, sum_sq = self.ops.embed_sum_sq(tokens, self.embed.weight)  # [T, H], [1, T]
        else:
            # tp: each rank's rows, summed over the group
            h = F.embedding(tokens, self.embed.weight) if self.vocab is None \
                else self.vocab.embed(tokens, self.embed.weight)  # [T, H]
            if self.spec.position == "learned":
                h = h + F.embedding(positions, self.pos_embed.weight)
            sum_sq = row_sum_sq(h) if fused else None
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
        if stage is not None and not stage.last:  # (the fused layer's stream is whole)
            stage.send(h, torch.zeros_like(h) if residual is None else residual)
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
