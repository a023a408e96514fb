"""fp8 weight linear: y = x (q * s)^T + b with q float8_e4m3fn [N, K] and one float32 scale
per output row s [N] (``quantize_fp8``: s = max|w_row| / 448, e4m3's largest finite value).

``fp8_linear_triton`` picks one of three paths by the rows of x:

* few rows (decode, M <= ``SKINNY_MAX_ROWS``): a skinny Triton GEMM streams the e4m3
  tiles (half bf16's bytes), widens them to x's dtype in registers (exact: every e4m3
  value is an fp16 and a bf16 value) and applies the row scale once, in the epilogue, as
  ``int8_linear`` does;
* many rows of bf16 (prefill, large batches): W8A8 on the fp8 tensor cores through
  ``torch._scaled_mm``, x quantised to e4m3 per token with a dynamic scale
  amax(|x_row|) / 448 (``quantize_rows_fp8``); cuBLASLt's row-wise scaling writes bf16;
* otherwise (fp16 or float32 x, K or N not a multiple of 16, ``INFERGRAFT_FP8_W8A8=0``)
  the weight widened once to x's dtype and cuBLAS.

Triton loads e4m3 natively from sm_89 (Ada, Hopper) on, and in the CPU interpreter; on an
older GPU the launcher runs the reference ``fp8_linear_torch`` (dequantise, then the float
GEMM), as the torch backend does everywhere (the ``fp8`` quantiser warns at build).
"""
import functools

import attrs
import torch
import torch.nn.functional as F

from . import switches
from ._rows import check_scaled_rows, fit_stages, gemm_rows
from ._triton import HAVE_TRITON, interpreting, pdl_launch, pdl_release, pdl_wait, tl, triton
from .cpu_linear import int8_linear_cpu
from .fp8_mma import rows_mma, rows_mma_chosen, takes_rows_mma
from .int8_linear import int8_config

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
# up to here the skinny kernel (the weight's bytes bound the GEMM); above, W8A8 or cuBLAS
SKINNY_MAX_ROWS = switches.value("INFERGRAFT_FP8_SKINNY_ROWS")
# cuBLASLt's fast fp8 accumulation skips the periodic float32 promotion of the sums
FAST_ACCUM = False


@attrs.frozen
class Fp8Weight:
    q: torch.Tensor  # [N, K] float8_e4m3fn
    scale: torch.Tensor  # [N] float32
    dtype: torch.dtype  # of the weight it came from (what unpack returns)


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] float -> (q float8_e4m3fn [N, K], scale float32 [N]): s = max|w_row|
    / 448, q = e4m3(w / s) rounded to nearest even; an all-zero row gets s = 1 (q = 0)."""
    assert weight.dim() == 2 and weight.is_floating_point(), \
        f"weight must be a float [N, K] matrix, got {tuple(weight.shape)} {weight.dtype}"
    w = weight.float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    # w / s may land an ulp above 448, which e4m3fn (no infinity) would make NaN
    q = (w / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return q.contiguous(), scale.contiguous()


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (xq float8_e4m3fn [M, K], scale float32 [M, 1]): the dynamic per-token
    activation scale of the W8A8 path, the same rounding as ``quantize_fp8``. On CUDA one
    Triton kernel (``quantize_rows_fp8_triton``), not torch's six passes over x."""
    if x.is_cuda and HAVE_TRITON and x.dim() == 2 and x.stride(1) == 1:
        return quantize_rows_fp8_triton(x)
    q, scale = quantize_fp8(x)
    return q, scale[:, None]


def quantize_rows_fp8_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows_fp8`` in one kernel: a program per row reads it twice (its amax,
    then its values), bit for bit ``quantize_fp8``'s result where torch divides exactly."""
    assert x.dim() == 2 and x.stride(1) == 1 and x.is_floating_point(), \
        f"x must be a float [M, K] with unit column stride, got {tuple(x.shape)} {x.stride()}"
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m and k:
        block = min(4096, max(16, 1 << (k - 1).bit_length()))
        _quantize_rows_kernel[(m,)](x, q, scale, k, x.stride(0), BLOCK_K=block,
                                    num_warps=4 if block <= 2048 else 8)
    return q, scale


