"""Skinny decode GEMM with its neighbours folded in: the pre-norm, SwiGLU and residual add.

``fused_linear(x, W, b, rms_eps=, swiglu=, residual=)``:

* ``rms_eps``: the input is RMSNorm(x). The norm's weight is folded into W's columns once
  at load (``DecoderModel.fuse``), and 1/rms is a per-row scalar that commutes with the
  GEMM: y = rstd * (x W'^T) + b. sum(x^2) comes from a second tensor-core product of the
  x tile with itself (diag(x x^T)), so x is only ever a dot operand.
* ``swiglu``: W is [2N, K] = gate | up; each program owns N-columns j of both halves and
  writes silu(g_j) * u_j: the gate_up GEMM emits the MLP activation [M, N] directly.
* ``residual``: added in float32 before the one rounding of y (o and down).

Why the x tile must stay a pure dot operand: elementwise work on it in the loop (a norm
prologue, SiLU on a gate tile) made Triton load it synchronously every iteration, and the
weight stream stalled: 0.4-2.3 TB/s instead of 3.5-4 on an H200.

Per layer: qkv(norm), rotary, kv_write, attention, o(+residual), gate_up(norm, swiglu),
down(+residual): 7 launches (+1 split-KV combine) where the unfused layer has 10.
"""
import torch
import torch.nn.functional as F

from ._triton import HAVE_TRITON, tl, triton
from .linear import MAX_SKINNY_M, skinny_config
from .silu_mul import silu_mul_torch, silu_mul_triton


def _check(x, weight, bias, rms_eps, swiglu, residual):
    """The contract both implementations share; returns (M, N, K), N the output width."""
    assert x.dim() == 2 and weight.dim() == 2, \
        f"x must be [M, K] and weight [N, K], got x {tuple(x.shape)}, weight {tuple(weight.shape)}"
    (m, k), (n_w, k_w) = x.shape, weight.shape
    assert k == k_w, f"x has K={k} but weight is {tuple(weight.shape)}"
    assert not swiglu or n_w % 2 == 0, f"swiglu: weight must be [2N, K] = gate | up, got {tuple(weight.shape)}"
    n = n_w // 2 if swiglu else n_w
    assert x.dtype == weight.dtype, f"x {x.dtype} != weight {weight.dtype}"
    assert bias is None or tuple(bias.shape) == (n_w,), f"bias must be [{n_w}], got {tuple(bias.shape)}"
    assert rms_eps is None or rms_eps > 0, f"rms_eps must be > 0, got {rms_eps}"
    assert residual is None or tuple(residual.shape) == (m, n), \
        f"residual must be [{m}, {n}], got {tuple(residual.shape)}"
    assert not (swiglu and residual is not None), "swiglu and residual do not combine"
    return m, n, k


def rstd_torch(x, eps):
    # x: [M, K] -> [M, 1] float32, 1 / rms of each row
    return torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)


def fused_linear_torch(x, weight, bias=None, *, rms_eps=None, swiglu=False, residual=None):
    # x: [M, K], weight: [N or 2N, K], bias: [N or 2N], residual: [M, N] -> new [M, N]
    _check(x, weight, bias, rms_eps, swiglu, residual)
    y = F.linear(x.float(), weight.float())
    if rms_eps is not None:  # RMSNorm whose weight is folded into W
        y = y * rstd_torch(x, rms_eps)
    if bias is not None:
        y = y + bias.float()
    if swiglu:  # the GEMM output rounds like the unfused gate_up, then silu_mul
        return silu_mul_torch(y.to(x.dtype))
    if residual is not None:
        y = y + residual.float()
    return y.to(x.dtype)  # one rounding of GEMM + bias + residual


