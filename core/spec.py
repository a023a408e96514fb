"""ModelSpec: what the engine needs to know about a decoder, taken from the HF config.

A spec refuses sizes that are not integers >= 1 (UnsupportedModelError naming the field),
so that no policy, built-in or third-party, hands the planner or the model a config that
would plan negative bytes or build empty tensors. Its parts: ``spec_fields.py`` (the
checked sizes, ``RopeSpec``), ``layer_spec.py`` (one layer's ``LayerSpec``, its
``ExpertSpec``, ``LayerAttention``); every name is importable from here.
"""
from __future__ import annotations

from typing import Optional

import attrs

from .errors import UnsupportedModelError
from .layer_spec import (ATTENTION_FEATURES, EXPERT_SLOTS, LLAMA_LAYER_SLOTS,  # noqa: F401
                         _EVERY_LAYER, ExpertSpec, LayerAttention, LayerSpec)
from .spec_fields import (HF_NAMES, RopeSpec, _optional_positive, _optional_size,  # noqa: F401
                          _size, check_size, derived_head_dim)


@attrs.frozen
class ModelSpec:
    """Shape and flavour of a decoder-only transformer, independent of any HF class."""

    architecture: str
    # validators run once every field is set, so a refusal can name the architecture
    num_layers: int = attrs.field(validator=_size)
    hidden_size: int = attrs.field(validator=_size)
    num_heads: int = attrs.field(validator=_size)
    num_kv_heads: int = attrs.field(validator=_size)
    head_dim: int = attrs.field(validator=_size)
    intermediate_size: int = attrs.field(validator=_size)
    vocab_size: int = attrs.field(validator=_size)
    max_position: int = attrs.field(validator=_size)
    norm: str = "rms"  # a registered norm (core/layer.py): rms | layer
    norm_eps: float = 1e-6
    activation: str = "silu"  # silu | gelu_tanh | gelu
    gated_mlp: bool = True  # gate_up fused (LLaMA) or a single fc_in (GPT-2)
    position: str = "rope"  # rope | learned
    rope: Optional[RopeSpec] = None
    # the window of every layer whose LayerSpec gives none (layer_attention(i).window)
    sliding_window: Optional[int] = attrs.field(default=None, validator=_optional_size)
    # None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    attention_scale: Optional[float] = attrs.field(default=None, validator=_optional_positive)
    # scores -> c * tanh(scores / c) before the softmax (Gemma 2)
    attn_logit_softcap: Optional[float] = attrs.field(default=None, validator=_optional_positive)
    # logits -> c * tanh(logits / c), in the model dtype (Gemma 2 and 3)
    final_logit_softcap: Optional[float] = attrs.field(default=None,
                                                       validator=_optional_positive)
    # the embeddings times this, rounded to the model dtype first (Gemma: sqrt(hidden))
    embed_scale: Optional[float] = attrs.field(default=None, validator=_optional_positive)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    tie_embeddings: bool = False
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: Optional[int] = None
    #: each layer's parts, one LayerSpec a layer; () (the default): LayerSpec() for every layer
    layers: tuple[LayerSpec, ...] = attrs.field(default=(), converter=tuple)

    def __attrs_post_init__(self):
        # after the validators: both are integers >= 1 here
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"{self.architecture}: num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}; accepted: num_key_value_heads dividing "
                "num_attention_heads (grouped-query attention shares each K/V head among "
                "num_heads / num_kv_heads query heads)")
        if self.layers and (len(self.layers) != self.num_layers or
                            not all(isinstance(x, LayerSpec) for x in self.layers)):
            raise UnsupportedModelError(
                f"{self.architecture}: layers holds {len(self.layers)} entries for "
                f"num_layers={self.num_layers}; accepted: () (LayerSpec() for every layer) "
                "or one core.spec.LayerSpec a layer")

    def layer(self, i: int) -> LayerSpec:
        """Layer ``i``'s parts, its MLP named (``gated`` or ``plain`` by ``gated_mlp``
        where its LayerSpec leaves it None)."""
        spec = self.layers[i] if self.layers else _EVERY_LAYER
        if spec.mlp is None:
            spec = attrs.evolve(spec, mlp="gated" if self.gated_mlp else "plain")
        return spec

    def layer_attention(self, i: int) -> LayerAttention:
        """Layer ``i``'s scale, window and softcap: what a cache's attention follows."""
        window = self.layer(i).sliding_window
        return LayerAttention(
            scale=self.head_dim ** -0.5 if self.attention_scale is None else self.attention_scale,
            window=self.sliding_window if window is None else window,
            softcap=self.attn_logit_softcap)

    @property
    def kv_window(self) -> Optional[int]:
        """The most recent positions any layer attends to: the (widest) window where every
        layer has one, None where some layer sees every position. Caches keep that many
        (a rolling row, blocks dropped behind it); memory plans count them."""
        windows = {self.layer_attention(i).window for i in range(self.num_layers)}
        return None if None in windows else max(windows)

    @property
    def attention_features(self) -> tuple[str, ...]:
        """What this spec asks of a cache's attention beyond LLaMA's and a model-wide
        window (``ATTENTION_FEATURES``)."""
        per_layer = any(self.layer(i).sliding_window not in (None, self.sliding_window)
                        for i in range(self.num_layers))
        return tuple(f for f, wanted in (("scale", self.attention_scale is not None),
                                          ("softcap", self.attn_logit_softcap is not None),
                                          ("layer_windows", per_layer)) if wanted)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def param_count(self) -> int:
        """Parameters of the fused model (embeddings counted once when tied)."""
        return self._params(active=False)

    @property
    def active_param_count(self) -> int:
        """Parameters one token runs through: as ``param_count``, but of each
        mixture-of-experts layer only the router and its ``top_k`` experts (the figure
        model cards give as "active"; equal to ``param_count`` without experts)."""
        return self._params(active=True)

    @property
    def has_experts(self) -> bool:
        """Whether a layer's MLP is a mixture of experts (``LayerSpec.experts``)."""
        return any(x.experts is not None for x in self.layers)

    def _params(self, active: bool) -> int:
        h, i = self.hidden_size, self.intermediate_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        norms = 2 * h * (2 if self.norm == "layer" else 1)
        biases = (self.q_size + 2 * self.kv_size) * self.qkv_bias + h * self.o_bias
        dense_mlp = h * i * (3 if self.gated_mlp else 2) + \
            (i * (2 if self.gated_mlp else 1) + h) * self.mlp_bias
        mlps = 0
        for n in range(self.num_layers):
            experts = self.layer(n).experts
            mlps += dense_mlp if experts is None else \
                experts.param_count(h, experts.top_k if active else None)
        embed = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        pos = self.max_position * h if self.position == "learned" else 0
        declared = sum(x.param_count for x in self.layers)  # the slots LayerSpecs add
        post = sum(x.post_norms for x in self.layers) * norms  # sandwich norms, as many again
        return self.num_layers * (attn + norms + biases) + mlps + declared + post + embed + pos + \
            h * (2 if self.norm == "layer" else 1)


def split_qkv(qkv, num_heads: int, num_kv_heads: int, head_dim: int):
    """Views of a fused projection's rows: qkv [T, (Hq + 2 Hkv) D] -> q [T, Hq, D],
    k [T, Hkv, D], v [T, Hkv, D] (the fused slot's order, core.slots.slot_layout)."""
    t, q_size, kv_size = qkv.shape[0], num_heads * head_dim, num_kv_heads * head_dim
    return (qkv[:, :q_size].view(t, num_heads, head_dim),
            qkv[:, q_size:q_size + kv_size].view(t, num_kv_heads, head_dim),
            qkv[:, q_size + kv_size:].view(t, num_kv_heads, head_dim))
