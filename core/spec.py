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
            "rotary_dim": "head_dim x partial_rotary_factor"}


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
        check_size(getattr(instance, "architecture", "RopeSpec"), attribute.name, value)


@attrs.frozen
class RopeSpec:
    """Rotary embedding settings (transformers 5: ``config.rope_parameters``)."""

    theta: float = 10000.0
    type: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    # None: the whole head_dim
    rotary_dim: Optional[int] = attrs.field(default=None, validator=_optional_size)


#: a layer's own slots, laid out from the spec's sizes (core.slots): a LayerSpec's may not
#: reuse their names
LLAMA_LAYER_SLOTS = ("attn_norm", "qkv", "o", "mlp_norm", "gate_up", "fc_in", "down")
_SLOT_NAME = re.compile(r"^[a-z_][a-z0-9_]*\.(weight|bias)$")


def _as_slots(value):
    try:  # lists (a JSON spec, a hand-written one) become the tuples a frozen spec hashes
        return tuple((name, tuple(shape)) for name, shape in value)
    except (TypeError, ValueError):
        return value  # the validator names it


def _layer_slots(instance, attribute, value) -> None:
    accepted = ("accepted: (name, shape) pairs, a name such as 'q_norm.weight' (a module and "
                f"weight or bias, none of the LLaMA layer's own: {', '.join(LLAMA_LAYER_SLOTS)}) "
                "and a shape of integers >= 1")
    if not isinstance(value, tuple):
        raise UnsupportedModelError(f"LayerSpec slots must be a tuple, got {value!r}; {accepted}")
    names = []
    for entry in value:
        ok = isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str) \
            and bool(_SLOT_NAME.match(entry[0])) and \
            entry[0].split(".")[0] not in LLAMA_LAYER_SLOTS and bool(entry[1]) and all(
                isinstance(n, numbers.Integral) and not isinstance(n, bool) and n >= 1
                for n in entry[1])
        if not ok:
            raise UnsupportedModelError(f"LayerSpec slot {entry!r} is not valid; {accepted}")
        names.append(entry[0])
    if len(set(names)) != len(names):
        raise UnsupportedModelError(f"LayerSpec declares a slot twice: {names}")


@attrs.frozen
class LayerSpec:
    """What one decoder layer runs: the registered implementations of its attention and
    its MLP (``infergraft_register_layers``, core/layer.py; the norms are the model's,
    ``ModelSpec.norm``), and the weights those add to the LLaMA layer's slots, each a name
    under ``layers.{i}.`` and its shape (replicated under tensor parallelism), e.g. the
    per-head q / k norms of Qwen3: ``slots=(("q_norm.weight", (128,)), ("k_norm.weight",
    (128,)))``."""

    attention: str = "llama"
    mlp: Optional[str] = None  # None: "gated" where the spec's gated_mlp, else "plain"
    slots: tuple[tuple[str, tuple[int, ...]], ...] = attrs.field(
        default=(), converter=_as_slots, validator=_layer_slots)

    @property
    def param_count(self) -> int:
        """Elements of the slots it declares."""
        return sum(math.prod(shape) for _, shape in self.slots)


_EVERY_LAYER = LayerSpec()


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
    sliding_window: Optional[int] = attrs.field(default=None, validator=_optional_size)
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

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def param_count(self) -> int:
        """Parameters of the fused model (embeddings counted once when tied)."""
        h, i = self.hidden_size, self.intermediate_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        mlp = h * i * (3 if self.gated_mlp else 2)
        norms = 2 * h * (2 if self.norm == "layer" else 1)
        biases = (self.q_size + 2 * self.kv_size) * self.qkv_bias + h * self.o_bias + \
            (i * (2 if self.gated_mlp else 1) + h) * self.mlp_bias
        per_layer = attn + mlp + norms + biases
        embed = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        pos = self.max_position * h if self.position == "learned" else 0
        declared = sum(x.param_count for x in self.layers)  # the slots LayerSpecs add
        return self.num_layers * per_layer + declared + embed + pos + \
            h * (2 if self.norm == "layer" else 1)


def split_qkv(qkv, num_heads: int, num_kv_heads: int, head_dim: int):
    """Views of a fused projection's rows: qkv [T, (Hq + 2 Hkv) D] -> q [T, Hq, D],
    k [T, Hkv, D], v [T, Hkv, D] (the fused slot's order, core.slots.slot_layout)."""
    t, q_size, kv_size = qkv.shape[0], num_heads * head_dim, num_kv_heads * head_dim
    return (qkv[:, :q_size].view(t, num_heads, head_dim),
            qkv[:, q_size:q_size + kv_size].view(t, num_kv_heads, head_dim),
            qkv[:, q_size + kv_size:].view(t, num_kv_heads, head_dim))
