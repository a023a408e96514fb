"""Checkpoints already in fp8 (config.json's ``quantization_config`` with ``quant_method``
"fp8": AutoFP8's, llm-compressor's and vLLM's layout) loaded into the ``fp8`` quantiser's
format (``kernels.fp8_linear.Fp8Weight``: e4m3 rows with a float32 scale per row).

Each quantised projection ``P`` is ``P.weight`` float8_e4m3fn [N, K] beside
``P.weight_scale`` (float32), w = weight * weight_scale, the scale either

* per tensor: a scalar ([] or [1]), given to every row (fused q, k and v each keep their
  own), or
* per channel: [N] or [N, 1].

Refused by key, before any tensor is read: ``weight_block_size`` (DeepSeek-style blocks,
scales ``P.weight_scale_inv`` [N/128, K/128]: one scale per row cannot hold them without
rounding the weights again), ``fmt`` other than "e4m3", ``ignored_layers`` /
``modules_to_not_convert`` naming anything but the lm_head, ``kv_cache_scheme`` (fp8 K/V
scales, which no cache reads yet). As the tensors stream: a ``weight_scale_inv``, an e5m2
weight, a scale of another shape.

``activation_scheme``: "dynamic" as is; "static" (a calibrated per-tensor ``P.input_scale``)
is accepted with a ``ConfigWarning`` and its input scales dropped: infergraft's W8A8 path
scales each token by its own amax, which covers whatever a static scale covers, at a
finer grain, and decode keeps x in 16-bit.
"""
from __future__ import annotations

import warnings
from typing import Iterable, Iterator, Optional

import attrs
import torch

from ..errors import ConfigWarning, QuantizedCheckpointError, WeightLoadError

ACTIVATION_SCHEMES = ("dynamic", "static")
PARTS = ("weight", "weight_scale")
DROPPED = ("input_scale",)  # static activation scales (module docstring)


def _refuse(key: str, value, accepted: str):
    raise QuantizedCheckpointError(f"quantization_config {key}={value!r} is not supported: "
                                   f"infergraft loads {accepted}")


@attrs.frozen
class Fp8Format:
    activation_scheme: str = "dynamic"
    method = "fp8"
    quantizer = "fp8"  # the weight quantiser whose format the projections load in
    label = "fp8, e4m3"

    def stream(self, tensors):
        return fp8_tensors(tensors, self)


def fp8_format(qc: dict) -> Fp8Format:
    """The format of a ``quant_method: fp8`` quantization_config, or a
    ``QuantizedCheckpointError`` naming the key it cannot hold."""
    accepted = "fp8 checkpoints with e4m3 weights and a per-tensor or per-channel weight_scale"
    if qc.get("weight_block_size") is not None:
        _refuse("weight_block_size", qc.get("weight_block_size"),
                f"{accepted} (block-wise scales, weight_scale_inv, are not read)")
    if str(qc.get("fmt", "e4m3")).lower() != "e4m3":
        _refuse("fmt", qc.get("fmt"), accepted)
    scheme = str(qc.get("activation_scheme", "dynamic")).lower()
    if scheme not in ACTIVATION_SCHEMES:
        _refuse("activation_scheme", qc.get("activation_scheme"),
                f"{accepted}, activation_scheme 'dynamic' or 'static'")
    for key in ("ignored_layers", "modules_to_not_convert"):
        kept = [m for m in qc.get(key) or () if str(m).rpartition(".")[2] != "lm_head"]
        if kept:
            _refuse(key, qc.get(key), f"{accepted} on every decoder projection (only "
                                      "'lm_head' may be left unquantised)")
    if qc.get("kv_cache_scheme"):
        _refuse("kv_cache_scheme", qc.get("kv_cache_scheme"),
                f"{accepted}; fp8 K/V cache scales are not read (drop the key: K/V stay "
                "in the model dtype)")
    if scheme == "static":
        warnings.warn(ConfigWarning(
            "quantization_config activation_scheme='static': the checkpoint's input_scale "
            "tensors are ignored; infergraft scales activations per token, dynamically"),
            stacklevel=4)
    return Fp8Format(scheme)


