"""K/V storage of the contiguous cache: per layer, rows ``[R, Hkv, S, D]``.

Float K/V are kept in the model dtype. With the ``kv-int8`` or ``kv-fp8`` quantiser they
are int8 or e4m3 plus one float32 scale per (row, head, column), ``[R, Hkv, S]``: quantised inside the KV-write
kernel (``ops.kv_write_quant``), dequantised by ``load`` before host attention, or inside
``ops.paged_attention`` (which takes the scales) on the device decode path.
"""
from __future__ import annotations

import torch

from infergraft.kernels.kv_write import quantize_kv_torch


class RowStore:
    def __init__(self, num_layers, shape, *, dtype, device, ops, kv_dtype=None):
        # kv_dtype: the quantised storage (torch.int8 or float8_e4m3fn), None for float K/V
        self.dtype, self.ops, self.kv_dtype = dtype, ops, kv_dtype
        self.quant = quant = kv_dtype is not None

        def pool(shp, dt):
            return [torch.zeros(shp, dtype=dt, device=device) for _ in range(num_layers)]
        self.k = pool(shape, kv_dtype or dtype)  # [R, Hkv, S, D] per layer
        self.v = pool(shape, kv_dtype or dtype)
        self.k_scale = pool(shape[:3], torch.float32) if quant else None  # [R, Hkv, S]
        self.v_scale = pool(shape[:3], torch.float32) if quant else None

    def pools(self):
        return [p for p in (self.k, self.v, self.k_scale, self.v_scale) if p is not None]

    def views(self, layer):
        """The kernels' (row, column) layout: K, V as [R, S, Hkv, D], scales [R, S, Hkv]
        (None for float K/V). Views, not copies: writes through them land in storage."""
        k, v = self.k[layer].permute(0, 2, 1, 3), self.v[layer].permute(0, 2, 1, 3)
        if not self.quant:
            return k, v, None, None
        return k, v, self.k_scale[layer].permute(0, 2, 1), self.v_scale[layer].permute(0, 2, 1)

    def write(self, layer, k, v, rows, cols) -> None:
        """k, v: [T, Hkv, D] -> storage[rows[t], :, cols[t]] (quantised when int8 / e4m3)."""
        kc, vc, ks, vs = self.views(layer)
        if self.quant:
            self.ops.kv_write_quant(k, v, kc, vc, ks, vs, rows, cols)
        else:
            self.ops.kv_write(k, v, kc, vc, rows, cols)

    def load(self, layer, rows, cols):
        """K, V at storage[rows, :, cols] in the model dtype: [r, Hkv, c, D] each.
        ``rows`` / ``cols`` are slices (a view for float K/V) or index tensors."""
        k, v = self.k[layer][rows, :, cols], self.v[layer][rows, :, cols]
        if self.quant:
            k = self._dequant(k, self.k_scale[layer][rows, :, cols])
            v = self._dequant(v, self.v_scale[layer][rows, :, cols])
        return k, v

    def as_stored(self, x):
        """Fresh x [T, Hkv, D] as attention will see it once written: unchanged for float,
        the quantised round trip (the kernel's exact math) otherwise. For paths that attend
        before they write, so that every path attends over the same values."""
        return self._dequant(*quantize_kv_torch(x, self.kv_dtype)) if self.quant else x

    def _dequant(self, q, scale):
        return (q.float() * scale[..., None]).to(self.dtype)

    def copy_row(self, src: int, dst: int) -> None:
        for pool in self.pools():
            for t in pool:
                t[dst].copy_(t[src])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pool in self.pools() for t in pool)
