"""The model's building blocks: projections (our own ``Linear`` or a quantiser's
``QuantizedLinear``) and what the fused decode GEMMs read of each (``gemm_operands``).
The layers made of them (attention, MLPs, norms) are registered implementations
(core/layer.py; the LLaMA ones: ``infergraft.policies.llama_layers``)."""
from __future__ import annotations

import inspect

import torch
from torch import nn

from .._moved import moved_names


class Linear(nn.Module):
    """y = x W^T + b (skinny Triton GEMM at decode on CUDA). Quantisers replace the module.
    ``partials``: the output feeds an add+RMSNorm, so it may come as split-K float32
    partial sums [S, T, N] that the norm adds up (kernels/linear.py)."""

    def __init__(self, ops, partials: bool = False):
        super().__init__()
        self.linear = ops.linear_partials if partials else ops.linear
        self.register_buffer("weight", None)
        self.register_buffer("bias", None)

    def forward(self, x):
        return self.linear(x, self.weight, self.bias)


class QuantizedLinear(nn.Module):
    """y = quantizer.matmul(x, packed) (+ b): a weight quantiser's packed projection
    (core/quant.py); ``core.build`` swaps it in for a ``Linear`` as the weight loads.
    ``keep_dense()``: the dequantised weight kept beside the packed form, and the dense
    GEMM on it instead (where the quantiser's ``dense_on`` the device)."""

    def __init__(self, quantizer, packed, bias, ops):
        super().__init__()
        self.quantizer, self.packed, self.linear = quantizer, packed, ops.linear
        self._kw = {"ops": ops} if "ops" in inspect.signature(quantizer.matmul).parameters else {}
        self.register_buffer("bias", bias)
        self.register_buffer("dense", None)

    def keep_dense(self) -> "QuantizedLinear":
        self.dense = self.quantizer.unpack(self.packed).contiguous()  # [N, K], packed.dtype
        return self

    def forward(self, x):
        if self.dense is not None:
            return self.linear(x, self.dense, self.bias)
        y = self.quantizer.matmul(x, self.packed, **self._kw)  # [T, K] -> [T, N]
        return y if self.bias is None else y + self.bias

    def scaled_rows(self):
        """(q [N, K] int8 or float8_e4m3fn, scale float32 [N]) when the quantiser packs that
        form (the fused decode GEMMs read it: ``Quantizer.scaled_rows``), else None."""
        return self.quantizer.scaled_rows(self.packed)

    def int4_groups(self):
        """The packed ``Int4Weight`` when the quantiser packs that form
        (``Quantizer.int4_groups``) and no dense copy is multiplied instead, else None."""
        return None if self.dense is not None else self.quantizer.int4_groups(self.packed)


def gemm_operands(lin):
    """(weight, bias, scale) of a projection for the fused decode GEMMs: a Linear's weight
    (scale None), a quantised one's 8-bit rows and their scales, or its ``Int4Weight``
    (scale None; ``reads_norm``); None if none of these."""
    if type(lin) is Linear:
        return lin.weight, lin.bias, None
    if not isinstance(lin, QuantizedLinear):
        return None
    rows = lin.scaled_rows()
    if rows is not None:
        return rows[0], lin.bias, rows[1]
    groups = lin.int4_groups()
    return None if groups is None else (groups, lin.bias, None)


def reads_norm(lin) -> bool:
    """Whether the fused decode GEMMs apply the input norm's weight to this projection's
    input in their prologue (int4 groups), rather than have it folded into its weight."""
    return isinstance(lin, QuantizedLinear) and lin.int4_groups() is not None


def row_sum_sq(h: torch.Tensor) -> torch.Tensor:
    # h: [T, H] -> the sum of squares of each row [1, T] float32 (the next norm's statistic)
    return h.float().square().sum(-1)[None]


__getattr__ = moved_names(__name__)  # names that moved out, for one release
