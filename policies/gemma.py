"""Gemma 2 and Gemma 3 (``Gemma2ForCausalLM``, ``Gemma3ForCausalLM``: the text model),
and the layer parts they add, registered through ``infergraft_register_layers``.

What Gemma changes in the LLaMA layer, and where each lives:

* RMSNorm scaling by ``1 + weight`` in float32 (the checkpoint stores the offset from
  1): the norm ``gemma_rms`` below (``kernels/rms_norm.py``'s ``unit_offset``);
* "sandwich" norms: a norm on the attention's and on the MLP's output before each
  residual add (``post_attention_layernorm``, ``post_feedforward_layernorm``; the
  pre-MLP one is ``pre_feedforward_layernorm``): ``LayerSpec.post_norms``, run by the
  runner's ``DecoderLayer``;
* a GELU-gated MLP (``gelu_pytorch_tanh``): the shared ``gated`` MLP with
  ``ModelSpec.activation = "gelu_tanh"`` (``kernels/gelu_mul.py``);
* the embeddings times sqrt(hidden_size), rounded to the model dtype first:
  ``ModelSpec.embed_scale``; the logits capped to ``c * tanh(logits / c)``:
  ``final_logit_softcap``;
* attention scale ``query_pre_attn_scalar ** -0.5`` and (Gemma 2) the scores capped to
  ``c * tanh(s / c)``: ``ModelSpec.attention_scale``, ``attn_logit_softcap``, which
  every cache follows (``spec.layer_attention``);
* a sliding window on the local layers (``config.layer_types``: Gemma 2 every other
  layer, Gemma 3 five of six) with global ones between: ``LayerSpec.sliding_window``;
* Gemma 3 only: per-head q / k norms before RoPE (the attention ``gemma3`` below) and
  its local layers' own RoPE base (``rope_local_base_freq``): ``LayerSpec.rope``.

Gemma 3 keeps ``attn_logit_softcapping`` in its config but HF's Gemma 3 never applies
it: neither do we. Gemma 2's reference is HF's eager attention: transformers 5.17 runs
Gemma 2 on SDPA by default, which drops the attention softcap (5.25 refuses SDPA for it). Refused, with the feature named: bidirectional attention (the
embedding variants), ``Gemma3ForConditionalGeneration`` (the vision model), activations
other than the two GELUs, RoPE kinds ``core.rope`` does not know.
"""
from __future__ import annotations

from types import SimpleNamespace

from infergraft.core.errors import UnsupportedModelError
from infergraft.core.hookspecs import hookimpl
from infergraft.core.layer import LayerImpl
from infergraft.core.policy import Policy, WeightMap, WeightRule
from infergraft.core.rope import rope_from_config
from infergraft.core.spec import LayerSpec, ModelSpec, check_size, derived_head_dim

from .llama_layers import LlamaAttention, Norm

#: HF hidden_activation -> ModelSpec.activation (the gated MLP's act on the gate)
ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
LAYER_TYPES = ("sliding_attention", "full_attention")


def gemma_norm(spec, ops) -> Norm:
    return Norm("rms", spec.norm_eps, ops, unit_offset=True)


class GemmaQKNormAttention(LlamaAttention):
    """The LLaMA attention with Gemma's RMSNorm (1 + weight) over head_dim on each head of
    q and of k, before RoPE (Gemma 3). Slots: ``qkv``, ``o``, ``q_norm``, ``k_norm``."""

    rope_in_qkv_epilogue = False  # the per-head norms come between the GEMM and RoPE

    def __init__(self, layer, spec, ops):
        super().__init__(layer, spec, ops)
        layer.q_norm, layer.k_norm = gemma_norm(spec, ops), gemma_norm(spec, ops)

    def rotate_inputs(self, layer, q, k):
        # q [T, Hq, D], k [T, Hkv, D] (views of the qkv rows): each head's D normed
        d = q.shape[-1]
        return (layer.q_norm(q.reshape(-1, d))[0].view(q.shape),
                layer.k_norm(k.reshape(-1, d))[0].view(k.shape))


NORM = LayerImpl("norm", "gemma_rms", gemma_norm,
                 "RMSNorm scaling by 1 + weight, in float32 (Gemma)")
QK_NORM_ATTENTION = LayerImpl("attention", "gemma3", GemmaQKNormAttention,
                              "the LLaMA attention with Gemma's per-head RMSNorm on q and k")


