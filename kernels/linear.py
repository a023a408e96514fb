"""Skinny GEMM for decode: y = x W^T (+ b) with few rows (M <= 64), weight-bandwidth bound.

At decode every weight is read once a step, so the kernel streams W at HBM bandwidth:
tiles of W [BLOCK_N, BLOCK_K] through a pipelined tl.dot (x's rows padded to 16, free in
a memory-bound GEMM). One row takes kernels/gemv.py's register loops instead (16-bit
weights; int8 / e4m3 ones with INFERGRAFT_GEMV_INT8 / _FP8). Larger M goes to cuBLAS.

Split-K (``skinny_gemm(split_k=)``, chosen by ``linear_partials.py``): float32 partial
sums [S, M, N], added up by the add+RMSNorm that follows.

8-bit weight rows (``w_scale``: q int8 or e4m3 [N, K], a float32 scale s each, W = q s[:, None];
``int8_linear.py``, ``fp8_linear.py``): widened exactly in registers, scaled in the epilogue;
with ``WORDS`` tiles read as int32 words and widened by bit tricks (``fp8_mma.dot_words``).
"""
import torch

from . import switches
from .cpu_linear import linear_cpu
from ._triton import HAVE_TRITON, interpreting, next_pow2, pdl_launch, pdl_release, pdl_wait, \
    tl, triton
from .fp8_mma import dot_words
from .gemv import gemv_config, gemv_dot, gemv_dot_int8, takes_gemv
from ._rows import check_row_dtype
from .rotary import rope_pair_store

# above this many rows cuBLAS streams the weights as fast as this kernel (docs/kernels.md)
MAX_SKINNY_M = switches.value("INFERGRAFT_SKINNY_MAX_M")
MAX_ROWS = 64  # what the kernel takes (split-K partials use it up to here)
# release dependents after the K loop: launched early, the next GEMM's CTAs would hold
# SMs (and shared memory) this GEMM's later CTAs need (INFERGRAFT_PDL_LATE=0: at the start)
LATE_PDL_RELEASE = switches.value("INFERGRAFT_PDL_LATE")
# 2-32 rows, 16-bit weights: some GEMMs take y^T = W x^T tiles (INFERGRAFT_SWAP=0: never)
SWAP_TILES = switches.value("INFERGRAFT_SWAP")


