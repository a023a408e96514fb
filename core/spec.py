"""ModelSpec: what the engine needs to know about a decoder, taken from the HF config.

A spec refuses sizes that are not integers >= 1 (UnsupportedModelError naming the field),
so that no policy, built-in or third-party, hands the planner or the model a config that
would plan negative bytes or build empty tensors.
"""
from __future__ import annotations

import numbers
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
    norm: str = "rms"  # rms | layer
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

    def __attrs_post_init__(self):
        # after the validators: both are integers >= 1 here
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"{self.architecture}: num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}; accepted: num_key_value_heads dividing "
                "num_attention_heads (grouped-query attention shares each K/V head among "
                "num_heads / num_kv_heads query heads)")

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
        return self.num_layers * per_layer + embed + pos + h * (2 if self.norm == "layer" else 1)


def split_qkv(qkv, num_heads: int, num_kv_heads: int, head_dim: int):
    """Views of a fused projection's rows: qkv [T, (Hq + 2 Hkv) D] -> q [T, Hq, D],
    k [T, Hkv, D], v [T, Hkv, D] (the fused slot's order, core.slots.slot_layout)."""
    t, q_size, kv_size = qkv.shape[0], num_heads * head_dim, num_kv_heads * head_dim
    return (qkv[:, :q_size].view(t, num_heads, head_dim),
            qkv[:, q_size:q_size + kv_size].view(t, num_kv_heads, head_dim),
            qkv[:, q_size + kv_size:].view(t, num_kv_heads, head_dim))
