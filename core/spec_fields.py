"""The checked fields a ModelSpec is made of: sizes (integers >= 1, refused naming the
field and its config.json name) and the RoPE settings, ``RopeSpec``."""
from __future__ import annotations

import math
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