@attrs.frozen
class PrequantizedFp8:
    """One projection of an fp8 checkpoint, not yet an ``Fp8Weight`` (the build's dtype
    and device come at loading). ``shape``: the dense weight's, [N, K]."""

    q: torch.Tensor  # [N, K] float8_e4m3fn
    scale: torch.Tensor  # [N] float32
    dtype: Optional[torch.dtype] = None
    prequantized = True  # what load_weights and SlotPacker look for

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def to(self, device=None, dtype=None) -> "PrequantizedFp8":
        return attrs.evolve(self, q=self.q.to(device), scale=self.scale.to(device),
                            dtype=dtype or self.dtype)

    @staticmethod
    def cat(parts: list["PrequantizedFp8"]) -> "PrequantizedFp8":
        """Fused parts (q, k, v) stacked along N: one slot's weight (rows are independent)."""
        if len({p.q.shape[1] for p in parts}) != 1:
            raise QuantizedCheckpointError("the parts of a fused projection differ in "
                                           f"in_features: {[p.shape for p in parts]}")
        return attrs.evolve(parts[0], q=torch.cat([p.q for p in parts]),
                            scale=torch.cat([p.scale for p in parts]))

    def packed(self):
        """The ``kernels.fp8_linear.Fp8Weight`` the ``fp8`` quantiser multiplies by."""
        from infergraft.kernels.fp8_linear import Fp8Weight

        return Fp8Weight(self.q.contiguous(), self.scale.contiguous(),
                         self.dtype or torch.float32)


def convert(name: str, parts: dict) -> PrequantizedFp8:
    """``P.weight`` e4m3 and ``P.weight_scale`` -> a ``PrequantizedFp8`` with a scale a row."""
    q, s = parts["weight"], parts["weight_scale"]
    if q.dtype != torch.float8_e4m3fn:
        raise QuantizedCheckpointError(f"{name}.weight is {q.dtype} beside a weight_scale; "
                                       "an fp8 projection's weight is float8_e4m3fn")
    if q.dim() != 2:
        raise QuantizedCheckpointError(f"{name}.weight is {tuple(q.shape)}: an fp8 projection "
                                       "is an [out, in] matrix")
    n = q.shape[0]
    if not s.is_floating_point() or s.element_size() < 2:
        raise QuantizedCheckpointError(f"{name}.weight_scale is {s.dtype}; the format needs "
                                       "float32 (or 16-bit) scales")
    if s.numel() == 1 and s.dim() <= 1:  # per tensor
        scale = s.float().reshape(1).expand(n)
    elif tuple(s.shape) in ((n,), (n, 1)):  # per channel
        scale = s.float().reshape(n)
    else:
        raise QuantizedCheckpointError(
            f"{name}.weight_scale is {tuple(s.shape)}; infergraft loads a per-tensor ([] or "
            f"[1]) or per-channel ([{n}] or [{n}, 1]) scale, not block-wise ones")
    return PrequantizedFp8(q.contiguous(), scale.contiguous())


def fp8_tensors(tensors: Iterable[tuple[str, torch.Tensor]],
                fmt: Fp8Format) -> Iterator[tuple[str, object]]:
    """A checkpoint's stream with each e4m3 ``P.weight`` and its ``P.weight_scale``
    replaced, once both are in, by one ``PrequantizedFp8`` under ``P.weight``; dense
    tensors (embeddings, norms, the lm_head) pass as they are, input scales are dropped."""
    pending: dict[str, dict] = {}
    for key, tensor in tensors:
        name, _, leaf = key.rpartition(".")
        if leaf == "weight_scale_inv":
            raise QuantizedCheckpointError(
                f"{key}: a block-wise scale (DeepSeek-style, weight_block_size); infergraft "
                "loads fp8 checkpoints with a per-tensor or per-channel weight_scale")
        if leaf in DROPPED and name:
            continue
        if leaf == "weight" and tensor.dtype != torch.float8_e4m3fn:
            if tensor.dtype == torch.float8_e5m2:
                raise QuantizedCheckpointError(f"{key} is float8_e5m2; infergraft loads e4m3 "
                                               "(float8_e4m3fn) fp8 weights")
            if name not in pending:
                yield key, tensor  # a dense weight
                continue
        if leaf not in PARTS or not name:
            yield key, tensor
            continue
        group = pending.setdefault(name, {})
        if leaf in group:
            raise WeightLoadError(f"weight {key!r} arrived twice")
        group[leaf] = tensor
        if len(group) == len(PARTS):
            yield f"{name}.weight", convert(name, pending.pop(name))
    for name, group in pending.items():
        missing = [f"{name}.{p}" for p in PARTS if p not in group]
        raise WeightLoadError(f"fp8 projection {name!r} lacks {', '.join(missing)} (an e4m3 "
                              "weight and its weight_scale come in pairs)")
