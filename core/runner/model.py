"""Our own small module tree of fused layers, built from a ModelSpec: embeddings, the
decoder layers (each composed from the registered parts its spec names: core/layer.py),
the final norm and the LM head.

Slot names (``layers.3.qkv.weight``) are what policies' weight maps point at; weights
arrive later through ``core.loading.weights.load_weights``. Hot path shapes: T = tokens in the
step (all sequences concatenated), H = hidden, D = head_dim.
"""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from .._moved import moved_names
from ..distributed.vocab import VocabParallel
from ..rope import long_rope_boundary, rope_cos_sin, table_rows
from ..slots import folded, slot_layout  # noqa: F401  (slot_layout: imported from here too)
from ..spec import ModelSpec, split_qkv  # noqa: F401  (split_qkv: imported from here too)
# (Linear, QuantizedLinear, gemm_operands: imported from here too)
from .layers import Linear, QuantizedLinear, gemm_operands, reads_norm, row_sum_sq  # noqa: F401
from .parts import check_slots_built, layer_parts

# the weight streamer of a model whose layers all stay on the device: nothing to copy
_RESIDENT = types.SimpleNamespace(begin=lambda: None, before=lambda i: None, after=lambda i: None)


class DecoderLayer(nn.Module):
    """One pre-norm decoder layer composed from registered parts (core/layer.py): norm ->
    attention -> add -> norm -> MLP -> add; with ``LayerSpec.post_norms`` (Gemma's
    "sandwich") a norm on the attention's and on the MLP's output before each add. The
    parts' projections are this module's children under slot names (``layers.3.qkv``:
    what weight maps fill); the parts run them with the layer passed in. ``parts``:
    (attention, mlp, norm) ``LayerImpl``s; ``layer_spec``: this layer's ``LayerSpec``
    (what its parts read of it, e.g. its experts), by default the first layer's."""

    def __init__(self, spec: ModelSpec, ops, parts, layer_spec=None):
        super().__init__()
        attention, mlp, norm = parts
        self.spec, self.ops = spec, ops
        self.layer_spec = spec.layer(0) if layer_spec is None else layer_spec
        self.post_norms = bool(layer_spec is not None and layer_spec.post_norms)
        self.attn_norm = norm.build(spec, ops)
        # o's and down's outputs may come as split-K partials where the norm after them
        # adds them up with the residual (not where a post norm takes them first)
        self.sums_partials = bool(getattr(self.attn_norm, "adds_partials", False)) \
            and not self.post_norms
        self.attention = attention.build(self, spec, ops)  # adds qkv, o (and its own)
        self.mlp_norm = norm.build(spec, ops)
        self.mlp = mlp.build(self, spec, ops)  # adds gate_up / fc_in, down (and its own)
        if self.post_norms:
            self.attn_post_norm, self.mlp_post_norm = norm.build(spec, ops), norm.build(spec, ops)

    @property
    def norm_feeds(self) -> tuple[tuple[str, str], ...]:
        """(norm, the projection it feeds): where the fused decode layer folds its weight
        (not a part's whose ``folds_input_norm`` is False: a mixture of experts)."""
        return tuple((norm, part.input_projection) for norm, part in
                     (("attn_norm", self.attention), ("mlp_norm", self.mlp))
                     if getattr(part, "folds_input_norm", True))

    def will_fuse(self) -> bool:
        """Whether the parts run in the fused decode layer (known before weights load)."""
        return bool(getattr(self.attn_norm, "folds", False) and self.attention.fuses
                    and self.mlp.fuses and not self.post_norms)

    def fusable(self) -> bool:
        """Parts that fuse, every projection our own Linear, 8-bit rows or int4 groups
        (other quantised forms have their own forward), and norms the fused layer can
        drop: a Linear takes them at ``fold_norm_weights``, 8-bit rows only before packing
        (``core.loading.packing.SlotPacker``), int4 groups never (``reads_norm``: the GEMM
        applies the norm weight as it loads x). The shape ``forward_fused`` knows."""
        return self.will_fuse() and self.attention.fusable(self) and self.mlp.fusable(self) \
            and all(n in self.folded_norms or type(getattr(self, p)) is Linear
                    or reads_norm(getattr(self, p)) for n, p in self.norm_feeds)

    # core.distributed.collectives.TensorParallelGroup: o and down outputs summed over ranks
    tp = None
    folded_norms = frozenset()  # norms whose weights already live in their projection

    @torch.no_grad()
    def fold_norm_weights(self) -> None:
        """rms_norm(x, g) W^T == rms_norm(x, 1) (W g)^T: the norm weights move into the
        projections they feed (qkv, gate_up), so the fused layer runs no norm kernel (the
        plain layer's norms then multiply by ones). Not into int4 groups (``reads_norm``):
        the fused GEMMs take those norms' weights as they are (``input_norm``)."""
        for name, proj in self.norm_feeds:
            if name not in self.folded_norms and not reads_norm(getattr(self, proj)):
                lin = getattr(self, proj)
                lin.weight = folded(lin.weight, getattr(self, name).weight)
                self.mark_norm_folded(name)

    def input_norm(self, name: str) -> dict:
        """The keyword arguments that give a fused GEMM norm ``name``'s weight to apply in
        its prologue: ``{"norm": weight}`` where it is not folded into the projection it
        feeds (int4 groups), else none."""
        return {} if name in self.folded_norms else {"norm": getattr(self, name).weight}

    def mark_norm_folded(self, name: str) -> None:
        """Norm ``name``'s weight now lives in the projection it feeds: it multiplies by ones."""
        norm = getattr(self, name)
        norm.weight = torch.ones_like(norm.weight)
        self.folded_norms = self.folded_norms | {name}

    def forward_fused(self, stream, layer_idx, positions, rope, cache, meta, sum_sq,
                      want_next: bool):
        """The layer at few tokens, norms folded into the GEMMs (the parts'
        ``forward_fused``): stream [T, H] (the residual stream) and its sum of squares
        per row (partials [P, T]) -> (the next stream, its sums or None without
        ``want_next``)."""
        stream, sum_sq = self.attention.forward_fused(self, stream, sum_sq, layer_idx,
                                                      positions, rope, cache, meta)
        return self.mlp.forward_fused(self, stream, sum_sq, want_next)

    def forward(self, h, residual, layer_idx, positions, rope, cache, meta):
        x, residual = self.attn_norm(h, residual)  # [T, H]
        h = self.attention.forward(self, x, layer_idx, positions, rope, cache, meta)  # [T, H]
        if self.tp is not None:  # each rank's heads contributed a share of o's output
            h = self.tp.all_reduce(h)
        if self.post_norms:  # after the sum: a norm of the whole output
            h = self.attn_post_norm(h)[0]
        x, residual = self.mlp_norm(h, residual)
        out = self.mlp.forward(self, x)  # [T, H] or partials [S, T, H]
        if self.tp is not None:
            out = self.tp.all_reduce(out)
        if self.post_norms:
            out = self.mlp_post_norm(out)[0]
        return out, residual


