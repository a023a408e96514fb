"""The fused decode layer's GEMMs (kernels/fused_linear.py's four contracts) over an
int4 weight (``Int4Weight``): fused_linear hands them every call whose weight is one.

The input norm's weight comes as ``norm`` (not folded into the weight: plugins/weight_int4.py
says why); None where it is ones. A GPTQ act order's ``perm`` gathers x's columns. The
references dequantise and multiply (``int4_linear_torch``) between the same torch ops as
fused_linear's references; the Triton entry points run ``int4_fused``'s kernel at
1..``FUSED_ROWS`` rows (16-bit or float32 x; ``config``: ``int4_fused.fused_config``'s
tiles), else the same composition on the Triton
GEMM (``int4_linear_triton``: its tensor-core tiles, or ``int4_mma`` from its rows under
``INFERGRAFT_QUANT_MMA``) and the unfused Triton ops.
"""
import torch

from infergraft.core.spec import split_qkv

from ._triton import HAVE_TRITON
from .int4_fused import MAX_ROWS, launch_int4_fused
from .int4_linear import int4_linear_torch, int4_linear_triton
from .rotary import rotary_kv_write_torch, rotary_kv_write_triton
from .silu_mul import silu_mul_torch, silu_mul_triton

# rows up to which the fused kernel runs (its CUDA-core loop unrolls the rows); more take
# the composition, whose GEMM is the unfused one of that many rows
FUSED_ROWS = MAX_ROWS


def _normed(x, sum_sq, eps, norm):
    # x: [M, K], sum_sq: [P, M] -> rms_norm(x, norm) (a unit weight where None), rounded
    # like rms_norm_torch
    rstd = torch.rsqrt(sum_sq.sum(0)[:, None] / x.shape[1] + eps)
    xn = (x.float() * rstd).to(x.dtype)
    return xn if norm is None else norm * xn


def _gemm(x, w, bias, kernel: bool, mma=False, counters=None):
    # x: [M, K] -> x[:, perm] W^T + b [M, N] in x's dtype (the Triton GEMM with ``kernel``)
    if w.perm is not None:
        x = x.index_select(-1, w.perm)
    args = (x, w.qweight, w.scales, w.zeros, w.group_size, w.in_features, bias)
    if kernel:
        return int4_linear_triton(*args, mma=mma, counters=counters)
    return int4_linear_torch(*args)


def _with_sum_sq(out, sum_sq: bool):
    return (out, out.float().square().sum(-1)[None]) if sum_sq else out


def _check(x, w, bias, norm):
    n, k = w.qweight.shape[0], w.in_features
    assert x.dim() == 2 and x.shape[1] == k, f"x must be [M, {k}], got {tuple(x.shape)}"
    assert bias is None or bias.shape == (n,), f"bias must be [{n}], got {tuple(bias.shape)}"
    assert norm is None or norm.shape == (k,), \
        f"norm must be the input norm's weight [{k}], got {tuple(norm.shape)}"


def _fusable(x) -> bool:
    return HAVE_TRITON and 0 < x.shape[0] <= FUSED_ROWS and (x.shape[1] <= 1 or x.stride(1) == 1)


def normed_linear(x, w, bias, sum_sq, eps, norm=None, kernel=False, mma=False, counters=None,
                  config=None):
    """rms_norm(x, norm) W^T + b: [M, K] -> [M, N]."""
    _check(x, w, bias, norm)
    if not (kernel and _fusable(x)):
        return _gemm(_normed(x, sum_sq, eps, norm), w, bias, kernel, mma, counters)
    y = torch.empty((x.shape[0], w.qweight.shape[0]), dtype=x.dtype, device=x.device)
    return launch_int4_fused(x, w, bias, y, gemm="linear", norm=norm, sum_sq=sum_sq, eps=eps,
                             counters=counters, config=config)[0]


def normed_swiglu(x, w, bias, sum_sq, eps, norm=None, kernel=False, mma=False, counters=None,
                  config=None):
    """silu(n Wg^T) * (n Wu^T), n = rms_norm(x, norm), W = gate | up rows: [M, K] -> [M, I]."""
    _check(x, w, bias, norm)
    n = w.qweight.shape[0]
    assert n % 2 == 0, f"gate_up weight needs an even row count, got {n}"
    if not (kernel and _fusable(x)):
        gate_up = _gemm(_normed(x, sum_sq, eps, norm), w, bias, kernel, mma, counters)
        return (silu_mul_triton if kernel else silu_mul_torch)(gate_up)
    y = torch.empty((x.shape[0], n // 2), dtype=x.dtype, device=x.device)
    return launch_int4_fused(x, w, bias, y, gemm="swiglu", norm=norm, sum_sq=sum_sq, eps=eps,
                             counters=counters, config=config)[0]


def linear_residual(x, w, bias, residual, sum_sq=False, kernel=False, mma=False,
                    counters=None, config=None):
    """x W^T + b + r (and its sums of squares per row, partials [P, M] float32)."""
    _check(x, w, bias, None)
    m, n = x.shape[0], w.qweight.shape[0]
    assert residual.shape == (m, n) and residual.dtype == x.dtype and residual.stride(1) == 1, \
        f"residual must be [{m}, {n}] {x.dtype} with contiguous rows, got " \
        f"{tuple(residual.shape)} {residual.dtype}"
    if not (kernel and _fusable(x)):
        return _with_sum_sq(_gemm(x, w, bias, kernel, mma, counters) + residual, sum_sq)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    y, parts = launch_int4_fused(x, w, bias, y, gemm="linear", residual=residual,
                                 sum_sq_out=sum_sq, counters=counters, config=config)
    return (y, parts) if sum_sq else y


def normed_qkv_rope(x, w, bias, sum_sq, eps, cos, sin, positions, num_heads, k_cache, v_cache,
                    idx0, idx1, norm=None, kernel=False, mma=False, counters=None,
                  config=None):
    """fused_linear.normed_qkv_rope's contract: rms_norm(x, norm) W^T split into heads, RoPE
    on q and k, k and v to ``cache[idx0[t], idx1[t]]`` -> rotated q [T, Hq, D]. The
    kernel where half a head is a whole number of its tiles and the caches are x's dtype."""
    from .rotary import qkv_rope_epilogue

    _check(x, w, bias, norm)
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    half = cos.shape[1]
    assert w.qweight.shape[0] == (num_heads + 2 * hkv) * d, \
        f"qkv weight has {w.qweight.shape[0]} rows, not (Hq={num_heads} + 2 Hkv={hkv}) x D={d}"
    if not (kernel and _fusable(x) and 2 * half == d and k_cache.dtype == v_cache.dtype == x.dtype
            and k_cache.stride() == v_cache.stride()):
        qkv = normed_linear(x, w, bias, sum_sq, eps, norm, kernel, mma, counters)
        q, k, v = split_qkv(qkv, num_heads, hkv, d)
        kv_write = rotary_kv_write_triton if kernel else rotary_kv_write_torch
        return kv_write(q, k, v, cos, sin, positions, k_cache, v_cache, idx0, idx1)
    m = x.shape[0]
    q = torch.empty((m, num_heads * d), dtype=x.dtype, device=x.device)
    rope = qkv_rope_epilogue(q, num_heads, cos, sin, positions, k_cache, v_cache, idx0, idx1)
    launch_int4_fused(x, w, bias, q, gemm="qkv_rope", norm=norm, sum_sq=sum_sq, eps=eps,
                      rope=rope, counters=counters, config=config)
    return q.view(m, num_heads, d)
