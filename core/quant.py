"""Quantiser contract: registered through ``infergraft_register_quantizers``.

A quantiser says what it applies to:

* ``applies_to = "weights"``: it packs weights and supplies the matmul that reads them
  (its methods are defined with the first weight quantiser; ``core.build`` does not
  call weight quantisers yet).
* ``applies_to = "kv"``: it changes how the KV cache stores K and V. It does no work of
  its own: ``core.build`` hands it to the cache backend (``create(..., kv_quantizer=q)``),
  and the backend quantises inside its KV-write kernel and dequantises inside its
  attention. A backend lists the K/V formats it can store in ``CacheBackend.quantized_kv``.
"""
from __future__ import annotations

from typing import Any

QUANTIZER_TARGETS = ("weights", "kv")


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