def dequantize_fp8(qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(q [N, K], s [N]) -> the float32 weight q * s [N, K] (exact in float32 but for the
    product's rounding)."""
    return qweight.float() * scale[:, None]


def fp8_linear_torch(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                     bias=None) -> torch.Tensor:
    # x: [..., K], qweight: [N, K] e4m3, scale: [N] float32, bias: [N] -> [..., N] x's dtype
    if x.device.type == "cpu":  # 8-bit rows widened a cache-sized chunk at a time
        return int8_linear_cpu(x, qweight, scale, bias)
    y = F.linear(x.float(), dequantize_fp8(qweight, scale),
                 None if bias is None else bias.float())
    return y.to(x.dtype)


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def fp8_native(device) -> bool:
    """Whether Triton loads e4m3 here: CUDA sm_89+ or the CPU interpreter."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return HAVE_TRITON and _capability(dev) >= (8, 9)
    return HAVE_TRITON and dev.type == "cpu" and interpreting()


def w8a8_fits(x2: torch.Tensor, n: int, k: int) -> bool:
    """The W8A8 path takes bf16 x (row-wise scaled ``_scaled_mm`` writes bf16 on sm_90)
    with K and N multiples of 16 (cuBLASLt's fp8 operands), unless switched off."""
    return x2.dtype == torch.bfloat16 and k % 16 == 0 and n % 16 == 0 \
        and hasattr(torch, "_scaled_mm") and bool(switches.value("INFERGRAFT_FP8_W8A8"))


def fp8_linear_w8a8(x2: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                    bias=None) -> torch.Tensor:
    """x2 [M, K] bf16 -> [M, N] bf16: x quantised per token, both operands e4m3, the
    float32 accumulator scaled by s_x[m] * s_w[n] (and the bias added) in the epilogue."""
    xq, sx = quantize_rows_fp8(x2)  # [M, K] e4m3, [M, 1] float32
    # qweight.t(): the [K, N] column-major operand cuBLASLt's fp8 GEMM needs
    return torch._scaled_mm(xq, qweight.t(), scale_a=sx, scale_b=scale.view(1, -1),
                            bias=None if bias is None else bias.to(torch.bfloat16),
                            out_dtype=torch.bfloat16, use_fast_accum=FAST_ACCUM)


if HAVE_TRITON:
    from .kv_write import _round_e4m3

    @triton.jit
    def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, BLOCK_K: tl.constexpr):
        # one row of x [K] -> its e4m3 values q [K] and scale s = amax / 448 (1 if amax is 0)
        row = tl.program_id(0).to(tl.int64)
        rk = tl.arange(0, BLOCK_K)
        amax = tl.full([BLOCK_K], 0.0, tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_ptr + row * stride_xm + k0 + rk, mask=k0 + rk < K, other=0.0)
            amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
        a = tl.max(amax, axis=0)
        s = tl.where(a > 0, tl.math.div_rn(a, 448.0), 1.0)
        tl.store(s_ptr + row, s)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_ptr + row * stride_xm + k0 + rk, mask=k0 + rk < K, other=0.0)
            y = tl.minimum(tl.maximum(tl.math.div_rn(x.to(tl.float32), s), -448.0), 448.0)
            tl.store(q_ptr + row * K + k0 + rk, _round_e4m3(y).to(q_ptr.dtype.element_ty),
                     mask=k0 + rk < K)

    @triton.jit
    def _fp8_linear_kernel(x_ptr, q_ptr, s_ptr, b_ptr, y_ptr, M, N, K,
                           stride_xm, stride_qn, stride_ym,
                           HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        pdl_wait(PDL)  # as linear.py: dependents launch after the K loop
        # one program per [BLOCK_M, BLOCK_N] output tile
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :]    # [BM, BK]
        q_ptrs = q_ptr + rn[:, None].to(tl.int64) * stride_qn + rk[None, :]    # [BN, BK]
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)  # tl.zeros fails in the 3.9 interpreter
        for k0 in range(0, K, BLOCK_K):
            kmask = (k0 + rk) < K
            x = tl.load(x_ptrs, mask=(rm[:, None] < M) & kmask[None, :], other=0.0)
            # the weight's bytes (uint8: the byte 0 is e4m3's +0), reinterpreted as e4m3
            # and widened: exact in fp16, bf16 and float32
            q = tl.load(q_ptrs, mask=(rn[:, None] < N) & kmask[None, :], other=0)
            w = q.to(tl.float8e4nv, bitcast=True).to(x.dtype)                  # [BN, BK]
            if IEEE:
                acc += tl.dot(x, tl.trans(w), input_precision="ieee")           # [BM, BN]
            else:
                acc += tl.dot(x, tl.trans(w))
            x_ptrs += BLOCK_K
            q_ptrs += BLOCK_K
        pdl_release(PDL)
        nmask = rn < N
        acc = acc * tl.load(s_ptr + rn, mask=nmask, other=0.0)[None, :]
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
        y_ptrs = y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(rm[:, None] < M) & nmask[None, :])


