"""Skinny decode GEMM with its neighbours folded in: y = a W^T (+ b) (+ residual).

The GEMM input a is x itself, RMSNorm(x) (``rms_eps=``, the pre-norms before qkv and
gate_up) or silu(x[:, :K]) * x[:, K:] (``gated=True``, before down). ``residual`` is added
in float32 before the one rounding of y (o and down).

RMSNorm without a prologue: the norm's weight is folded into W's columns once at load
(``DecoderModel.fold_norm_weights``), and the per-row 1/rms is a scalar that commutes
with the GEMM, so the kernel accumulates sum(x^2) from the x tiles it streams anyway and
scales the accumulator at the end: y = rstd * (x W'^T) + b. (A prologue pass over x
before the weight stream cost 16 us on the qkv GEMM on an H200.) At batch 1 each folded
op is a launch saved (~1-2 us in a CUDA graph): the kernel is bound by the weight stream.

Per layer: qkv(norm), rotary, kv_write, attention, o(+residual), gate_up(norm),
down(gated, +residual) -- 7 launches where the unfused layer has 10.
"""
import torch
import torch.nn.functional as F

from ._triton import HAVE_TRITON, tl, triton
from .linear import MAX_SKINNY_M, skinny_config
from .silu_mul import silu_mul_torch, silu_mul_triton


def _check(x, weight, bias, rms_eps, gated, residual):
    """The contract both implementations share; returns (M, N, K)."""
    assert not (gated and rms_eps is not None), ("gated=True and rms_eps are mutually "
                                                 "exclusive: the input is silu(gate) * up or RMSNorm(x)")
    assert x.dim() == 2 and weight.dim() == 2, \
        f"x must be [M, K_in] and weight [N, K], got x {tuple(x.shape)}, weight {tuple(weight.shape)}"
    (m, k_in), (n, k) = x.shape, weight.shape
    if gated:
        assert k_in == 2 * k, \
            f"gated: x must be [M, 2K] = gate | up for weight {tuple(weight.shape)}, got {tuple(x.shape)}"
    else:
        assert k_in == k, f"x has K={k_in} but weight is {tuple(weight.shape)}"
    assert x.dtype == weight.dtype, f"x {x.dtype} != weight {weight.dtype}"
    assert bias is None or tuple(bias.shape) == (n,), f"bias must be [{n}], got {tuple(bias.shape)}"
    assert rms_eps is None or rms_eps > 0, f"rms_eps must be > 0, got {rms_eps}"
    assert residual is None or tuple(residual.shape) == (m, n), \
        f"residual must be [{m}, {n}], got {tuple(residual.shape)}"
    return m, n, k


def rstd_torch(x, eps):
    # x: [M, K] -> [M, 1] float32, 1 / rms of each row
    return torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)


def fused_linear_torch(x, weight, bias=None, *, rms_eps=None, gated=False, residual=None):
    # x: [M, K] (or [M, 2K] gated), weight: [N, K], bias: [N], residual: [M, N] -> new [M, N]
    _check(x, weight, bias, rms_eps, gated, residual)
    a = silu_mul_torch(x) if gated else x
    y = F.linear(a.float(), weight.float())
    if rms_eps is not None:  # RMSNorm whose weight is folded into W
        y = y * rstd_torch(x, rms_eps)
    if bias is not None:
        y = y + bias.float()
    if residual is not None:
        y = y + residual.float()
    return y.to(x.dtype)  # one rounding of GEMM + bias + residual


