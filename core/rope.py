"""RoPE settings from an HF config, and the cos/sin tables the rotary kernel reads."""
from __future__ import annotations

import math

import torch

from .errors import UnsupportedModelError
from .spec import RopeSpec

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_from_config(config, head_dim: int) -> RopeSpec:
    """Read ``config.rope_parameters`` (transformers 5), falling back to the 4.x fields."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if not params:  # transformers 4.x style
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    partial = float(params.get("partial_rotary_factor",
                               getattr(config, "partial_rotary_factor", 1.0) or 1.0))
    return RopeSpec(
        theta=float(params.get("rope_theta", 10000.0)),
        type=rope_type,
        factor=float(params.get("factor", 1.0) or 1.0),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=int(params.get("original_max_position_embeddings",
                                             getattr(config, "max_position_embeddings", 8192))),
        rotary_dim=None if partial >= 1.0 else int(head_dim * partial),
    )


def inv_frequencies(rope: RopeSpec, head_dim: int) -> torch.Tensor:
    dim = rope.rotary_dim or head_dim
    inv = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope.type == "linear":
        inv = inv / rope.factor
    elif rope.type == "llama3":  # Llama 3.1 frequency-dependent scaling
        low_wl = rope.original_max_position / rope.low_freq_factor
        high_wl = rope.original_max_position / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wl, inv / rope.factor, inv)
        smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
        inv = torch.where(medium, smoothed, scaled)
    return inv


def rope_cos_sin(rope: RopeSpec, head_dim: int, max_position: int, device=None):
    """cos, sin: [max_position, rotary_dim / 2] float32."""
    inv = inv_frequencies(rope, head_dim)
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv)
    return freqs.cos().to(device), freqs.sin().to(device)