def _layer_types(config, arch: str, every: int) -> list[str]:
    """Each layer's "sliding_attention" or "full_attention": ``config.layer_types``, or
    where a config has none every ``every``-th layer global (HF's default)."""
    n = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    if types is None:
        every = getattr(config, "sliding_window_pattern", None) or every
        types = ["full_attention" if (i + 1) % every == 0 else "sliding_attention"
                 for i in range(n)]
    types = list(types)
    if len(types) != n or any(t not in LAYER_TYPES for t in types):
        raise UnsupportedModelError(
            f"{arch}: layer_types must name {n} layers, each one of {', '.join(LAYER_TYPES)}; "
            f"got {types!r}")
    return types


def _rope(params: dict, config, head_dim: int, arch: str, which: str):
    if not params or "rope_theta" not in params:
        raise UnsupportedModelError(f"{arch}: the {which} layers' RoPE parameters give no "
                                    f"rope_theta (got {params!r})")
    ns = SimpleNamespace(rope_parameters=params,
                         max_position_embeddings=config.max_position_embeddings)
    try:
        return rope_from_config(ns, head_dim)
    except UnsupportedModelError as e:
        raise UnsupportedModelError(f"{arch} ({which} layers): {e}") from None


def _gemma3_ropes(config, head_dim: int, arch: str):
    """(global layers' RopeSpec, local layers'): transformers 5 keeps them in
    ``rope_parameters`` by layer type; 4.x configs as rope_theta (+ rope_scaling) and
    rope_local_base_freq."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if any(t in params for t in LAYER_TYPES):
        full, local = params.get("full_attention"), params.get("sliding_attention")
    else:
        full = dict(getattr(config, "rope_scaling", None) or {},
                    rope_theta=getattr(config, "rope_theta", 1_000_000.0))
        local = {"rope_type": "default",
                 "rope_theta": getattr(config, "rope_local_base_freq", 10_000.0)}
    return (_rope(dict(full or {}), config, head_dim, arch, "global"),
            _rope(dict(local or {}), config, head_dim, arch, "local"))


def gemma_spec(config, arch: str, *, version: int) -> ModelSpec:
    """The ModelSpec of a Gemma 2 (``version=2``) or Gemma 3 text config."""
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedModelError(f"{arch}: bidirectional attention (use_bidirectional_"
                                    "attention, the embedding variants) is not supported; "
                                    "causal decoders only")
    act = getattr(config, "hidden_activation", None) or "gelu_pytorch_tanh"
    if act not in ACTIVATIONS:
        raise UnsupportedModelError(f"{arch}: hidden_activation {act!r} is not supported "
                                    f"(supported: {', '.join(ACTIVATIONS)})")
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None)
    head_dim = derived_head_dim(arch, config.hidden_size, heads) if head_dim is None \
        else check_size(arch, "head_dim", head_dim)
    types = _layer_types(config, arch, every=2 if version == 2 else 6)
    window = getattr(config, "sliding_window", None)
    if "sliding_attention" in types and (isinstance(window, bool) or not isinstance(window, int)
                                         or window < 1):
        raise UnsupportedModelError(f"{arch}: sliding_window must be a positive integer for "
                                    f"its sliding_attention layers, got {window!r}")
    if version == 2:
        rope = local_rope = _rope(dict(getattr(config, "rope_parameters", None) or {
            "rope_type": "default", "rope_theta": getattr(config, "rope_theta", 10_000.0)}),
            config, head_dim, arch, "every")
    else:
        rope, local_rope = _gemma3_ropes(config, head_dim, arch)
    slots = () if version == 2 else (("q_norm.weight", (head_dim,)), ("k_norm.weight", (head_dim,)))
    attention = "llama" if version == 2 else QK_NORM_ATTENTION.name
    layers = tuple(
        LayerSpec(attention=attention, slots=slots, post_norms=True,
                  sliding_window=window if t == "sliding_attention" else None,
                  rope=local_rope if t == "sliding_attention" and local_rope != rope else None)
        for t in types)
    scale = float(config.query_pre_attn_scalar) ** -0.5
    eos = config.eos_token_id
    eos = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
    bias = bool(getattr(config, "attention_bias", False))
    kv_heads = getattr(config, "num_key_value_heads", None)
    return ModelSpec(
        architecture=arch, num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size, num_heads=heads,
        num_kv_heads=heads if kv_heads is None else kv_heads, head_dim=head_dim,
        intermediate_size=config.intermediate_size, vocab_size=config.vocab_size,
        max_position=config.max_position_embeddings, norm=NORM.name,
        norm_eps=config.rms_norm_eps, activation=ACTIVATIONS[act], gated_mlp=True,
        position="rope", rope=rope, layers=layers,
        # the default scale where it is the same number: caches that do not vary it serve it
        attention_scale=None if scale == head_dim ** -0.5 else scale,
        # Gemma 3's config keeps attn_logit_softcapping, which HF's Gemma 3 never applies
        attn_logit_softcap=getattr(config, "attn_logit_softcapping", None) if version == 2
        else None,
        final_logit_softcap=getattr(config, "final_logit_softcapping", None),
        embed_scale=config.hidden_size ** 0.5, qkv_bias=bias, o_bias=bias,
        tie_embeddings=bool(getattr(config, "tie_word_embeddings", True)),
        bos_token_id=getattr(config, "bos_token_id", None), eos_token_ids=eos,
        pad_token_id=getattr(config, "pad_token_id", None))


def gemma_weight_map(spec: ModelSpec) -> WeightMap:
    """HF Gemma 2 / 3 key names: the LLaMA ones, the four norms of a layer, Gemma 3's q /
    k norms."""
    attn, layer = "model.layers.{i}.self_attn.", "model.layers.{i}."
    rules = [WeightRule("model.embed_tokens.weight", "embed.weight"),
             WeightRule("model.norm.weight", "final_norm.weight")]
    rules += [WeightRule(f"{attn}{p}_proj.weight", "layers.{i}.qkv.weight", part=n)
              for n, p in enumerate("qkv")]
    rules.append(WeightRule(f"{attn}o_proj.weight", "layers.{i}.o.weight"))
    if spec.qkv_bias:
        rules += [WeightRule(f"{attn}{p}_proj.bias", "layers.{i}.qkv.bias", part=n)
                  for n, p in enumerate("qkv")]
        rules.append(WeightRule(f"{attn}o_proj.bias", "layers.{i}.o.bias"))
    for hf, ours in (("input_layernorm", "attn_norm"), ("post_attention_layernorm",
                                                        "attn_post_norm"),
                     ("pre_feedforward_layernorm", "mlp_norm"),
                     ("post_feedforward_layernorm", "mlp_post_norm")):
        rules.append(WeightRule(f"{layer}{hf}.weight", f"layers.{{i}}.{ours}.weight"))
    rules += [WeightRule(f"{layer}mlp.{p}_proj.weight", "layers.{i}.gate_up.weight", part=n)
              for n, p in enumerate(("gate", "up"))]
    rules.append(WeightRule(f"{layer}mlp.down_proj.weight", "layers.{i}.down.weight"))
    if spec.layer(0).attention == QK_NORM_ATTENTION.name:
        rules += [WeightRule(f"{attn}{p}_norm.weight", f"layers.{{i}}.{p}_norm.weight")
                  for p in "qk"]
    aliases = ()
    if spec.tie_embeddings:  # checkpoints keep either name of the shared tensor
        aliases = (("lm_head.weight", "model.embed_tokens.weight"),)
    else:
        rules.append(WeightRule("lm_head.weight", "lm_head.weight"))
    return WeightMap(tuple(rules), ignore=(r".*rotary_emb\..*inv_freq$",
                                           r".*embed_tokens\.embed_scale$"), aliases=aliases)


class Gemma2Policy(Policy):
    name = "gemma2"
    architectures = ("Gemma2ForCausalLM",)
    model_types = ("gemma2",)

    def describe(self, config) -> ModelSpec:
        self.check(config)
        return gemma_spec(config, "Gemma2ForCausalLM", version=2)

    def weight_map(self, spec: ModelSpec) -> WeightMap:
        return gemma_weight_map(spec)


class Gemma3Policy(Policy):
    name = "gemma3"
    architectures = ("Gemma3ForCausalLM",)
    model_types = ("gemma3_text",)
    #: claimed so that a build names what is missing, rather than "no policy"
    multimodal = ("Gemma3ForConditionalGeneration",)

    def claims(self, config) -> bool:
        archs = getattr(config, "architectures", None) or ()
        return super().claims(config) or any(a in self.multimodal for a in archs)

    def describe(self, config) -> ModelSpec:
        self.check(config)
        archs = getattr(config, "architectures", None) or ()
        if any(a in self.multimodal for a in archs) or hasattr(config, "vision_config"):
            raise UnsupportedModelError(
                "Gemma3ForConditionalGeneration (Gemma 3 with its vision tower) is not "
                "supported: no image inputs, nor its text model's weights under "
                "language_model.*; supported: Gemma3ForCausalLM (the text-only checkpoints, "
                "model_type gemma3_text, e.g. gemma-3-1b)")
        return gemma_spec(config, "Gemma3ForCausalLM", version=3)

    def weight_map(self, spec: ModelSpec) -> WeightMap:
        return gemma_weight_map(spec)


@hookimpl
def infergraft_register_layers(register):
    register(NORM)
    register(QK_NORM_ATTENTION)


@hookimpl
def infergraft_register_policies(register):
    register(Gemma2Policy())
    register(Gemma3Policy())
