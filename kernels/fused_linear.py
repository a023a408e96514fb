"""Decode GEMMs fused with their neighbours (kernels/linear.py's skinny kernel with its
fusion flags on), for the decode layer at <= 16 rows (``DecoderLayer.forward_fused``):

- ``rms_norm_linear``: rms_norm(x) W^T; with ``FUSE_NORM`` (off: slower, see below) the
  norm happens on the way into the GEMM: x * g per tile, sum(x^2) alongside, * rstd at the
  end; else the RMSNorm kernel (no residual add left in it) and the GEMM.
- ``rms_norm_swiglu``: silu(n Wg^T) * (n Wu^T), n = rms_norm(x), on the fused gate_up
  weight [2I, K] (gate rows, then up rows): [M, I] out, no [M, 2I] intermediate.
- ``linear_residual``: x W^T + r (o and down: the residual stream's add).

The references compose the unfused ops, and so do the Triton entry points where the
kernel does not apply (float32: exact cuBLAS; more rows than ``MAX_SKINNY_M``).
"""
import os

import torch

from ._triton import HAVE_TRITON, triton
from .linear import MAX_SKINNY_M, launch_gemm, linear_torch, linear_triton, skinny_config
from .rms_norm import rms_norm_torch, rms_norm_triton
from .silu_mul import silu_mul_torch, silu_mul_triton


# A/B knobs: which fusions the Triton entry points use (the residual add always). H200,
# bf16, M=1, TB/s of weights (kernels/benchmarks.py --fused): gate_up with SwiGLU 3.99
# (3.92 for norm + gate_up + silu_mul), o / down with the residual 3.11 / 3.69 (2.61 / 3.38
# with a separate add). The norm inside the GEMM is off: x * g on the tl.dot operand
# costs Triton 3.6 its weight pipelining (qkv 1.02 TB/s vs 3.69 for norm + GEMM).
FUSE_NORM = os.environ.get("INFERGRAFT_FUSE_NORM", "0") == "1"
FUSE_SWIGLU = os.environ.get("INFERGRAFT_FUSE_SWIGLU", "1") != "0"


def rms_norm_linear_torch(x, norm_weight, eps, weight, bias=None):
    # x: [M, K], norm_weight: [K], weight: [N, K] -> [M, N]
    return linear_torch(rms_norm_torch(x, norm_weight, eps), weight, bias)


def rms_norm_swiglu_torch(x, norm_weight, eps, weight, bias=None):
    # x: [M, K], weight: [2I, K] (gate | up) -> [M, I]
    return silu_mul_torch(linear_torch(rms_norm_torch(x, norm_weight, eps), weight, bias))


def linear_residual_torch(x, weight, bias, residual):
    # x: [M, K], weight: [N, K], residual: [M, N] -> [M, N]
    return linear_torch(x, weight, bias) + residual


def _fusable(x, weight) -> bool:
    return HAVE_TRITON and 0 < x.shape[0] <= MAX_SKINNY_M and x.dtype != torch.float32 \
        and x.dtype == weight.dtype


def _check(x, weight, bias, n_out):
    m, k = x.shape
    assert weight.dim() == 2 and weight.shape[1] == k, \
        f"x is [{m}, {k}] but weight is {tuple(weight.shape)}"
    assert weight.is_contiguous() and (k <= 1 or x.stride(1) == 1), \
        "weight and x rows must be contiguous"
    assert bias is None or bias.shape == (weight.shape[0],), \
        f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}"
    return torch.empty((m, n_out), dtype=x.dtype, device=x.device)


def _check_norm(x, norm_weight):
    assert norm_weight.shape == (x.shape[1],) and norm_weight.stride(0) == 1, \
        f"norm weight must be contiguous [{x.shape[1]}], got {tuple(norm_weight.shape)}"


def rms_norm_linear_triton(x, norm_weight, eps, weight, bias=None, config=None):
    _check_norm(x, norm_weight)
    if not (FUSE_NORM and _fusable(x, weight)):
        return linear_triton(rms_norm_triton(x, norm_weight, eps), weight, bias)
    m, k = x.shape
    n = weight.shape[0]
    y = _check(x, weight, bias, n)
    cfg = dict(config or skinny_config(m, n, k))
    launch_gemm((triton.cdiv(n, cfg["BLOCK_N"]), 1), cfg, x, weight, bias, y,
                norm_weight=norm_weight.to(x.dtype), eps=eps)
    return y


def swiglu_config(m: int, i: int, k: int) -> dict:
    """Two [BN, BK] weight tiles (gate and up) per step: the bytes per stage of the
    unfused gate_up's [64, 128] tiles."""
    return dict(BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=32, BLOCK_K=128,
                num_warps=4, num_stages=3)


def rms_norm_swiglu_triton(x, norm_weight, eps, weight, bias=None, config=None):
    _check_norm(x, norm_weight)
    if not (FUSE_SWIGLU and _fusable(x, weight)):
        return silu_mul_triton(rms_norm_linear_triton(x, norm_weight, eps, weight, bias))
    assert weight.shape[0] % 2 == 0, f"gate_up weight needs an even row count, got {weight.shape[0]}"
    norm = dict(norm_weight=norm_weight.to(x.dtype), eps=eps)
    if not FUSE_NORM:
        x, norm = rms_norm_triton(x, norm_weight, eps), {}
    m, k = x.shape
    i = weight.shape[0] // 2
    y = _check(x, weight, bias, i)
    cfg = dict(config or swiglu_config(m, i, k))
    launch_gemm((triton.cdiv(i, cfg["BLOCK_N"]), 1), cfg, x, weight, bias, y, up_rows=i, **norm)
    return y


def linear_residual_triton(x, weight, bias, residual, config=None):
    if not _fusable(x, weight):
        return linear_triton(x, weight, bias) + residual
    m, k = x.shape
    n = weight.shape[0]
    y = _check(x, weight, bias, n)
    assert residual.shape == (m, n) and residual.dtype == x.dtype and residual.stride(1) == 1, \
        f"residual must be [{m}, {n}] {x.dtype} with contiguous rows, got " \
        f"{tuple(residual.shape)} {residual.dtype}"
    cfg = dict(config or skinny_config(m, n, k))
    launch_gemm((triton.cdiv(n, cfg["BLOCK_N"]), 1), cfg, x, weight, bias, y, residual=residual)
    return y