class DecoderModel(nn.Module):
    def __init__(self, spec: ModelSpec, ops, device, max_position: int | None = None,
                 tp=None, stage=None, layers=None):
        """``spec``: what this process runs: one rank's share under ``tp`` (a
        ``core.distributed.collectives.TensorParallelGroup``), one stage's layers under
        ``stage`` (a ``core.distributed.stages.PipelineStage``: the stream comes from and goes
        to its neighbours). ``layers``: the registered layer implementations by kind that
        the spec's names are looked up in (``PluginManager.layers()``; None: the
        process-wide manager's)."""
        super().__init__()
        if layers is None:
            from ..plugin_manager import get_plugin_manager
            layers = get_plugin_manager().layers()
        parts, final_norm = layer_parts(spec, layers)  # unknown names refused here
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
        self.layers = nn.ModuleList(DecoderLayer(spec, ops, p, spec.layer(i))
                                    for i, p in enumerate(parts))
        for layer in self.layers:
            layer.tp = tp
        self.final_norm = final_norm.build(spec, ops)
        if not spec.tie_embeddings:
            self.lm_head = Linear(ops)
        check_slots_built(self, spec)
        self.norms_folded = False  # fold_norm_weights() turns the fused decode layer on
        self.streamer = None  # runner.weight_stream.WeightStreamer: layers in host memory
        # a layer's RoPE tables: the model's, or its own (Gemma 3's local layers); LongRoPE
        # past its original length: two tables, rows chosen per sequence (core/long_rope.py;
        # None: row p of the one table for position p)
        self.rope, self.layer_ropes = None, [None] * spec.num_layers
        self.rope_boundary = None
        if spec.position == "rope":
            rows, tables = max_position or spec.max_position, {}
            for i in range(spec.num_layers):
                rope = spec.layer(i).rope or spec.rope
                if rope not in tables:
                    tables[rope] = rope_cos_sin(rope, spec.head_dim, rows, device)
                self.layer_ropes[i] = tables[rope]
            self.rope = tables.get(spec.rope) or rope_cos_sin(spec.rope, spec.head_dim, rows,
                                                              device)
            self.rope_boundary = long_rope_boundary(spec.rope, rows)
        self._embed_multiplier = {}  # dtype -> spec.embed_scale rounded to it

    def _fused(self, tokens: int) -> bool:
        return self.norms_folded and tokens <= getattr(self.ops, "fuse_max_rows", 0)

    def will_fuse(self, dtype) -> bool:
        """Whether the fused decode layer can run for these layers, ops and weight dtype
        (known before any weight loads): parts that fuse (RMSNorm, the LLaMA attention,
        SwiGLU), ops that fuse, 16-bit weights (float32 GEMMs stay on cuBLAS: the plain
        layer is the fast one). Under tp the residual joins o's and down's shares on the
        group's rank 0."""
        return bool(getattr(self.ops, "fuse_max_rows", 0)) and \
            dtype in (torch.float16, torch.bfloat16) and all(
            layer.will_fuse() for layer in self.layers)

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

    def _embed_multiplier_for(self, dtype) -> float:
        """``spec.embed_scale`` rounded to ``dtype`` (through float32, as HF's buffer), as
        a Python number: the product then rounds once, like HF's of two ``dtype`` values."""
        if dtype not in self._embed_multiplier:
            scale = torch.tensor(self.spec.embed_scale, dtype=torch.float32).to(dtype)
            self._embed_multiplier[dtype] = float(scale)
        return self._embed_multiplier[dtype]

    @property
    def lm_head_weight(self):
        return self.embed.weight if self.spec.tie_embeddings else self.lm_head.weight

    def forward(self, tokens, cache, meta, logits_index=None, greedy_out=None, long_rows=None):
        """tokens: [T] -> logits [len(logits_index) or T, V] float32 (None on a pipeline
        stage before the last, and under tp on every rank but the group's first).
        ``greedy_out``: an int64 buffer [n] that receives each row's argmax (the decode
        graphs' next tokens, written in the same kernel that widens the logits).
        ``long_rows``: [T] bool, rows that read LongRoPE's long table below its boundary
        (``core.long_rope.LongRopeSwitch.long_rows``; None: none)."""
        positions = meta.positions
        # what the layers index the RoPE table with: the positions, or LongRoPE's rows
        rope_rows = positions if self.rope_boundary is None else \
            table_rows(positions, self.rope_boundary, long_rows)
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
        elif fused and self.spec.position != "learned" and self.vocab is None \
                and self.spec.embed_scale is None:
            # one kernel: the rows and their statistic
            h, sum_sq = self.ops.embed_sum_sq(tokens, self.embed.weight)  # [T, H], [1, T]
        else:
            # tp: each rank's rows, summed over the group
            h = F.embedding(tokens, self.embed.weight) if self.vocab is None \
                else self.vocab.embed(tokens, self.embed.weight)  # [T, H]
            if self.spec.position == "learned":
                h = h + F.embedding(positions, self.pos_embed.weight)
            if self.spec.embed_scale is not None:  # Gemma: times sqrt(hidden), in its dtype
                h = h * self._embed_multiplier_for(h.dtype)
            sum_sq = row_sum_sq(h) if fused else None
        if fused:  # h is the residual stream throughout; sum_sq: the next norm's statistic
            last = len(self.layers) - 1
            for i, layer in enumerate(self.layers):
                streamer.before(i)
                h, sum_sq = layer.forward_fused(h, i, rope_rows, self.layer_ropes[i], cache, meta,
                                                sum_sq, want_next=i < last)
                streamer.after(i)
        else:
            for i, layer in enumerate(self.layers):
                streamer.before(i)
                h, residual = layer(h, residual, i, rope_rows, self.layer_ropes[i], cache, meta)
                streamer.after(i)
        if stage is not None and not stage.last:  # (the fused layer's stream is whole)
            stage.send(h, torch.zeros_like(h) if residual is None else residual)
            return None  # the last stage has the logits
        if logits_index is not None:  # only the rows we sample from
            h = h[..., logits_index, :]
            residual = None if residual is None else residual[logits_index]
        x, _ = self.final_norm(h, residual)
        y = self.ops.lm_head(x, self.lm_head_weight)  # [n, V] (tp: [n, V_pad / tp]), model dtype
        cap = self.spec.final_logit_softcap
        if cap is not None:  # Gemma: c * tanh(logits / c), in the model dtype as HF's
            y = torch.tanh(y / cap) * cap
        if self.vocab is not None:  # gathered to the group's rank 0, which samples: else None
            return self.vocab.logits(y, greedy_out)  # [n, V] float32
        if greedy_out is None:
            return y.float()
        # float32 [n, V]; argmax -> greedy_out (split rows merge on this model's counters)
        return self.ops.logits_argmax(y, greedy_out, counters=self.counters)


__getattr__ = moved_names(__name__)  # names that moved out, for one release