def fp8_config(m: int, n: int, k: int, x_bytes: int = 2) -> dict:
    """Decode tiles: int8's (``int8_config``, the same bytes per weight), untuned for e4m3,
    fewer stages for float32 x (``fit_stages``)."""
    cfg = dict(int8_config(m, n, k))
    cfg.pop("SWAP", None)
    return fit_stages(cfg, x_bytes)


def fp8_linear_triton(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias=None,
                      config=None, mma=False, counters=None) -> torch.Tensor:
    """Same contract as ``fp8_linear_torch`` (W8A8 above ``SKINNY_MAX_ROWS`` rows: x
    rounded to e4m3 too); x may have leading dims. ``config``: the skinny kernel's tiles,
    at any number of rows. ``mma`` (``INFERGRAFT_QUANT_MMA``, bound by
    ``dispatch.get_ops``: False, True or "auto"): with True 1-64 rows on ``fp8_mma``, its
    split-K counted on ``counters``; "auto" keeps this path (``fp8_mma.rows_mma_chosen``)."""
    n, k = check_scaled_rows(x, qweight, scale, bias, FP8, "float8_e4m3fn")
    if not fp8_native(x.device):  # no e4m3 in Triton here (a GPU below sm_89)
        return fp8_linear_torch(x, qweight, scale, bias)
    x2, y, lead = gemm_rows(x, k, n)  # [M, K], [M, N]
    m = x2.shape[0]
    if m == 0 or n == 0:
        return y.reshape(*lead, n)
    if rows_mma_chosen(mma) and config is None and takes_rows_mma(x2, k):
        return rows_mma(x2, qweight, scale, bias, y=y, counters=counters).reshape(*lead, n)
    if m > SKINNY_MAX_ROWS and config is None:
        if w8a8_fits(x2, n, k):
            return fp8_linear_w8a8(x2, qweight, scale, bias).reshape(*lead, n)
        # compute-bound: W widened once (one rounding, to x's dtype) and cuBLAS
        w = dequantize_fp8(qweight, scale).to(x.dtype)
        return F.linear(x2, w, bias).reshape(*lead, n)
    cfg = dict(config or fp8_config(m, n, k, x.element_size()))
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]))
    _fp8_linear_kernel[grid](
        x2, qweight.view(torch.uint8), scale, scale if bias is None else bias, y, m, n, k,
        x2.stride(0), qweight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32, **cfg, **pdl_launch(x.device))
    return y.reshape(*lead, n)
