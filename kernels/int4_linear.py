"""int4 weight-only linear (W4A16, group-wise, asymmetric): y = x W^T + b with W stored as
4-bit codes q, two a byte, and per (row, group of ``group_size`` columns) a float32 scale
s and a zero-point z: W[n, k] ~= (q[n, k] - z[n, g]) * s[n, g], g = k // group_size.

The packed format, ``Int4Weight``, and our quantiser: ``int4_format.py`` (imported from
here too).

``int4_linear_triton``'s paths (``int4_config``): at one row ``int4_gemv.py``'s GEMV; up
to ``WIDEN_MIN_ROWS`` the tensor-core kernel here (with ``mma``, ``INFERGRAFT_QUANT_MMA``:
``int4_mma.py``'s at up to 64 rows, groups of 128, from ``MMA_MIN_ROWS`` rows under its
default ``auto``: ``int4_mma_chosen``), each byte loaded once, its low nibbles
dotted with x's even columns and its high ones with the odd (q - z exact in x's dtype,
each K tile's float32 dot scaled by its group's scale); then W widened once and cuBLAS.
Each is ``int4_linear_torch``'s float32 math up to summation order (the widened W
rounded to x's dtype, as ``dequantize_int4``).
"""
import torch
import torch.nn.functional as F

from ._triton import HAVE_TRITON, next_pow2, pdl_launch, pdl_release, pdl_wait, tl, triton
from ._rows import gemm_rows
from .int4_format import (GROUP_SIZES, Int4Weight, dequantize_float,  # noqa: F401
                          dequantize_int4, pack_nibbles, quantize_int4, unpack_nibbles)
from .int4_gemv import gemv_config, int4_gemv_triton, reduce_partials, split_for
from .int4_mma import int4_mma, takes_mma

# up to this many rows the CUDA-core GEMV (int4_gemv.py); from WIDEN_MIN_ROWS on, cuBLAS on
# the widened weight; the tensor-core tiles between (docs/kernels.md)
GEMV_MAX_ROWS = 2
WIDEN_MIN_ROWS = 512
# INFERGRAFT_QUANT_MMA=auto: from this many rows int4_mma (where it takes the GEMM: up to
# its MAX_ROWS, groups of 128), fewer rows the paths above: at one row the GEMV beat it, at
# 16 and 32 rows it beat the tiles (docs/bench/quant-mma.md; 2-15 rows unmeasured)
MMA_MIN_ROWS = 16


def int4_mma_chosen(mma, m: int) -> bool:
    """Whether ``mma`` (``INFERGRAFT_QUANT_MMA``'s value: False, True or "auto") sends an
    M-row int4 GEMM to ``int4_mma`` where that kernel takes it (``int4_mma.takes_mma``):
    True at every row count, "auto" from ``MMA_MIN_ROWS`` rows, False never."""
    if mma == "auto":
        return m >= MMA_MIN_ROWS
    assert isinstance(mma, bool), f"mma is False, True or 'auto', got {mma!r}"
    return mma


def int4_linear_torch(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                      zeros: torch.Tensor, group_size: int, in_features: int,
                      bias=None) -> torch.Tensor:
    # x: [..., K], qweight: [N, ceil(K / 2)] uint8, scales / zeros: [N, G] -> [..., N] in x's dtype
    w = dequantize_float(qweight, scales, zeros, group_size, in_features)
    y = F.linear(x.float(), w)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


