"""RoPE settings from an HF config, and the cos/sin tables the rotary kernel reads.

Each scaling kind reproduces transformers' ``modeling_rope_utils`` on the same config:
``linear`` (positions divided by ``factor``), ``llama3`` (Llama 3.1's band-wise
division), ``yarn`` (NTK-by-parts between extrapolated and interpolated frequencies, cos
and sin scaled by the attention factor), ``longrope`` (Phi-3's per-frequency short and
long factors, two tables: ``rope_cos_sin`` lays them out, core/long_rope.py says which
one a sequence reads) and ``dynamic`` (NTK frequencies that HF recomputes each forward
past ``max_position_embeddings``: only the range where they are the default ones runs,
``check_rope_range``).
"""
from __future__ import annotations

import math
from typing import Optional

import attrs
import torch

from .errors import UnsupportedModelError
from .spec import RopeSpec

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")
#: older names HF reads as these (Phi-3's first configs said "su")
ROPE_TYPE_ALIASES = {"su": "longrope"}
#: kinds whose original_max_position_embeddings HF takes from the config's top level first
_ORIGINAL_LENGTH_KINDS = ("llama3", "yarn", "longrope")


def rope_from_config(config, head_dim: int) -> RopeSpec:
    """Read ``config.rope_parameters`` (transformers 5), falling back to the 4.x fields."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if not params:  # transformers 4.x style
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    rope_type = ROPE_TYPE_ALIASES.get(rope_type, rope_type)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    partial = float(params.get("partial_rotary_factor",
                               getattr(config, "partial_rotary_factor", 1.0) or 1.0))
    max_position = getattr(config, "max_position_embeddings", 8192)
    original = params.get("original_max_position_embeddings")
    if rope_type in _ORIGINAL_LENGTH_KINDS and \
            getattr(config, "original_max_position_embeddings", None) is not None:
        original = config.original_max_position_embeddings  # Phi-3 keeps it there (HF's order)
    if rope_type == "dynamic":  # HF scales from max_position_embeddings
        original = max_position
    spec = RopeSpec(
        theta=float(params.get("rope_theta", 10000.0)),
        type=rope_type,
        factor=float(params.get("factor", 1.0) or 1.0),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=int(original or max_position),
        rotary_dim=None if partial >= 1.0 else int(head_dim * partial),
    )
    if rope_type == "yarn":
        return _yarn_spec(spec, params, max_position)
    if rope_type == "longrope":
        return _longrope_spec(spec, params, max_position, head_dim)
    return spec


def _yarn_spec(spec: RopeSpec, params: dict, max_position: int) -> RopeSpec:
    """HF ``_compute_yarn_parameters``: factor (else max / original positions), the
    attention factor (given, else from mscale / mscale_all_dim, else 0.1 ln(factor) + 1)."""
    factor = params.get("factor")
    factor = float(max_position / spec.original_max_position if factor is None else factor)
    attention = params.get("attention_factor")
    if attention is None:
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all) \
            if mscale and mscale_all else yarn_mscale(factor)
    return attrs.evolve(spec, factor=factor, attention_factor=float(attention),
                        beta_fast=float(params.get("beta_fast") or 32),
                        beta_slow=float(params.get("beta_slow") or 1),
                        truncate=bool(params.get("truncate", True)))


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature (HF ``yarn_get_mscale``): 0.1 mscale ln(scale) + 1."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _longrope_spec(spec: RopeSpec, params: dict, max_position: int, head_dim: int) -> RopeSpec:
    """HF ``_compute_longrope_parameters``: both factor lists (rotary_dim / 2 numbers
    each), the attention factor (given, else sqrt(1 + ln(s) / ln(original)) with s the
    ``factor``, else max / original positions)."""
    half = (spec.rotary_dim or head_dim) // 2
    lists = {}
    for name in ("short_factor", "long_factor"):
        values = params.get(name)
        if not isinstance(values, (list, tuple)) or len(values) != half or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0
                for x in values):
            raise UnsupportedModelError(
                f"rope_type 'longrope' needs rope_parameters[{name!r}]: {half} positive "
                f"numbers (one per rotary frequency, rotary_dim / 2), got {values!r}")
        lists[name] = tuple(float(x) for x in values)
    factor = params.get("factor")
    factor = float(max_position / spec.original_max_position if factor is None else factor)
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(
            1 + math.log(factor) / math.log(spec.original_max_position))
    return attrs.evolve(spec, factor=factor, attention_factor=float(attention), **lists)


def check_rope_range(rope: Optional[RopeSpec], max_seq_len: int, max_position: int) -> None:
    """UnsupportedModelError where sequences of ``max_seq_len`` tokens would leave the
    range in which we match HF: ``dynamic`` past ``max_position_embeddings``."""
    if rope is None or rope.type != "dynamic" or max_seq_len <= max_position:
        return
    raise UnsupportedModelError(
        f"rope_type 'dynamic' (dynamic NTK scaling) runs here only up to "
        f"max_position_embeddings={max_position} tokens, where its frequencies are the "
        f"default ones; past it HF recomputes them at every forward from the sequence's "
        f"length, while the keys already cached keep their old rotation, which K/V written "
        f"once cannot reproduce. Build with max_seq_len <= {max_position} (asked: "
        f"{max_seq_len}); supported scalings at any length: default, linear, llama3, yarn, "
        f"longrope")


def inv_frequencies(rope: RopeSpec, head_dim: int) -> torch.Tensor:
    """The rotary frequencies [rotary_dim / 2] (longrope: those of its short factors)."""
    if rope.type == "yarn":
        return yarn_inv_frequencies(rope, head_dim)
    if rope.type == "longrope":
        return longrope_inv_frequencies(rope, head_dim, rope.short_factor)
    dim, base = rope.rotary_dim or head_dim, rope.theta
    if rope.type == "dynamic":  # HF's NTK base at max_position_embeddings: theta, rounded as HF
        m = rope.original_max_position
        base = base * ((rope.factor * m / m) - (rope.factor - 1)) ** (dim / (dim - 2))
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
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


def yarn_inv_frequencies(rope: RopeSpec, head_dim: int) -> torch.Tensor:
    """YaRN (NTK-by-parts): high frequencies extrapolated, low ones interpolated by
    ``factor``, a linear ramp between the dims that turn ``beta_fast`` and ``beta_slow``
    times over ``original_max_position`` tokens."""
    dim, base = rope.rotary_dim or head_dim, rope.theta

    def correction_dim(rotations: float) -> float:
        return dim * math.log(rope.original_max_position / (rotations * 2 * math.pi)) / (
            2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singularity (as HF)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1 - ramp
    return (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolation) + \
        (1.0 / pos_freqs) * extrapolation


def longrope_inv_frequencies(rope: RopeSpec, head_dim: int, factors) -> torch.Tensor:
    """1 / (factor_i theta^(2i / rotary_dim)): one of LongRoPE's two sets."""
    dim = rope.rotary_dim or head_dim
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * rope.theta ** shape)