def linear_torch(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    # x: [M, K], weight: [N, K], bias: [N] -> [M, N]; float32 on the CPU spread over the
    # threads (cpu_linear: row blocks at a few rows, oneDNN above), else F.linear
    return linear_cpu(x, weight, bias)


if HAVE_TRITON:

    @triton.jit
    def _skinny_gemm_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, ss_ptr, r_ptr, ss_out_ptr,
                            M, N, K, K_SPLIT, UP_ROWS, SS_PARTS, stride_xm, stride_wn,
                            stride_ym, stride_ys, stride_rm, eps,
                            pos_ptr, cos_ptr, sin_ptr, idx0_ptr, idx1_ptr, kc_ptr, vc_ptr,
                            stride_cs, stride_c0, stride_c1, stride_ch, HQ, HKV,
                            HAS_BIAS: tl.constexpr, W_SCALE: tl.constexpr, NORM: tl.constexpr,
                            BLOCK_P: tl.constexpr, SWIGLU: tl.constexpr, ROPE: tl.constexpr,
                            RESIDUAL: tl.constexpr, SUM_SQ: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
                            LATE_RELEASE: tl.constexpr, GEMV: tl.constexpr = False,
                            DEPTH: tl.constexpr = 1, EARLY: tl.constexpr = False,
                            SWAP: tl.constexpr = False, W_FP8: tl.constexpr = False,
                            WORDS: tl.constexpr = False, W_STEP: tl.constexpr = 0,
                            ASM: tl.constexpr = False):
        # one program per (BLOCK_N output columns, K_SPLIT slice of K); all M rows at
        # once, so W is read once; split s writes its partial sums to y + s * stride_ys.
        # Fusions (kernels/fused_linear.py), all outside the loop, whose operands stay
        # plain loads (x * g on the x operand costs Triton its software pipelining):
        # NORM = RMSNorm of x with its weight folded into W's columns: * rstd from the
        # row's sum of squares, SS_PARTS partial sums ss [P, M]; SWIGLU = silu(x Wg^T) *
        # (x Wu^T), Wu UP_ROWS rows below Wg; RESIDUAL = + r; SUM_SQ = each output row's
        # sum of squares over this program's columns, to ss_out [programs, M]; ROPE = the
        # qkv projection at decode: columns paired with their rotate-half partners (UP_ROWS
        # = head_dim / 2 below), rotated, q stored to y [M, HQ * D], k / v to cache slots.
        # W_SCALE: W is 8-bit rows (int8; e4m3 with W_FP8), a float32 scale s [N] each: (x q^T) s;
        # WORDS (INFERGRAFT_QUANT_MMA): read as int32 words, W_STEP a row a K step, widened by
        # bit tricks (fp8_mma.dot_words; ASM: its inline assembly).
        pid = tl.program_id(0)
        split = tl.program_id(1)
        k_lo = split * K_SPLIT
        k_hi = tl.minimum(k_lo + K_SPLIT, K)
        rm = tl.arange(0, BLOCK_M)
        if ROPE:  # head pid // tiles of a half-head, BLOCK_N dims from j0 (and j0 + D/2)
            head = pid // (UP_ROWS // BLOCK_N)
            j0 = pid % (UP_ROWS // BLOCK_N) * BLOCK_N
            rn = head * 2 * UP_ROWS + j0 + tl.arange(0, BLOCK_N)
        else:
            rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        if GEMV and W_SCALE:  # one row of 8-bit words (w_ptr: the int32 view)
            acc, acc_up = gemv_dot_int8(x_ptr, w_ptr, rn, N, K, stride_wn, UP_ROWS,
                                        SWIGLU or ROPE, BLOCK_K, EARLY, PDL, W_FP8)  # [1, BN]
        elif GEMV:  # one row, one split: W in registers, first tiles before the PDL wait
            acc, acc_up = gemv_dot(x_ptr, w_ptr, rn, N, K, stride_wn, UP_ROWS, SWIGLU or ROPE,
                                   BLOCK_K, DEPTH, EARLY, PDL)                  # [1, BN]
        else:
            pdl_wait(PDL)
            if not LATE_RELEASE:
                pdl_release(PDL)
            rk = tl.arange(0, BLOCK_K)
            rw = tl.arange(0, W_STEP)  # W's columns a step: BLOCK_K, or BLOCK_K / 4 words
            x_ptrs = x_ptr + rm[:, None] * stride_xm + (k_lo + rk)[None, :]            # [BM, BK]
            w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + \
                (k_lo // (BLOCK_K // W_STEP) + rw)[None, :]                       # [BN, W_STEP]
            # SWAP: y^T = W x^T, W's tile the MMA's wide (64-row) operand and x^T its narrow one
            acc = tl.full((BLOCK_N, BLOCK_M) if SWAP else (BLOCK_M, BLOCK_N), 0.0, tl.float32)
            acc_up = tl.full((BLOCK_N, BLOCK_M) if SWAP else (BLOCK_M, BLOCK_N), 0.0, tl.float32)
            for k0 in range(k_lo, k_hi, BLOCK_K):
                kmask = (k0 + rk) < k_hi
                wmask = (rn[:, None] < N) & ((k0 + rw * (BLOCK_K // W_STEP)) < k_hi)[None, :]
                x = tl.load(x_ptrs, mask=(rm[:, None] < M) & kmask[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=wmask, other=0.0)
                if WORDS:
                    acc = dot_words(x, w, acc, W_FP8, SWAP, ASM)
                else:
                    if W_SCALE:  # 8-bit -> x's dtype, exact; e4m3 as bytes (a masked 0 is +0)
                        w = (w.to(tl.float8e4nv, bitcast=True) if W_FP8 else w).to(x.dtype)
                    if SWAP:
                        acc += tl.dot(w, tl.trans(x))                           # [BN, BM]
                    else:
                        acc += tl.dot(x, tl.trans(w))                           # [BM, BN]
                if SWIGLU or ROPE:
                    wu = tl.load(w_ptrs + UP_ROWS * stride_wn, mask=wmask, other=0.0)
                    if WORDS:
                        acc_up = dot_words(x, wu, acc_up, W_FP8, SWAP, ASM)
                    else:
                        if W_SCALE:
                            wu = (wu.to(tl.float8e4nv, bitcast=True) if W_FP8 else wu).to(x.dtype)
                        if SWAP:
                            acc_up += tl.dot(wu, tl.trans(x))                   # [BN, BM]
                        else:
                            acc_up += tl.dot(x, tl.trans(wu))                   # [BM, BN]
                x_ptrs += BLOCK_K
                w_ptrs += W_STEP
            if LATE_RELEASE:
                pdl_release(PDL)
            if SWAP:
                acc = tl.trans(acc)                                             # [BM, BN]
                acc_up = tl.trans(acc_up)
        rmask = rm < M
        if W_SCALE:  # each column's weight-row scale; acc_up's rows sit UP_ROWS below
            acc = acc * tl.load(s_ptr + rn, mask=rn < N, other=0.0)[None, :]
            if SWIGLU or ROPE:
                acc_up = acc_up * tl.load(s_ptr + UP_ROWS + rn, mask=rn < N, other=0.0)[None, :]
        if NORM:
            rp = tl.arange(0, BLOCK_P)
            ss = tl.load(ss_ptr + rp[:, None] * M + rm[None, :],
                         mask=(rp < SS_PARTS)[:, None] & rmask[None, :], other=0.0)  # [P, BM]
            rstd = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / K + eps)                  # [BM]
            acc = acc * rstd[:, None]
            acc_up = acc_up * rstd[:, None]
        if HAS_BIAS:
            if split == 0:  # the bias goes into one split only
                acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
                if SWIGLU or ROPE:
                    acc_up += tl.load(b_ptr + UP_ROWS + rn, mask=rn < N,
                                      other=0.0).to(tl.float32)[None, :]
        out_ty = y_ptr.dtype.element_ty
        if ROPE:  # the projection rounded, as rotary_kv_write gets it
            rope_pair_store(acc.to(out_ty).to(tl.float32), acc_up.to(out_ty).to(tl.float32),
                            rm, rmask, head, j0, UP_ROWS, y_ptr, stride_ym, pos_ptr, cos_ptr,
                            sin_ptr, stride_cs, idx0_ptr, idx1_ptr, kc_ptr, vc_ptr, stride_c0,
                            stride_c1, stride_ch, HQ, HKV, BLOCK_N)
            return
        if SWIGLU:  # rounded like silu_mul on the stored gate_up: silu(g) then the product
            gate = acc.to(out_ty).to(tl.float32)
            act = (gate * tl.sigmoid(gate)).to(out_ty).to(tl.float32)
            acc = act * acc_up.to(out_ty).to(tl.float32)
        ymask = rmask[:, None] & (rn[None, :] < N)
        if RESIDUAL:  # the projection rounded, then + r like `x + residual` in torch
            r = tl.load(r_ptr + rm[:, None] * stride_rm + rn[None, :], mask=ymask, other=0.0)
            acc = acc.to(out_ty).to(tl.float32) + r.to(tl.float32)
        y = acc.to(out_ty)
        y_ptrs = y_ptr + split * stride_ys + rm[:, None] * stride_ym + rn[None, :]
        tl.store(y_ptrs, y, mask=ymask)
        if SUM_SQ:  # the next RMSNorm's statistic, of the stored (rounded) values
            yf = tl.where(ymask, y.to(tl.float32), 0.0)
            tl.store(ss_out_ptr + pid * M + rm, tl.sum(yf * yf, axis=1), mask=rmask)


def skinny_config(m: int, n: int, k: int, gemv: bool = True) -> dict:
    """Tiles for [M, K] x [N, K]^T, from a sweep over the LLaMA-7B decode GEMMs (``python
    -m infergraft.core.tools.kernel_bench.gemms``): wide N likes wide tiles, narrow N long K tiles.
    ``gemv`` (16-bit weights, one split): one row takes kernels/gemv.py's register loop,
    2-32 rows the SWAP tiles (W the MMA's 64-row operand) where faster (docs/kernels.md)."""
    if takes_gemv(m, gemv):
        return gemv_config("wide" if n >= 8192 else "o" if k <= 4096 else "down")
    block_m = max(16, next_pow2(m))
    if n >= 16384:  # gate_up, lm_head: above 16 rows shorter K tiles, one more stage
        return dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=128 if m <= 16 else 64, num_warps=4,
                    num_stages=3 if m <= 16 else 4)
    swap = gemv and SWAP_TILES and m <= 32
    # fused qkv: swapped, W's 64 rows are the MMA's M side (wgmma; x's 16-32 are too few)
    if n >= 8192:
        if swap:
            return dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4,
                        SWAP=True)
        return dict(BLOCK_M=block_m, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=4)
    if swap and m <= 16:  # o, down (+ residual): swapped tiles too, up to 16 rows
        return dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=5,
                    SWAP=True)
    return dict(BLOCK_M=block_m, BLOCK_N=32, BLOCK_K=512, num_warps=4, num_stages=4)  # o, down


def linear_triton(x: torch.Tensor, weight: torch.Tensor, bias=None, config=None) -> torch.Tensor:
    # x: [M, K] (last dim contiguous), weight: [N, K] contiguous -> new [M, N]
    assert x.dim() == 2 and weight.dim() == 2, f"x {tuple(x.shape)}, weight {tuple(weight.shape)}"
    # float32 stays on cuBLAS (exact fp32, no tf32): the skinny path is for bf16/fp16
    if x.shape[0] > MAX_SKINNY_M or x.shape[0] == 0 or x.dtype == torch.float32:
        return linear_torch(x, weight, bias)  # cuBLAS on CUDA
    return skinny_gemm(x, weight, bias, config)


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias=None, config=None,
                split_k: int = 1) -> torch.Tensor:
    """The Triton kernel itself, any float dtype (tests call it directly in float32).
    ``split_k`` > 1: float32 partial sums [S, M, N] (S <= split_k: splits are whole
    K tiles) whose sum over S is the product; 1: [M, N] in x's dtype."""
    m, k = x.shape
    n = weight.shape[0]
    check_gemm(x, weight, bias)
    assert 0 < m <= MAX_ROWS, f"skinny GEMM takes 1..{MAX_ROWS} rows, got {m}"
    cfg = dict(config or skinny_config(m, n, k, gemv=split_k == 1))
    if split_k > 1:  # whole K tiles per split; splits past K are dropped
        block_k = cfg["BLOCK_K"]
        k_split = -(-k // split_k // block_k) * block_k
        splits = -(-k // k_split)
        y = torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    else:
        k_split, splits = max(k, 1), 1
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), splits)
    launch_gemm(grid, cfg, x, weight, bias, y, k_split=k_split)
    return y


def check_gemm(x: torch.Tensor, weight: torch.Tensor, bias=None, scale=None) -> None:
    """What ``_skinny_gemm_kernel`` needs of x [M, K], weight [N, K] (x's dtype, or 8-bit
    rows, int8 or float8_e4m3fn, with their ``scale`` [N]) and bias [N]."""
    k, n = x.shape[1], weight.shape[0]
    assert weight.dim() == 2 and weight.shape[1] == k, f"x has K={k} but weight is {tuple(weight.shape)}"
    if scale is None:
        assert x.dtype == weight.dtype, f"x {x.dtype} != weight {weight.dtype} (8-bit rows need a scale)"
    else:
        check_row_dtype(weight)
        assert scale.shape == (n,) and scale.dtype == torch.float32 and scale.is_contiguous(), \
            f"scale must be contiguous float32 [{n}] (one per weight row), got " \
            f"{tuple(scale.shape)} {scale.dtype} stride {scale.stride()}"
    assert weight.is_contiguous() and (k <= 1 or x.stride(1) == 1), "weight and x rows must be contiguous"
    assert bias is None or bias.shape == (n,), f"bias must be [{n}]"


def launch_gemm(grid, cfg, x, weight, bias, y, *, k_split=None, sum_sq=None, eps=0.0,
                residual=None, up_rows=0, sum_sq_out=None, rope=None, w_scale=None):
    """Launch ``_skinny_gemm_kernel`` (callers check shapes), each fusion on where its input
    is given: ``sum_sq`` [P, M] float32 partials (RMSNorm, weight folded into W); ``up_rows``
    > 0: SwiGLU; ``sum_sq_out`` [programs, M]; ``w_scale`` [N]: W = 8-bit q * s[:, None];
    ``rope`` = (positions, cos, sin, idx0, idx1, k_cache, v_cache, Hq, Hkv), ``up_rows`` =
    D / 2: the decode qkv projection, y = rotated q [M, Hq * D]."""
    m, k = x.shape
    fp8 = w_scale is not None and weight.dtype == torch.float8_e4m3fn  # read as bytes
    # 8-bit rows as int32 words of 4 bytes: the one-row loop's, or the WORDS tiles'
    words = (cfg.get("GEMV") or cfg.get("WORDS")) and w_scale is not None
    step = cfg["BLOCK_K"] // 4 if cfg.get("WORDS") else cfg.get("BLOCK_K", 0)
    if cfg.get("WORDS") and not (words and k % 4 == 0):
        raise ValueError(f"the WORDS tiles take 8-bit rows with K a multiple of 4, got K={k}, "
                         f"weight {weight.dtype}")
    if cfg.get("GEMV") and not (m == 1 and grid[1] == 1 and cfg.get("DEPTH", 1) in (1, 2)
                                and (not words or k % 4 == cfg.get("DEPTH", 1) - 1 == 0)):
        raise ValueError(f"the one-row GEMV loop takes M=1 unsplit with DEPTH 1 or 2 (8-bit "
                         f"rows: 1, K a multiple of 4), got M={m}, {grid[1]} splits, "
                         f"DEPTH={cfg.get('DEPTH', 1)}, K={k}, weight {weight.dtype}")
    weight = weight.view(torch.int32) if words else weight.view(torch.uint8) if fp8 else weight
    unused = weight  # a valid pointer for the inputs a variant never reads
    pos, cos, sin, idx0, idx1, kc, vc, hq, hkv = rope or (unused,) * 7 + (0, 0)

    def opt(t):
        return unused if t is None else t

    _skinny_gemm_kernel[grid](
        x, weight, opt(w_scale), opt(bias), y, opt(sum_sq), opt(residual), opt(sum_sq_out),
        m, weight.shape[0] if rope else y.shape[-1], k, k_split or max(k, 1), up_rows,
        1 if sum_sq is None else sum_sq.shape[0],
        x.stride(0), weight.stride(0), y.stride(-2), m * y.shape[-1],
        0 if residual is None else residual.stride(0), float(eps),
        pos, cos, sin, idx0, idx1, kc, vc, cos.stride(0) if rope else 0,
        *(kc.stride()[:3] if rope else (0, 0, 0)), hq, hkv,
        HAS_BIAS=bias is not None, W_SCALE=w_scale is not None, NORM=sum_sq is not None,
        BLOCK_P=1 if sum_sq is None else next_pow2(sum_sq.shape[0]), ROPE=rope is not None,
        SWIGLU=up_rows > 0 and rope is None, RESIDUAL=residual is not None,
        SUM_SQ=sum_sq_out is not None, W_FP8=fp8, **cfg, W_STEP=step,
        ASM=bool(cfg.get("WORDS")) and not interpreting(), LATE_RELEASE=LATE_PDL_RELEASE,
        **pdl_launch(x.device))
