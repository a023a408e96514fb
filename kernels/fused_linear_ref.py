"""The fused decode GEMMs' torch references (``fused_linear``'s contracts composed from
torch ops: the CPU's path and the tests' reference), and the helpers both sides share."""
import torch

from infergraft.core.spec import split_qkv

from . import int4_fused_ops as int4
from ._rows import check_row_dtype
from .fp8_linear import FP8, fp8_linear_torch, fp8_linear_triton
from .int4_format import Int4Weight
from .int8_linear import int8_linear_torch, int8_linear_triton
from .linear import linear_torch
from .rotary import rotary_kv_write_torch
from .silu_mul import silu_mul_torch


def _normed(x, sum_sq, eps):
    # x: [M, K], sum_sq: [P, M] partial sums of x^2 -> rms_norm(x) with a unit weight,
    # rounded to x's dtype like rms_norm_torch
    rstd = torch.rsqrt(sum_sq.sum(0)[:, None] / x.shape[1] + eps)
    return (x.float() * rstd).to(x.dtype)


def _linear(x, weight, bias, scale, kernel=False, mma=False):
    # x: [M, K], weight: [N, K] in x's dtype, or 8-bit rows with scale [N] -> [M, N] in x's
    # dtype; each row format through its own GEMM (its Triton launcher with ``kernel``,
    # ``mma``: INFERGRAFT_QUANT_MMA's value, the launcher's route rule applied)
    if scale is None:
        return linear_torch(x, weight, bias)
    check_row_dtype(weight)
    if kernel:
        launch = fp8_linear_triton if weight.dtype == FP8 else int8_linear_triton
        return launch(x, weight, scale, bias, mma=mma)
    return (fp8_linear_torch if weight.dtype == FP8 else int8_linear_torch)(x, weight, scale,
                                                                              bias)


def _int4(weight, norm) -> bool:
    # whether the weight is int4 (int4_fused_ops' GEMMs, ``norm`` its input norm's weight);
    # the other forms carry the norm weight folded into their columns
    if isinstance(weight, Int4Weight):
        return True
    assert norm is None, f"{weight.dtype} weights carry the norm weight folded in, not as norm"
    return False


def _with_sum_sq(out, sum_sq: bool):
    # out: [M, N] -> out, or (out, its sum of squares per row [1, M] float32)
    return (out, out.float().square().sum(-1)[None]) if sum_sq else out


def normed_linear_torch(x, weight, bias, sum_sq, eps, scale=None, norm=None):
    # x: [M, K], weight: [N, K] (norm weight folded in), sum_sq: [P, M] -> [M, N]
    if _int4(weight, norm):
        return int4.normed_linear(x, weight, bias, sum_sq, eps, norm)
    return _linear(_normed(x, sum_sq, eps), weight, bias, scale)


def normed_swiglu_torch(x, weight, bias, sum_sq, eps, scale=None, norm=None):
    # x: [M, K], weight: [2I, K] (gate | up, norm weight folded in; scale [2I]) -> [M, I]
    if _int4(weight, norm):
        return int4.normed_swiglu(x, weight, bias, sum_sq, eps, norm)
    return silu_mul_torch(normed_linear_torch(x, weight, bias, sum_sq, eps, scale=scale))


def linear_residual_torch(x, weight, bias, residual, sum_sq: bool = False, scale=None):
    # x: [M, K], weight: [N, K], residual: [M, N] -> [M, N] (and its sum of squares [1, M])
    if isinstance(weight, Int4Weight):
        return int4.linear_residual(x, weight, bias, residual, sum_sq)
    return _with_sum_sq(_linear(x, weight, bias, scale) + residual, sum_sq)


def normed_qkv_rope_torch(x, weight, bias, sum_sq, eps, cos, sin, positions, num_heads,
                          k_cache, v_cache, idx0, idx1, scale=None, norm=None):
    """The decode step's attention input: rms_norm(x) W^T (norm weight folded into W) split
    into heads, RoPE on q and k, k and v written to ``cache[idx0[t], idx1[t]]`` (rows
    with idx0 < 0 nowhere) -> rotated q [T, Hq, D]. Caches: [NB, BS, Hkv, D]."""
    if _int4(weight, norm):
        return int4.normed_qkv_rope(x, weight, bias, sum_sq, eps, cos, sin, positions,
                                    num_heads, k_cache, v_cache, idx0, idx1, norm)
    qkv = normed_linear_torch(x, weight, bias, sum_sq, eps, scale=scale)
    q, k, v = split_qkv(qkv, num_heads, k_cache.shape[2], k_cache.shape[3])
    return rotary_kv_write_torch(q, k, v, cos, sin, positions, k_cache, v_cache, idx0, idx1)