def _table(inv: torch.Tensor, positions: int, scale: float):
    freqs = torch.outer(torch.arange(positions, dtype=torch.float32), inv)
    return freqs.cos() * scale, freqs.sin() * scale


def long_rope_boundary(rope: Optional[RopeSpec], max_position: int) -> Optional[int]:
    """LongRoPE's ``original_max_position`` where sequences of ``max_position`` tokens
    can pass it (both of its tables are then in use), else None."""
    if rope is None or rope.type != "longrope" or max_position <= rope.original_max_position:
        return None
    return rope.original_max_position


def rope_cos_sin(rope: RopeSpec, head_dim: int, max_position: int, device=None):
    """cos, sin: [rows, rotary_dim / 2] float32, row p for position p; longrope past its
    ``long_rope_boundary`` b: b rows of the short factors, then ``max_position`` rows of
    the long ones (position p of a long sequence reads row b + p: ``table_rows``)."""
    boundary = long_rope_boundary(rope, max_position)
    if boundary is not None:
        short = _table(longrope_inv_frequencies(rope, head_dim, rope.short_factor), boundary,
                       rope.attention_factor)
        long = _table(longrope_inv_frequencies(rope, head_dim, rope.long_factor), max_position,
                      rope.attention_factor)
        cos, sin = torch.cat([short[0], long[0]]), torch.cat([short[1], long[1]])
    else:
        cos, sin = _table(inv_frequencies(rope, head_dim), max_position, rope.attention_factor)
    return cos.to(device), sin.to(device)


def table_rows(positions: torch.Tensor, boundary: int, long_rows=None) -> torch.Tensor:
    """The rows of ``rope_cos_sin``'s two-table layout that positions [T] read: b + p at
    and past the boundary b and where ``long_rows`` [T] (bool) is set, else p."""
    long = positions >= boundary
    if long_rows is not None:
        long = long | long_rows
    return positions + boundary * long