if HAVE_TRITON:

    @triton.jit
    def _nibbles(b, z):
        """Bytes b [BN, C] (int32) and zero-points z [BN, 1] (float32) -> the float32
        (q - z) of the low and the high nibbles, exact, with no int -> float convert:
        0x4B000000 is 2^23's bits, so a byte OR-ed in reads as 2^23 + b, and masked to
        its high nibble as 2^23 + 16 q_hi."""
        v = b | 0x4B000000
        h = (v & 0x4B0000F0).to(tl.float32, bitcast=True)
        lo = (v.to(tl.float32, bitcast=True) - h) - z
        hi = h * 0.0625 - (524288.0 + z)  # h / 16 = 2^19 + q_hi
        return lo, hi

    @triton.jit(do_not_specialize=["M", "N", "G", "K_SPLIT", "stride_ys"])
    def _int4_linear_kernel(x_ptr, q_ptr, s_ptr, z_ptr, b_ptr, y_ptr, M, N, K, KP, G,
                            K_SPLIT, stride_xm, stride_qn, stride_ym, stride_ys,
                            GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, SWAP: tl.constexpr, XSPLIT: tl.constexpr,
                            PARTIAL: tl.constexpr, PDL: tl.constexpr):
        pdl_wait(PDL)  # as linear.py: dependents launch after the K loop
        # one program per [BLOCK_M, BLOCK_N] output tile and K_SPLIT columns of K (split
        # s writes float32 partials at y + s * stride_ys); BLOCK_K divides GROUP, so a K
        # tile has one scale and zero-point per row of W. Each byte is loaded once: its
        # low nibbles meet x's even columns, its high ones the odd columns (two dots)
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rc = tl.arange(0, BLOCK_K // 2)
        mmask, nmask = rm < M, rn < N
        x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm                   # [BM, 1]
        q_rows = q_ptr + rn[:, None].to(tl.int64) * stride_qn                   # [BN, 1]
        sz_rows = rn.to(tl.int64) * G                                           # [BN]
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)  # tl.zeros fails in the 3.9 interpreter
        acc_t = tl.full((BLOCK_N, BLOCK_M), 0.0, tl.float32)
        k_lo = tl.program_id(2) * K_SPLIT
        for k0 in range(k_lo, tl.minimum(k_lo + K_SPLIT, K), BLOCK_K):
            c = k0 // 2 + rc  # byte columns                                    # [BK/2]
            if XSPLIT:  # x's columns in one contiguous load, split in registers
                rk = k0 + tl.arange(0, BLOCK_K)
                x = tl.load(x_rows + rk[None, :], mask=mmask[:, None] & (rk < K)[None, :],
                            other=0.0)                                          # [BM, BK]
                xe, xo = tl.split(tl.reshape(x, (BLOCK_M, BLOCK_K // 2, 2)))
            else:  # x's even and odd columns, each loaded with stride 2
                xe = tl.load(x_rows + 2 * c[None, :], mask=mmask[:, None] & (2 * c < K)[None, :],
                             other=0.0)                                         # [BM, BK/2]
                xo = tl.load(x_rows + 2 * c[None, :] + 1,
                             mask=mmask[:, None] & (2 * c + 1 < K)[None, :], other=0.0)
            b = tl.load(q_rows + c[None, :], mask=nmask[:, None] & (c < KP)[None, :],
                        other=0).to(tl.int32)                                   # [BN, BK/2]
            g = k0 // GROUP
            z = tl.load(z_ptr + sz_rows + g, mask=nmask, other=0).to(tl.float32)  # [BN]
            s = tl.load(s_ptr + sz_rows + g, mask=nmask, other=0.0)             # [BN]
            lo, hi = _nibbles(b, z[:, None])
            lo = lo.to(xe.dtype)  # exact: |q - z| <= 15
            hi = hi.to(xe.dtype)
            if SWAP:  # y^T = W x^T: W is the MMA's register operand, x^T from smem
                part = tl.dot(lo, tl.trans(xe))
                acc_t += tl.dot(hi, tl.trans(xo), part) * s[:, None]            # [BN, BM]
            elif IEEE:
                part = tl.dot(xe, tl.trans(lo), input_precision="ieee")
                acc += tl.dot(xo, tl.trans(hi), part, input_precision="ieee") * s[None, :]
            else:
                part = tl.dot(xe, tl.trans(lo))
                acc += tl.dot(xo, tl.trans(hi), part) * s[None, :]               # [BM, BN]
        pdl_release(PDL)
        if SWAP:
            acc = tl.trans(acc_t)
        mask = mmask[:, None] & nmask[None, :]
        y_ptrs = y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :]
        if PARTIAL:
            tl.store(y_ptrs + tl.program_id(2) * stride_ys, acc, mask=mask)
        else:
            if HAS_BIAS:
                acc += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _int4_widen_kernel(q_ptr, s_ptr, z_ptr, w_ptr, N, K, KP, G, stride_qn, stride_wn,
                           GROUP: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
        # program (n, g): rows rn of W, group g -> its GROUP columns in w's dtype, the
        # float32 (q - z) s of dequantize_float rounded once
        pdl_wait(PDL)
        pdl_release(PDL)
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        g = tl.program_id(1)
        nmask = rn < N
        c = g * (GROUP // 2) + tl.arange(0, GROUP // 2)                         # [GROUP/2]
        b = tl.load(q_ptr + rn[:, None].to(tl.int64) * stride_qn + c[None, :],
                    mask=nmask[:, None] & (c < KP)[None, :], other=0).to(tl.int32)
        z = tl.load(z_ptr + rn.to(tl.int64) * G + g, mask=nmask, other=0).to(tl.float32)
        s = tl.load(s_ptr + rn.to(tl.int64) * G + g, mask=nmask, other=0.0)[:, None]
        lo, hi = _nibbles(b, z[:, None])
        w = tl.interleave(lo * s, hi * s).to(w_ptr.dtype.element_ty)  # column 2c, then 2c + 1
        cols = g * GROUP + tl.arange(0, GROUP)                                  # [GROUP]
        tl.store(w_ptr + rn[:, None].to(tl.int64) * stride_wn + cols[None, :], w,
                 mask=nmask[:, None] & (cols < K)[None, :])


def int4_config(m: int, n: int, k: int, group_size: int) -> dict:
    """The path and meta-parameters of an M x N x K int4 GEMM (untuned: ``python -m
    infergraft.core.tools.kernel_bench.int4 --sweep`` decides the tiles and both thresholds).
    "gemv", up to ``GEMV_MAX_ROWS`` rows: ``int4_gemv``'s CUDA-core loop, whose FMAs grow
    with the rows while the tensor cores' come free. "tiles": the tensor-core kernel,
    BLOCK_K dividing group_size, 128 columns a tile; up to 64 rows one row tile (17-32
    rows W x^T, W the MMA's register operand), above 64 x 128 tiles (128-row tiles spill
    registers: the per-tile scale needs a second accumulator); split-K where the tiles
    leave SMs idle. "widen", from ``WIDEN_MIN_ROWS`` rows (compute-bound): W widened to
    x's dtype in one pass, then cuBLAS."""
    if m <= GEMV_MAX_ROWS:
        return gemv_config(m, n, k, group_size)
    if m >= WIDEN_MIN_ROWS:
        return dict(PATH="widen", BLOCK_N=32, num_warps=4)
    return tiles_config(m, n, k, group_size)


def tiles_config(m: int, n: int, k: int, group_size: int) -> dict:
    """The tensor-core kernel's tiles for M rows (``int4_config``'s "tiles"): 64-column K
    tiles, split K until four programs an SM (at most 8 ways), the best of the H200 sweep
    at 4-32 rows."""
    bm = min(64, max(16, next_pow2(m)))
    bk = min(group_size, 64)
    split = split_for(-(-m // bm) * -(-n // 128), -(-k // bk), max_split=8, min_tiles=2,
                      per_sm=4)
    return dict(PATH="tiles", BLOCK_M=bm, BLOCK_N=128, BLOCK_K=bk, SPLIT=split,
                SWAP=16 < m <= 32, XSPLIT=True, num_warps=4, num_stages=3)


def int4_linear_triton(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                       zeros: torch.Tensor, group_size: int, in_features: int, bias=None,
                       config=None, mma=False, counters=None) -> torch.Tensor:
    """Same contract as ``int4_linear_torch``; x may have leading dims. ``config``: an
    ``int4_config`` dict (a dict without PATH is the tiled kernel's). ``mma``
    (``INFERGRAFT_QUANT_MMA``, bound by ``dispatch.get_ops``: False, True or "auto"): the
    GEMMs ``int4_mma`` takes (1-64 rows, groups of 128) go to it where ``int4_mma_chosen``
    says, its split-K counted on ``counters``."""
    k = in_features
    n, kp = qweight.shape
    g = -(-k // group_size)
    assert group_size in GROUP_SIZES, f"group_size {group_size} not one of {GROUP_SIZES}"
    assert qweight.dtype == torch.uint8 and qweight.is_contiguous() and kp == -(-k // 2), \
        f"qweight must be contiguous uint8 [N, {-(-k // 2)}], got {tuple(qweight.shape)} " \
        f"{qweight.dtype}"
    assert x.shape[-1] == k, f"x has K={x.shape[-1]} but in_features is {k}"
    assert x.dtype in (torch.float32, torch.float16, torch.bfloat16), f"x dtype {x.dtype}"
    assert scales.shape == (n, g) and scales.dtype == torch.float32 and scales.is_contiguous(), \
        f"scales must be contiguous float32 [{n}, {g}], got {tuple(scales.shape)} {scales.dtype}"
    assert zeros.shape == (n, g) and zeros.dtype == torch.uint8 and zeros.is_contiguous(), \
        f"zeros must be contiguous uint8 [{n}, {g}], got {tuple(zeros.shape)} {zeros.dtype}"
    assert bias is None or bias.shape == (n,), f"bias must be [{n}], got {tuple(bias.shape)}"
    for name, t in (("qweight", qweight), ("scales", scales), ("zeros", zeros), ("bias", bias)):
        assert t is None or t.device == x.device, f"{name} on {t.device} but x on {x.device}"
    x2, y, lead = gemm_rows(x, k, n)  # [M, K], [M, N]
    m = x2.shape[0]
    if m == 0 or n == 0:
        return y.reshape(*lead, n)
    if int4_mma_chosen(mma, m) and config is None and takes_mma(x2, group_size, k):
        return int4_mma(x2, qweight, scales, zeros, group_size, k, bias, y=y,
                        counters=counters).reshape(*lead, n)
    cfg = dict(config or int4_config(m, n, k, group_size))
    path = cfg.pop("PATH", "tiles")
    assert path in ("gemv", "tiles", "widen"), f"config PATH {path!r}: gemv, tiles or widen"
    if path == "gemv":
        int4_gemv_triton(x2, qweight, scales, zeros, group_size, k, bias, cfg, y=y)
        return y.reshape(*lead, n)
    pdl = pdl_launch(x.device)
    if path == "widen":
        # compute-bound: W widened once (rounded to x's dtype, as dequantize_int4) + cuBLAS
        w = torch.empty((n, k), dtype=x.dtype, device=x.device)
        bn = cfg.pop("BLOCK_N")
        _int4_widen_kernel[(triton.cdiv(n, bn), g)](
            qweight, scales, zeros, w, n, k, kp, g, qweight.stride(0), w.stride(0),
            GROUP=group_size, BLOCK_N=bn, **cfg, **pdl)
        return F.linear(x2, w, None if bias is None else bias.to(x.dtype)).reshape(*lead, n)
    bk = cfg["BLOCK_K"]
    assert group_size % bk == 0, f"BLOCK_K {bk} must divide {group_size}"
    cfg.setdefault("XSPLIT", False)
    cfg["SWAP"] = cfg.get("SWAP", False) and x.dtype != torch.float32  # float32: IEEE dot
    tiles = -(-k // bk)
    per = -(-tiles // cfg.pop("SPLIT", 1))
    split = -(-tiles // per)  # no empty split
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]), split)
    out = y if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    _int4_linear_kernel[grid](
        x2, qweight, scales, zeros, qweight if bias is None else bias, out, m, n, k, kp, g,
        per * bk, x2.stride(0), qweight.stride(0), n, m * n, GROUP=group_size,
        HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32, PARTIAL=split > 1, **cfg,
        **pdl)
    if split > 1:
        reduce_partials(out, bias, y)
    return y.reshape(*lead, n)
