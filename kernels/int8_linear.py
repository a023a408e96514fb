"""int8 weight-only linear (W8A16): y = x (q * s)^T + b with q int8 [N, K] and one float32
scale per output row s [N] (symmetric, ``quantize_int8``).

The kernel streams the int8 tiles (half the bytes of bf16: decode reads every weight
once a step), widens them to x's dtype in registers (exact: |q| <= 127) and applies the
per-row scale once, in the epilogue, since (x q^T) * s == x (q * s)^T row by row.
"""
import torch
import torch.nn.functional as F

from ._triton import HAVE_TRITON, next_pow2, pdl_launch, pdl_release, pdl_wait, tl, triton
from .cpu_linear import int8_linear_cpu
from .fp8_mma import rows_mma, rows_mma_chosen, takes_rows_mma
from ._rows import check_scaled_rows, fit_stages, gemm_rows


# from here on the GEMM is compute-bound: cuBLAS on the weight widened once beats the int8
# kernel, whose saving is bytes read (docs/kernels.md)
DEQUANT_MIN_ROWS = 4096


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] float -> (q int8 [N, K], scale float32 [N]): s = max|w_row| / 127,
    q = round(w / s); an all-zero row gets s = 1 (q = 0)."""
    assert weight.dim() == 2 and weight.is_floating_point(), \
        f"weight must be a float [N, K] matrix, got {tuple(weight.shape)} {weight.dtype}"
    w = weight.float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def int8_linear_torch(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                      bias=None) -> torch.Tensor:
    # x: [M, K], qweight: [N, K] int8, scale: [N] float32, bias: [N] -> [M, N] in x's dtype
    if x.device.type == "cpu":
        return int8_linear_cpu(x, qweight, scale, bias)
    y = torch.nn.functional.linear(x.float(), qweight.float()) * scale
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


if HAVE_TRITON:

    @triton.jit
    def _int8_linear_kernel(x_ptr, q_ptr, s_ptr, b_ptr, y_ptr, M, N, K,
                            stride_xm, stride_qn, stride_ym,
                            HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP: tl.constexpr,
                            PDL: tl.constexpr):
        pdl_wait(PDL)  # as linear.py: dependents launch after the K loop
        # one program per [BLOCK_M, BLOCK_N] output tile
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :]    # [BM, BK]
        q_ptrs = q_ptr + rn[:, None].to(tl.int64) * stride_qn + rk[None, :]    # [BN, BK]
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)  # tl.zeros fails in the 3.9 interpreter
        acc_t = tl.full((BLOCK_N, BLOCK_M), 0.0, tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kmask = (k0 + rk) < K
            x = tl.load(x_ptrs, mask=(rm[:, None] < M) & kmask[None, :], other=0.0)
            q = tl.load(q_ptrs, mask=(rn[:, None] < N) & kmask[None, :], other=0)
            w = q.to(x.dtype)  # exact: |q| <= 127
            if SWAP:  # y^T = w x^T: the widened w is the MMA's register operand, x^T from smem
                acc_t += tl.dot(w, tl.trans(x))                                   # [BN, BM]
            elif IEEE:
                acc += tl.dot(x, tl.trans(w), input_precision="ieee")           # [BM, BN]
            else:
                acc += tl.dot(x, tl.trans(w))
            x_ptrs += BLOCK_K
            q_ptrs += BLOCK_K
        pdl_release(PDL)
        if SWAP:
            acc = tl.trans(acc_t)
        nmask = rn < N
        acc = acc * tl.load(s_ptr + rn, mask=nmask, other=0.0)[None, :]
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
        y_ptrs = y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(rm[:, None] < M) & nmask[None, :])


def int8_config(m: int, n: int, k: int) -> dict:
    """Decode (few rows): one row tile, narrow column tiles so every SM streams weights,
    long K tiles for the narrow outputs. Prefill: at 65-1023 rows the widened W tile is
    the MMA's register operand (SWAP: no trip through shared memory); from 1024 rows,
    where the swap no longer pays, unswapped 128 x 128 tiles; from
    ``DEQUANT_MIN_ROWS`` cuBLAS on the widened weight (``int8_linear_triton``). Tiles
    from ``python -m infergraft.core.tools.kernel_bench.gemms --int8`` (``--prefill-paths``);
    docs/kernels.md has the figures."""
    if m <= 64:
        wide, narrow = n >= 16384, n < 8192 and m <= 16  # gate_up, lm_head | o, down
        return dict(BLOCK_M=max(16, next_pow2(m)), BLOCK_N=64 if wide else 32,
                    BLOCK_K=512 if narrow else 256, num_warps=4,
                    num_stages=4 if m > 16 and not wide else 3)
    if m >= 1024:  # (from DEQUANT_MIN_ROWS on, cuBLAS on the widened weight instead)
        return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)
    # up to 1023 rows W is the MMA's register operand (SWAP: no trip through shared memory)
    if n >= 16384:  # gate_up, lm_head
        return dict(BLOCK_M=256, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3, SWAP=True)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64 if n >= 8192 else 128, num_warps=8,
                num_stages=3, SWAP=True)


def int8_linear_triton(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias=None,
                       config=None, mma=False, counters=None) -> torch.Tensor:
    """Same contract as ``int8_linear_torch``, one kernel; x may have leading dims. ``mma``
    (``INFERGRAFT_QUANT_MMA``, bound by ``dispatch.get_ops``: False, True or "auto"): with
    True 1-64 rows on ``fp8_mma.int8_mma``'s kernel, its split-K counted on ``counters``;
    "auto" keeps this path (``fp8_mma.rows_mma_chosen``)."""
    n, k = check_scaled_rows(x, qweight, scale, bias, torch.int8, "int8")
    x2, y, lead = gemm_rows(x, k, n)  # [M, K], [M, N]
    m = x2.shape[0]
    if m == 0 or n == 0:
        return y.reshape(*lead, n)
    if rows_mma_chosen(mma) and config is None and takes_rows_mma(x2, k):
        return rows_mma(x2, qweight, scale, bias, y=y, counters=counters).reshape(*lead, n)
    if m >= DEQUANT_MIN_ROWS and config is None and x.dtype != torch.float32:
        # compute-bound: W widened once (one pass, rounded to x's dtype) and cuBLAS
        return F.linear(x2, qweight * scale.to(x.dtype)[:, None], bias).reshape(*lead, n)
    cfg = dict(config or fit_stages(int8_config(m, n, k), x.element_size()))
    cfg["SWAP"] = cfg.get("SWAP", False) and x.dtype != torch.float32  # float32: IEEE dot
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]))
    _int8_linear_kernel[grid](
        x2, qweight, scale, qweight if bias is None else bias, y, m, n, k,
        x2.stride(0), qweight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32, **cfg, **pdl_launch(x.device))
    return y.reshape(*lead, n)
