"""One decoder layer's part of a ModelSpec: ``LayerSpec`` (its attention and MLP by name, the
weights they add, its experts, window, RoPE and post norms), ``ExpertSpec`` (a mixture of
experts), ``LayerAttention`` (what a cache's attention does with its scores)."""
from __future__ import annotations

import math
import numbers
import re
from typing import Optional

import attrs

from .errors import UnsupportedModelError
from .spec_fields import RopeSpec, _optional_size

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