if HAVE_TRITON:

    @triton.jit
    def _dot(a, b, IEEE: tl.constexpr):
        if IEEE:  # float32 (tests): exact products, not tf32
            return tl.dot(a, b, input_precision="ieee")
        return tl.dot(a, b)

    @triton.jit
    def _fused_skinny_kernel(x_ptr, w_ptr, b_ptr, r_ptr, y_ptr, M, N, K, eps,
                             stride_xm, stride_wn, stride_rm, stride_ym, up_off,
                             NORM: tl.constexpr, SWIGLU: tl.constexpr, HAS_BIAS: tl.constexpr,
                             HAS_RESIDUAL: tl.constexpr, IEEE: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # one program per BLOCK_N output columns (of both halves with SWIGLU), all M rows
        pid = tl.program_id(0)
        rm = tl.arange(0, BLOCK_M)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        mmask, nmask = rm < M, rn < N
        x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]                # [BM, BK]
        w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]   # [BN, BK]
        sq = tl.full((BLOCK_M, BLOCK_M), 0.0, tl.float32)  # NORM: x x^T, diag = sum(x^2)
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)  # tl.zeros fails in the 3.9 interpreter
        acc_up = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kmask = (k0 + rk) < K
            x = tl.load(x_ptrs, mask=mmask[:, None] & kmask[None, :], other=0.0)    # [BM, BK]
            wmask = nmask[:, None] & kmask[None, :]
            w = tl.load(w_ptrs, mask=wmask, other=0.0)                              # [BN, BK]
            acc += _dot(x, tl.trans(w), IEEE)                                       # [BM, BN]
            if SWIGLU:
                # the up row of output column j is weight row N + j (up_off = N * stride)
                wu = tl.load(w_ptrs + up_off, mask=wmask, other=0.0)               # [BN, BK]
                acc_up += _dot(x, tl.trans(wu), IEEE)
            if NORM:
                sq += _dot(x, tl.trans(x), IEEE)                                    # [BM, BM]
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if NORM:  # the norm's weight is in W: only the row scale is left
            ss = tl.sum(tl.where(rm[:, None] == rm[None, :], sq, 0.0), axis=1)    # [BM]
            rstd = (1.0 / tl.sqrt(ss / K + eps))[:, None]
            acc = acc * rstd
            acc_up = acc_up * rstd
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
            if SWIGLU:
                acc_up += tl.load(b_ptr + N + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
        ymask = mmask[:, None] & nmask[None, :]
        dtype = y_ptr.dtype.element_ty
        if SWIGLU:  # rounded like gate_up's output, then like silu_mul
            g = acc.to(dtype).to(tl.float32)
            act = (g * tl.sigmoid(g)).to(dtype).to(tl.float32)
            acc = act * acc_up.to(dtype).to(tl.float32)
        if HAS_RESIDUAL:
            acc += tl.load(r_ptr + rm[:, None] * stride_rm + rn[None, :], mask=ymask,
                           other=0.0).to(tl.float32)                               # [BM, BN]
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(dtype), mask=ymask)


def fused_config(m: int, n: int, k: int, swiglu: bool) -> dict:
    """skinny_config's tiles for the weight rows one program streams (2 x BLOCK_N with
    SwiGLU, so its N tile is halved)."""
    cfg = skinny_config(m, 2 * n if swiglu else n, k)
    if swiglu:
        cfg["BLOCK_N"] = max(16, cfg["BLOCK_N"] // 2)
    return cfg


def fused_linear_triton(x, weight, bias=None, *, rms_eps=None, swiglu=False, residual=None,
                        config=None):
    # x: [M, K], weight: [N or 2N, K], bias: [N or 2N], residual: [M, N] -> new [M, N]
    m, _, _ = _check(x, weight, bias, rms_eps, swiglu, residual)
    if 0 < m <= MAX_SKINNY_M and x.dtype != torch.float32:
        return fused_skinny_gemm(x, weight, bias, rms_eps=rms_eps, swiglu=swiglu,
                                 residual=residual, config=config)
    # prefill (compute bound, cuBLAS) and float32 (exact, like linear_triton): the unfused
    # ops. The residual add rounds y a second time there, as the unfused layer does.
    if rms_eps is not None:  # normalise first: an fp16 GEMM of the raw rows may overflow
        x = (x.float() * rstd_torch(x, rms_eps)).to(x.dtype)
    y = F.linear(x, weight, bias)
    if swiglu:
        return silu_mul_triton(y)
    return y if residual is None else y.add_(residual)


def fused_skinny_gemm(x, weight, bias=None, *, rms_eps=None, swiglu=False, residual=None,
                      config=None):
    """The Triton kernel itself, any float dtype (tests call it directly in float32)."""
    m, n, k = _check(x, weight, bias, rms_eps, swiglu, residual)
    assert 0 < m <= MAX_SKINNY_M, f"skinny GEMM takes 1..{MAX_SKINNY_M} rows, got {m}"
    for name, t in (("weight", weight), ("bias", bias), ("residual", residual)):
        assert t is None or t.device == x.device, f"{name} on {t.device} but x on {x.device}"
    assert weight.is_contiguous() and (k <= 1 or x.stride(1) == 1), \
        "weight and x rows must be contiguous"
    assert bias is None or bias.stride(0) == 1, "bias must be contiguous"
    assert residual is None or n <= 1 or residual.stride(1) == 1, \
        f"residual must be contiguous in its last dim, strides {residual.stride()}"
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    cfg = dict(config or fused_config(m, n, k, swiglu))
    grid = (triton.cdiv(n, cfg["BLOCK_N"]),)
    _fused_skinny_kernel[grid](
        x, weight, bias if bias is not None else weight,
        residual if residual is not None else y, y, m, n, k, float(rms_eps or 0.0),
        x.stride(0), weight.stride(0), residual.stride(0) if residual is not None else 0, y.stride(0),
        n * weight.stride(0), NORM=rms_eps is not None, SWIGLU=bool(swiglu), HAS_BIAS=bias is not None,
        HAS_RESIDUAL=residual is not None, IEEE=x.dtype == torch.float32, **cfg)
    return y
