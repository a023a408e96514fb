"""fp8 weight quantiser (name ``fp8``): ``plugins=["paged", "fp8"]``.

Every decoder layer's projection (qkv, o, gate_up or fc_in, down) is stored as e4m3
(``torch.float8_e4m3fn``) with one float32 scale per output row, s = max|w_row| / 448
(``kernels.fp8_linear.quantize_fp8``), packed as the checkpoint streams in; a checkpoint
already in fp8 (``quant_method: fp8``) loads into the same format
(``core/loading/fp8_checkpoint.py``). Embeddings, the lm_head and norms stay in the model
dtype. ``ops.fp8_linear`` multiplies: on a GPU with fp8 (sm_89+) decode widens the e4m3
tiles in registers (half bf16's weight bytes) and prefill runs W8A8 on the fp8 tensor
cores with a per-token activation scale; on older GPUs the reference dequantises and runs
the float GEMM; on the CPU (``dense_on``) each projection is dequantised once as it loads
and multiplied by the dense GEMM (widening e4m3 at every call made a token several times
float32's), its copy beside the packed form. Either way the build warns once
(``PerformanceWarning``): neither is fp8's speed nor its memory.
The packed form is 8-bit rows with a scale each (``scaled_rows``), so where the fused
decode layer runs (Triton, 16-bit) ``core.loading.packing.SlotPacker`` folds each RMSNorm
weight into its projection before packing (e4m3 rounds each element relative to itself
but in the subnormal tail, so a column's norm weight costs the others little), and the
fused GEMMs read the e4m3 rows and scales: int8's tiles, the e4m3 widened in registers
(never int8's one-row word loop). A checkpoint already in fp8 keeps its projections and
norms as stored: the plain layer. ``INFERGRAFT_QUANT_MMA=1`` (read at build): 1-64 rows
on ``kernels/fp8_mma.py``'s tensor-core kernel, the fused layer's GEMMs on its WORDS tiles
(e4m3 widened by bit tricks); under its default ``auto`` the paths above.
"""
from __future__ import annotations

import warnings

import torch

from infergraft.core.errors import PerformanceWarning
from infergraft.core.hookspecs import hookimpl
from infergraft.core.quant import Quantizer
from infergraft.kernels.dispatch import get_op, resolve_backend
from infergraft.kernels.fp8_linear import Fp8Weight, dequantize_fp8, fp8_native, quantize_fp8

__all__ = ["WeightFp8", "Fp8Weight"]

_warned: set[str] = set()  # devices already warned about (once per process each)


class WeightFp8(Quantizer):
    name = "fp8"
    applies_to = "weights"
    options = {}
    # e4m3 keeps 3 mantissa bits: a normal value v = w / s (|v| <= 448) rounds by at most
    # 2^-4 |v|, a subnormal one (|v| < 2^-6) by 2^-10; the largest step is the top
    # binade's [256, 448], spacing 32, so |q s - w| <= 16 s = max|row| / 28; plus unpack's
    # rounding to bf16 (2^-8 of the value)
    max_relative_error = 1.001 / 28 + 1 / 256

    def pack(self, weight):
        q, scale = quantize_fp8(weight)
        return Fp8Weight(q, scale, weight.dtype)

    def scaled_rows(self, packed):
        return packed.q, packed.scale  # the fused decode GEMMs read these directly

    def unpack(self, packed):
        return dequantize_fp8(packed.q, packed.scale).to(packed.dtype)

    def dense_on(self, device, kernels) -> bool:
        return device.type == "cpu" and kernels == "torch"  # not Triton's interpreter

    def matmul(self, x, packed, ops=None):
        # x: [..., K] -> [..., N]; the engine's kernels, else by x's device
        op = ops.fp8_linear if ops is not None else \
            get_op("fp8_linear", resolve_backend(x.device))
        return op(x, packed.q, packed.scale)

    def packed_bytes(self, packed):
        return packed.q.numel() * packed.q.element_size() + 4 * packed.scale.numel()

    def packed_bytes_of(self, shape, element_bytes):
        rows, cols = shape
        return rows * cols + 4 * rows


def fast_here(device: str, kernels: str) -> bool:
    """Whether fp8 weights run their fp8 kernels: Triton ops on a CUDA GPU with fp8."""
    dev = torch.device(device)
    return dev.type == "cuda" and kernels == "triton" and fp8_native(dev)


@hookimpl
def infergraft_register_quantizers(register):
    register(WeightFp8())


@hookimpl
def infergraft_prepare_plan(plan, spec):
    # the one build-time moment a quantiser's device and kernels are known
    if "fp8" in plan.quantizers and not fast_here(plan.device, plan.kernels) \
            and plan.device not in _warned:
        _warned.add(plan.device)
        where = f"{plan.kernels} kernels on {plan.device}"
        if torch.device(plan.device).type == "cuda" and plan.kernels == "triton":
            where += " (fp8 needs compute capability 8.9 or above)"
        how = ("keeps each weight dequantised beside its e4m3 form and multiplies in float "
               "(more memory than float alone)") if torch.device(plan.device).type == "cpu" \
            else "dequantises the e4m3 weights at each GEMM and multiplies in float"
        warnings.warn(PerformanceWarning(
            f"quantizer 'fp8' runs its reference path here ({where}): it {how}; the results "
            "are right, the speed and the memory traffic are not fp8's"), stacklevel=2)
    return None
