"""Quantiser contract: registered through ``infergraft_register_quantizers``.

A quantiser says what it applies to:

* ``applies_to = "weights"``: it packs weights and supplies the matmul that reads them
  (the contract of ``core.testing.quant_kit``: ``max_relative_error``, ``pack``,
  ``unpack``, ``matmul``, ``packed_bytes``). While ``core.build`` streams the checkpoint,
  each weight slot it ``quantizes`` is packed as soon as it fills (one tensor at a time:
  no full-precision copy of the model is ever held) and its ``Linear`` becomes a
  ``core.runner.model.QuantizedLinear`` calling ``matmul(x, packed)`` (with ``ops=``, the
  engine's kernels, when the method takes that keyword), or, on a device where
  ``dense_on`` says so, the GEMM on its dequantised weight kept beside the packed form.
  ``packed_bytes_of`` sizes the memory plan before any weight loads. At most one per engine.
* ``applies_to = "kv"``: it changes how the KV cache stores K and V. It does no work of
  its own: ``core.build`` hands it to the cache backend (``create(..., kv_quantizer=q)``),
  and the backend quantises inside its KV-write kernel and dequantises inside its
  attention. A backend lists the K/V formats it can store in ``CacheBackend.quantized_kv``.
"""
from __future__ import annotations

import math
import re
import warnings
from typing import Any

import torch

from ._moved import moved_names
from .slots import slot_layout

QUANTIZER_TARGETS = ("weights", "kv")
_PROJECTION = re.compile(r"^layers\.\d+\.(qkv|o|gate_up|fc_in|down|experts_gate_up|experts_down)"
                         r"\.weight$")


class Quantizer:
    name: str = ""
    #: "weights" or "kv" (see the module docstring)
    applies_to: str = "weights"
    #: plugin options it accepts in ``core.build(..., **options)``, with defaults
    options: dict[str, Any] = {}

    # -- K/V quantisers ------------------------------------------------------------------
    #: storage format of K and V, e.g. "int8" (matched against CacheBackend.quantized_kv)
    kv_dtype: str = ""
    #: bytes of scale (and zero point) stored per token, per head, for K and again for V
    kv_scale_bytes: int = 0
    #: bytes of one stored K or V element
    kv_element_bytes: int = 1

    def kv_bytes_per_token(self, spec) -> int:
        """K and V bytes one token occupies across all layers, scales included."""
        per_head = spec.head_dim * self.kv_element_bytes + self.kv_scale_bytes
        return 2 * spec.num_layers * spec.num_kv_heads * per_head

    def configured(self, **options) -> "Quantizer":
        """This quantiser for a build's ``options`` (those of ``options`` above it was
        given; unknown ones never reach here). A quantiser with options returns a copy set
        up for them, refusing a bad value with a ``PlanError``; the default: itself."""
        return self

    # -- weight quantisers (see core.testing.quant_kit for pack / unpack / matmul) -------
    def quantizes(self, slot: str) -> bool:
        """Whether ``core.build`` packs this weight slot: by default every decoder layer's
        projection (qkv, o, gate_up or fc_in, down; a mixture of experts' stacked expert
        matrices, each row an expert's); embeddings, lm_head, norms and routers stay."""
        return bool(_PROJECTION.search(slot))

    def __init_subclass__(cls, **kw):
        # ``int8_rows`` was this hook's name: a plugin still defining only it would lose
        # the fused decode layer without a word, so it is read as ``scaled_rows``, warned
        super().__init_subclass__(**kw)
        if "int8_rows" in vars(cls) and "scaled_rows" not in vars(cls):
            warnings.warn(f"{cls.__qualname__}.int8_rows is now called scaled_rows (int8 "
                          "or float8_e4m3fn rows); rename it", DeprecationWarning, stacklevel=2)
            cls.scaled_rows = cls.int8_rows

    def scaled_rows(self, packed):
        """``packed`` as 8-bit rows with a float32 scale each, (q [N, K] ``torch.int8`` or
        ``torch.float8_e4m3fn``, scale float32 [N]), weight = q.float() * scale[:, None],
        when it is that form: the fused decode GEMMs then read it directly (norm weights
        folded in before packing). None (the default): the plain decode layer runs."""
        return None

    def int4_groups(self, packed):
        """``packed`` as a ``kernels.int4_format.Int4Weight`` (4-bit codes, a scale and a
        zero-point per group of columns) when it is that form: the fused decode GEMMs then
        read it, the input norm's weight applied in their prologue (not folded in: W g's
        groups would widen with the norm's outliers). None (the default)."""
        return None

    def dense_on(self, device: torch.device, kernels: str) -> bool:
        """Whether ``core.build`` also keeps each packed projection's dequantised weight
        (``unpack``, in the model's dtype) on ``device`` and multiplies by that, the dense
        GEMM, instead of ``matmul``: where ``matmul`` on those ``kernels`` ("torch", the
        references; "triton") runs slower than the dense GEMM. The memory plan then
        counts both forms. Default: never."""
        return False

    def packed_bytes_of(self, shape: tuple, element_bytes: int) -> int:
        """Bytes ``pack`` makes of a weight of ``shape`` (default: as dense; override)."""
        return math.prod(shape) * element_bytes

    def held_bytes_of(self, shape: tuple, element_bytes: int, device=None,
                      kernels: str | None = None) -> int:
        """Bytes a packed projection of ``shape`` holds on ``device``: the packed form, and
        the dequantised copy where ``dense_on`` (no device: the packed form; no
        ``kernels``: the device's default, Triton on CUDA and the references elsewhere)."""
        if device is not None:
            device = torch.device(device)
            kernels = kernels or ("triton" if device.type == "cuda" else "torch")
        dense = device is not None and self.dense_on(device, kernels)
        return self.packed_bytes_of(shape, element_bytes) + \
            (math.prod(shape) * element_bytes if dense else 0)

    def weight_bytes(self, spec, element_bytes: int, device=None,
                     kernels: str | None = None) -> int:
        """Bytes of all the model's weights with the slots it ``quantizes`` packed (on
        ``device``: with the dequantised copies it keeps there, ``held_bytes_of``)."""
        dense = packed = 0
        for slot, (shape, _) in slot_layout(spec).items():
            if self.quantizes(slot):
                packed += self.held_bytes_of(shape, element_bytes, device, kernels)
                dense += math.prod(shape)
        return packed + (spec.param_count - dense) * element_bytes


__getattr__ = moved_names(__name__)  # names that moved out, for one release