if HAVE_TRITON:

    @triton.jit
    def _fused_skinny_kernel(x_ptr, w_ptr, b_ptr, r_ptr, y_ptr, M, N, K, eps,
                             stride_xm, stride_wn, stride_rm, stride_ym,
                             NORM: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
                             HAS_RESIDUAL: tl.constexpr, IEEE: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # _skinny_gemm_kernel plus a prologue on the x tiles and an epilogue on the output:
        # one program per BLOCK_N output columns, all M rows at once, so W is read once
        pid = tl.program_id(0)
        rm = tl.arange(0, BLOCK_M)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        mmask = rm < M
        x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]                # [BM, BK]
        w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]   # [BN, BK]
        ss = tl.full((BLOCK_M,), 0.0, tl.float32)  # NORM: sum of x^2 per row
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)  # tl.zeros fails in the 3.9 interpreter
        for k0 in range(0, K, BLOCK_K):
            kmask = (k0 + rk) < K
            xmask = mmask[:, None] & kmask[None, :]
            x = tl.load(x_ptrs, mask=xmask, other=0.0)                             # [BM, BK]
            if NORM:  # the norm's weight is in W: only the row scale is left (below)
                xf = x.to(tl.float32)
                ss += tl.sum(xf * xf, axis=1)                                      # [BM]
                a = x
            elif GATED:
                # x holds the gate; the up tile sits K columns further. Rounded like silu_mul
                g = x.to(tl.float32)
                u = tl.load(x_ptrs + K, mask=xmask, other=0.0).to(tl.float32)       # [BM, BK]
                act = (g * tl.sigmoid(g)).to(x.dtype).to(tl.float32)
                a = (act * u).to(x.dtype)
            else:
                a = x
            w = tl.load(w_ptrs, mask=(rn[:, None] < N) & kmask[None, :], other=0.0)  # [BN, BK]
            if IEEE:  # float32 (tests): exact products, not tf32
                acc += tl.dot(a, tl.trans(w), input_precision="ieee")               # [BM, BN]
            else:
                acc += tl.dot(a, tl.trans(w))                                       # [BM, BN]
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if NORM:
            acc = acc * (1.0 / tl.sqrt(ss / K + eps))[:, None]                    # [BM, BN]
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        ymask = mmask[:, None] & (rn[None, :] < N)
        if HAS_RESIDUAL:
            acc += tl.load(r_ptr + rm[:, None] * stride_rm + rn[None, :], mask=ymask,
                           other=0.0).to(tl.float32)                               # [BM, BN]
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :],
                 acc.to(y_ptr.dtype.element_ty), mask=ymask)


def fused_config(m: int, n: int, k: int, gated: bool) -> dict:
    """skinny_config's tiles; gated keeps K tiles short (gate and up tiles plus the SiLU
    in float32 at BLOCK_K=512 spilled registers: 0.6 TB/s on an H200)."""
    cfg = skinny_config(m, n, k)
    if gated:
        cfg["BLOCK_K"] = min(cfg["BLOCK_K"], 128)
    return cfg


def fused_linear_triton(x, weight, bias=None, *, rms_eps=None, gated=False, residual=None,
                        config=None):
    # x: [M, K] (or [M, 2K] gated), weight: [N, K], bias: [N], residual: [M, N] -> new [M, N]
    m, _, _ = _check(x, weight, bias, rms_eps, gated, residual)
    if 0 < m <= MAX_SKINNY_M and x.dtype != torch.float32:
        return fused_skinny_gemm(x, weight, bias, rms_eps=rms_eps, gated=gated,
                                 residual=residual, config=config)
    # prefill (compute bound, cuBLAS) and float32 (exact, like linear_triton): the unfused
    # ops. The residual add rounds y a second time there, as the unfused layer does.
    if rms_eps is not None:  # normalise first: an fp16 GEMM of the raw rows may overflow
        a = (x.float() * rstd_torch(x, rms_eps)).to(x.dtype)
    else:
        a = silu_mul_triton(x) if gated else x
    y = F.linear(a, weight, bias)
    return y if residual is None else y.add_(residual)


def fused_skinny_gemm(x, weight, bias=None, *, rms_eps=None, gated=False, residual=None,
                      config=None):
    """The Triton kernel itself, any float dtype (tests call it directly in float32)."""
    m, n, k = _check(x, weight, bias, rms_eps, gated, residual)
    assert 0 < m <= MAX_SKINNY_M, f"skinny GEMM takes 1..{MAX_SKINNY_M} rows, got {m}"
    for name, t in (("weight", weight), ("bias", bias), ("residual", residual)):
        assert t is None or t.device == x.device, f"{name} on {t.device} but x on {x.device}"
    assert weight.is_contiguous() and (x.shape[1] <= 1 or x.stride(1) == 1), \
        "weight and x rows must be contiguous"
    assert bias is None or bias.stride(0) == 1, "bias must be contiguous"
    assert residual is None or n <= 1 or residual.stride(1) == 1, \
        f"residual must be contiguous in its last dim, strides {residual.stride()}"
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    cfg = dict(config or fused_config(m, n, k, gated))
    grid = (triton.cdiv(n, cfg["BLOCK_N"]),)
    _fused_skinny_kernel[grid](
        x, weight, bias if bias is not None else weight,
        residual if residual is not None else y, y, m, n, k, float(rms_eps or 0.0),
        x.stride(0), weight.stride(0), residual.stride(0) if residual is not None else 0, y.stride(0),
        NORM=rms_eps is not None, GATED=bool(gated), HAS_BIAS=bias is not None,
        HAS_RESIDUAL=residual is not None, IEEE=x.dtype == torch.float32, **cfg)
    return y
