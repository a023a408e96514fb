"""int8 weight-only quantiser (name ``int8``, W8A16): ``plugins=["paged", "int8"]``.

Every decoder layer's projection (qkv, o, gate_up or fc_in, down) is stored as int8 with
one float32 scale per output row (symmetric, ``kernels.int8_linear.quantize_int8``),
packed as the checkpoint streams in and multiplied by ``ops.int8_linear``, which widens
the int8 tiles in registers: decode reads about half the bytes of bf16. Embeddings, the
lm_head and norms stay in the model dtype. Where the fused decode layer runs (Triton,
16-bit), ``core.loading.packing.SlotPacker`` folds each RMSNorm weight into its projection before
packing, and the fused GEMMs read the int8 rows and scales (``scaled_rows``). On the CPU
the rows are widened to float32 a cache-sized chunk at a time (``cpu_linear``): float32's
speed with half its weight bytes; the format is for GPU decode, where the weight bytes
bound the step. ``INFERGRAFT_QUANT_MMA=1`` (read at build): 1-64 rows on
``kernels/fp8_mma.py``'s kernel for 8-bit rows (``int8_mma``), the fused layer's GEMMs on
its WORDS tiles; under its default ``auto`` the paths above.
"""
from __future__ import annotations

import attrs
import torch

from infergraft.core.hookspecs import hookimpl
from infergraft.core.quant import Quantizer
from infergraft.kernels.dispatch import get_op, resolve_backend
from infergraft.kernels.int8_linear import quantize_int8


@attrs.frozen
class Int8Weight:
    q: torch.Tensor  # [N, K] int8
    scale: torch.Tensor  # [N] float32
    dtype: torch.dtype  # of the weight it came from


class WeightInt8(Quantizer):
    name = "int8"
    applies_to = "weights"
    options = {}
    # |q s - w| <= s / 2 = max|row| / 254, plus unpack's rounding to a 16-bit dtype
    max_relative_error = 1.001 / 254 + 1 / 512

    def pack(self, weight):
        q, scale = quantize_int8(weight)
        return Int8Weight(q, scale, weight.dtype)

    def scaled_rows(self, packed):
        return packed.q, packed.scale  # the fused decode GEMMs read these directly

    def unpack(self, packed):
        return (packed.q.float() * packed.scale[:, None]).to(packed.dtype)

    def matmul(self, x, packed, ops=None):
        # x: [..., K] -> [..., N]; the engine's kernels, else by x's device
        op = ops.int8_linear if ops is not None else \
            get_op("int8_linear", resolve_backend(x.device))
        return op(x, packed.q, packed.scale)

    def packed_bytes(self, packed):
        return packed.q.numel() * packed.q.element_size() + 4 * packed.scale.numel()

    def packed_bytes_of(self, shape, element_bytes):
        rows, cols = shape
        return rows * cols + 4 * rows


@hookimpl
def infergraft_register_quantizers(register):
    register(WeightInt8())
