"""ModelSpec: what the engine needs to know about a decoder, taken from the HF config.

A spec refuses sizes that are not integers >= 1 (UnsupportedModelError naming the field),
so that no policy, built-in or third-party, hands the planner or the model a config that
would plan negative bytes or build empty tensors.
"""
from __future__ import annotations

import math
import numbers
import re
from typing import Optional

import attrs

from .errors import UnsupportedModelError

#: ModelSpec's sizes -> what HF configs call them, for refusals a user can act on
HF_NAMES = {"num_layers": "num_hidden_layers / n_layer", "hidden_size": "hidden_size / n_embd",
            "num_heads": "num_attention_heads / n_head", "num_kv_heads": "num_key_value_heads",
            "head_dim": "head_dim", "intermediate_size": "intermediate_size / n_inner",
            "vocab_size": "vocab_size", "max_position": "max_position_embeddings / n_positions",
            "sliding_window": "sliding_window",
            "rotary_dim": "head_dim x partial_rotary_factor",
            "attention_scale": "query_pre_attn_scalar ** -0.5",
            "attn_logit_softcap": "attn_logit_softcapping",
            "final_logit_softcap": "final_logit_softcapping",
            "embed_scale": "hidden_size ** 0.5 (Gemma)"}


def check_size(architecture: str, name: str, value) -> int:
    """``value`` if it is an integer >= 1 (numpy's too, bool not), else
    UnsupportedModelError naming ``architecture``, the field and its HF name."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1:
        return value
    hf = f" (config.json: {HF_NAMES[name]})" if name in HF_NAMES else ""
    raise UnsupportedModelError(f"{architecture}: {name} must be an integer >= 1, got "
                                f"{value!r}{hf}")


def derived_head_dim(architecture: str, hidden_size, num_heads) -> int:
    """hidden_size // num_heads, for configs that give no head_dim; UnsupportedModelError
    where either is not an integer >= 1 or the heads do not divide hidden_size."""
    check_size(architecture, "hidden_size", hidden_size)
    check_size(architecture, "num_heads", num_heads)
    if hidden_size % num_heads:
        raise UnsupportedModelError(
            f"{architecture}: hidden_size={hidden_size} is not a multiple of num_heads="
            f"{num_heads}, so head_dim cannot be derived; accepted: a hidden_size that "
            "num_attention_heads divides, or a config that gives head_dim")
    return hidden_size // num_heads


def _size(instance, attribute, value) -> None:
    check_size(instance.architecture, attribute.name, value)


def _optional_size(instance, attribute, value) -> None:
    if value is not None:
        check_size(getattr(instance, "architecture", type(instance).__name__), attribute.name,
                   value)


def _optional_positive(instance, attribute, value) -> None:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and \
        math.isfinite(value) and value > 0
    if value is not None and not ok:
        where = getattr(instance, "architecture", type(instance).__name__)
        hf = f" (config.json: {HF_NAMES[attribute.name]})" if attribute.name in HF_NAMES else ""
        raise UnsupportedModelError(f"{where}: {attribute.name} must be a positive number or "
                                    f"None, got {value!r}{hf}")


@attrs.frozen
class RopeSpec:
    """Rotary embedding settings (transformers 5: ``config.rope_parameters``)."""

    theta: float = 10000.0
    type: str = "default"  # default | linear | llama3 | yarn | longrope | dynamic
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    # None: the whole head_dim
    rotary_dim: Optional[int] = attrs.field(default=None, validator=_optional_size)
    # yarn, longrope: cos and sin multiplied by it (HF's attention_factor, resolved)
    attention_factor: float = 1.0
    # yarn: the band of frequencies between extrapolation and interpolation
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    # longrope: each frequency's divisor up to original_max_position tokens (short) and
    # past it (long), rotary_dim / 2 each (core/long_rope.py: which one a sequence reads)
    short_factor: tuple[float, ...] = attrs.field(default=(), converter=tuple)
    long_factor: tuple[float, ...] = attrs.field(default=(), converter=tuple)


#: a layer's own slots, laid out from the spec's sizes (core.slots): a LayerSpec's may not
#: reuse their names
LLAMA_LAYER_SLOTS = ("attn_norm", "qkv", "o", "mlp_norm", "gate_up", "fc_in", "down",
                     "attn_post_norm", "mlp_post_norm")
#: the slots of a mixture-of-experts layer (``LayerSpec.experts``), laid out by core.slots
#: in place of the dense MLP's
EXPERT_SLOTS = ("router", "experts_gate_up", "experts_down")
_SLOT_NAME = re.compile(r"^[a-z_][a-z0-9_]*\.(weight|bias)$")


def _as_slots(value):
    try:  # lists (a JSON spec, a hand-written one) become the tuples a frozen spec hashes
        return tuple((name, tuple(shape)) for name, shape in value)
    except (TypeError, ValueError):
        return value  # the validator names it


def _layer_slots(instance, attribute, value) -> None:
    reserved = LLAMA_LAYER_SLOTS + EXPERT_SLOTS
    accepted = ("accepted: (name, shape) pairs, a name such as 'q_norm.weight' (a module and "
                f"weight or bias, none of the layer's own: {', '.join(reserved)}) "
                "and a shape of integers >= 1")
    if not isinstance(value, tuple):
        raise UnsupportedModelError(f"LayerSpec slots must be a tuple, got {value!r}; {accepted}")
    names = []
    for entry in value:
        ok = isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str) \
            and bool(_SLOT_NAME.match(entry[0])) and \
            entry[0].split(".")[0] not in reserved and bool(entry[1]) and all(
                isinstance(n, numbers.Integral) and not isinstance(n, bool) and n >= 1
                for n in entry[1])
        if not ok:
            raise UnsupportedModelError(f"LayerSpec slot {entry!r} is not valid; {accepted}")
        names.append(entry[0])
    if len(set(names)) != len(names):
        raise UnsupportedModelError(f"LayerSpec declares a slot twice: {names}")


_EXPERT_HF_NAMES = {"num_experts": "num_local_experts / num_experts",
                    "top_k": "num_experts_per_tok",
                    "intermediate_size": "intermediate_size / moe_intermediate_size"}


def _expert_size(instance, attribute, value) -> None:
    if not (isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1):
        raise UnsupportedModelError(
            f"ExpertSpec: {attribute.name} must be an integer >= 1, got {value!r} "
            f"(config.json: {_EXPERT_HF_NAMES[attribute.name]})")


@attrs.frozen
class ExpertSpec:
    """A mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router, a linear [E, H] over the
    normed stream, picks each token's ``top_k`` of ``num_experts`` SwiGLU experts of
    ``intermediate_size``, whose outputs are summed weighted by the routing weights:
    softmax over all E router logits, the top_k kept, renormalised to sum to 1 where
    ``renormalize`` (Mixtral always; Qwen3-MoE's ``norm_topk_prob``). Its weights are
    the slots ``router`` [E, H], ``experts_gate_up`` [E * 2I, H] (each expert's gate and
    up rows in turn) and ``experts_down`` [E * H, I] (core.slots)."""

    num_experts: int = attrs.field(validator=_expert_size)
    top_k: int = attrs.field(validator=_expert_size)
    intermediate_size: int = attrs.field(validator=_expert_size)
    renormalize: bool = True

    def __attrs_post_init__(self):
        if self.top_k > self.num_experts:
            raise UnsupportedModelError(
                f"ExpertSpec: top_k={self.top_k} experts a token out of num_experts="
                f"{self.num_experts} (config.json: num_experts_per_tok / num_local_experts or "
                "num_experts); accepted: top_k <= num_experts")

    def param_count(self, hidden_size: int, experts: int | None = None) -> int:
        """Elements of the router and of ``experts`` experts (default: all of them)."""
        e = self.num_experts if experts is None else experts
        return self.num_experts * hidden_size + e * 3 * hidden_size * self.intermediate_size


@attrs.frozen
class LayerSpec:
    """What one decoder layer runs: the registered implementations of its attention and
    its MLP (``infergraft_register_layers``, core/layer.py; the norms are the model's,
    ``ModelSpec.norm``), and the weights those add to the LLaMA layer's slots, each a name
    under ``layers.{i}.`` and its shape (replicated under tensor parallelism), e.g. the
    per-head q / k norms of Qwen3: ``slots=(("q_norm.weight", (128,)), ("k_norm.weight",
    (128,)))``. ``experts``: the layer's MLP is a mixture of experts (its ``mlp`` a part
    that runs one, e.g. ``moe``), whose slots replace the dense MLP's (``ExpertSpec``),
    each expert cut by tensor parallelism as the dense MLP is.

    Per layer besides: ``sliding_window`` (None: the model's, ``ModelSpec.sliding_window``;
    Gemma's local layers W, its global ones None under a model-wide None), ``rope`` (None:
    the model's; Gemma 3's local layers their own base) and ``post_norms``: a norm on the
    attention's and on the MLP's output before each residual add (Gemma's "sandwich":
    slots ``attn_post_norm`` and ``mlp_post_norm``, the model's norm)."""

    attention: str = "llama"
    mlp: Optional[str] = None  # None: "gated" where the spec's gated_mlp, else "plain"
    slots: tuple[tuple[str, tuple[int, ...]], ...] = attrs.field(
        default=(), converter=_as_slots, validator=_layer_slots)
    experts: Optional[ExpertSpec] = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.instance_of(ExpertSpec)))
    sliding_window: Optional[int] = attrs.field(default=None, validator=_optional_size)
    rope: Optional[RopeSpec] = None
    post_norms: bool = False

    @property
    def param_count(self) -> int:
        """Elements of the slots it declares."""
        return sum(math.prod(shape) for _, shape in self.slots)


_EVERY_LAYER = LayerSpec()


@attrs.frozen
class LayerAttention:
    """How one layer's attention treats its scores, what a cache's ``attention`` follows
    (``ModelSpec.layer_attention``): softmax(cap(q.k * scale)) over the keys at positions
    p - window + 1 .. p (all up to p where window is None), cap(s) = softcap * tanh(s /
    softcap) where softcap is not None."""

    scale: float
    window: Optional[int] = None
    softcap: Optional[float] = None


#: what a spec may ask of a cache's attention beyond LLaMA's (a backend names those it
#: honours: ``CacheBackend.attention_features``) -> what it is, for refusals
ATTENTION_FEATURES = {
    "scale": "an attention scale other than head_dim ** -0.5 (query_pre_attn_scalar)",
    "softcap": "a softcap on the attention scores (attn_logit_softcapping)",
    "layer_windows": "a sliding window on some layers only, or of several sizes",
}


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
