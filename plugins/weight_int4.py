"""int4 weight-only quantiser (name ``int4``, W4A16): ``plugins=["paged", "int4"]``,
``group_size=`` 128 (default), 64 or 32.

Every decoder layer's projection (qkv, o, gate_up or fc_in, down) is stored as 4-bit
codes, two a byte, with a float32 scale and a uint8 zero-point per row and group of
``group_size`` input columns (asymmetric round to nearest at load time,
``kernels.int4_linear.quantize_int4``; the format, ``Int4Weight``, is what the GPTQ / AWQ
loaders convert into; an act-order GPTQ checkpoint's codes come reordered by group, and
its ``perm`` gathers x's columns the same way before the product). ``ops.int4_linear`` unpacks the nibbles in registers: about a
quarter of bf16's weight bytes (plus 5 bytes a group). Embeddings, the lm_head and norms
stay in the model dtype. The norms stay unfolded (``core.loading.packing.SlotPacker``
folds norms into 8-bit rows only: W g's groups would widen with the norm's outliers); the
fused decode layer reads the packed form as loaded (``int4_groups``) and applies each
norm's weight to x as its GEMM loads it (kernels/int4_fused.py; more than 8 rows: the
composition of kernels/int4_fused_ops.py). ``INFERGRAFT_QUANT_MMA`` (read at build): groups
of 128 at 16-64 rows (its default ``auto``; ``1``: 1-64 rows) on ``kernels/int4_mma.py``'s
tensor-core kernel, which reads this format as loaded; a GPTQ act-order down projection's
order lives in gate_up's rows (``core.loading.prequantized.fold_act_orders``).

On the CPU (``dense_on``) each projection is also dequantised once as it loads and
multiplied by the dense GEMM (``kernels/cpu_linear.py``): the reference's unpacking at
every call made a token of the demo model take many times float32's. int4 saves no
memory there: the packed form stays beside its copy in the model's dtype (the plan
counts both); its kernels are for the GPU.
"""
from __future__ import annotations

import math

import torch

from infergraft.core.errors import PlanError
from infergraft.core.hookspecs import hookimpl
from infergraft.core.quant import Quantizer
from infergraft.kernels import switches
from infergraft.kernels.dispatch import get_op, resolve_backend
from infergraft.kernels.int4_linear import (GROUP_SIZES, Int4Weight, dequantize_int4,
                                            quantize_int4)

__all__ = ["WeightInt4", "Int4Weight"]


class WeightInt4(Quantizer):
    name = "int4"
    applies_to = "weights"
    options = {"group_size": 128}
    # |(q - z) s - w| <= s / 2 = (max - min) / 30 <= max|group| / 15, plus unpack's
    # rounding to a 16-bit dtype
    max_relative_error = 1.001 / 15 + 1 / 512

    def __init__(self, group_size: int = 128):
        if isinstance(group_size, bool) or group_size not in GROUP_SIZES:
            raise PlanError(f"quantizer 'int4': group_size={group_size!r} is not accepted; "
                            f"choose one of {', '.join(map(str, GROUP_SIZES))}")
        self.group_size = group_size
        # the fused decode layer's int4 GEMMs, read at build (INFERGRAFT_INT4_FUSED)
        self.fused = bool(switches.value("INFERGRAFT_INT4_FUSED"))

    def configured(self, group_size: int = 128) -> "WeightInt4":
        return WeightInt4(group_size)  # (a fresh one a build: INFERGRAFT_INT4_FUSED is read now)

    def pack(self, weight) -> Int4Weight:
        return quantize_int4(weight, self.group_size)

    def unpack(self, packed):
        w = dequantize_int4(packed)  # [N, K], columns in the packed order
        if packed.perm is None:
            return w
        return torch.empty_like(w).index_copy_(1, packed.perm, w)  # back to the input's

    def int4_groups(self, packed):
        # the fused decode layer's int4 GEMMs read it as loaded (INFERGRAFT_INT4_FUSED=1)
        return packed if self.fused else None

    def dense_on(self, device, kernels) -> bool:
        return device.type == "cpu" and kernels == "torch"  # not Triton's interpreter

    def matmul(self, x, packed, ops=None):
        # x: [..., K] -> [..., N]; the engine's kernels, else by x's device
        op = ops.int4_linear if ops is not None else \
            get_op("int4_linear", resolve_backend(x.device))
        if packed.perm is not None:  # an act-order checkpoint: x's columns in its order
            x = x.index_select(-1, packed.perm)
        return op(x, packed.qweight, packed.scales, packed.zeros, packed.group_size,
                  packed.in_features)

    def packed_bytes(self, packed):
        return sum(t.numel() * t.element_size()
                   for t in (packed.qweight, packed.scales, packed.zeros, packed.perm)
                   if t is not None)

    def packed_bytes_of(self, shape, element_bytes):
        rows, cols = shape
        groups = math.ceil(cols / self.group_size)
        return rows * math.ceil(cols / 2) + rows * groups * (4 + 1)  # nibbles, scale, zero


@hookimpl
def infergraft_register_quantizers(register):
    register(WeightInt4())
