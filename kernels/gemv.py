"""The skinny GEMM's one-row loop (batch-1 decode): W tiles in registers, CUDA-core FMAs.

At one row a tensor-core tile pads x to 16 rows and stages W through shared memory: the
o / down tiles take 192 KB of it, so under programmatic dependent launch (PDL) the next
kernel's CTAs cannot become resident until this kernel's have left, and every launch
begins with an idle memory pipe. Here W goes straight to registers, so the next kernel's
CTAs sit beside this one's, and each requests its first tiles *before* its PDL wait:
weights depend on no earlier kernel, so those bytes arrive while the previous kernel
finishes. int8 rows (``INFERGRAFT_GEMV_INT8``, on) take ``gemv_dot_int8``: a convert
instruction per byte would bound the loop, so it reads rows as int32 words and widens each
byte through a float's mantissa (integer ops and one add). e4m3 rows (``fp8``) take the
same words with ``INFERGRAFT_GEMV_FP8`` (off: unmeasured), else the tensor-core tiles.
docs/kernels.md has the figures.
"""
from . import switches
from ._triton import HAVE_TRITON, pdl_release, pdl_wait, tl, triton

# one-row GEMMs take this loop (INFERGRAFT_GEMV=0: the tensor-core tiles instead)
GEMV_ON = switches.value("INFERGRAFT_GEMV")
# one-row int8 GEMMs of the fused layer too (gemv_dot_int8), not the MMA tiles (kernels.md)
GEMV_INT8 = switches.value("INFERGRAFT_GEMV_INT8")
# one-row e4m3 GEMMs of the fused layer through the same word loop (off: not yet measured)
GEMV_FP8 = switches.value("INFERGRAFT_GEMV_FP8")

# tiles per decode GEMM at one row (BLOCK_N rows of W per program, paired kinds take
# BLOCK_N more: SwiGLU's up rows, RoPE's rotate-half partners); DEPTH tiles in flight;
# EARLY: dependents may launch at the start (no shared memory to hold them back). Each
# kind's tiles are the best of a coordinate sweep inside the batch-1 decode step, since
# alone a GEMM does not see its neighbours' PDL overlap
GEMV_TILES = {
    "wide": dict(BLOCK_N=32, BLOCK_K=256, num_warps=4, DEPTH=1, EARLY=True),     # N >= 8192
    "o": dict(BLOCK_N=16, BLOCK_K=512, num_warps=8, DEPTH=2, EARLY=True),        # K <= 4096
    "down": dict(BLOCK_N=8, BLOCK_K=512, num_warps=8, DEPTH=1, EARLY=True),      # K > 4096
    "swiglu": dict(BLOCK_N=16, BLOCK_K=256, num_warps=4, DEPTH=1, EARLY=True),
    "qkv_rope": dict(BLOCK_N=16, BLOCK_K=256, num_warps=4, DEPTH=1, EARLY=False),
}


def takes_gemv(m: int, gemv: bool = True) -> bool:
    """Whether an M-row GEMM takes the one-row loop (``gemv``: the caller allows it)."""
    return m == 1 and gemv and GEMV_ON


def gemv_config(kind: str) -> dict:
    """Meta-parameters of ``_skinny_gemm_kernel``'s one-row loop for a decode GEMM kind."""
    return dict(GEMV_TILES[kind], BLOCK_M=1, GEMV=True, num_stages=1)


def gemv_kind(n: int, k: int) -> str:
    """The tile kind of a plain decode GEMM [1, K] x [N, K]^T."""
    return "wide" if n >= 8192 else "o" if k <= 4096 else "down"


def takes_int8_gemv(m: int, k: int, fp8: bool = False) -> bool:
    """Whether an 8-bit GEMM of the fused layer takes ``gemv_dot_int8`` (rows read as words
    of four bytes: K a multiple of 4): int8 rows with ``INFERGRAFT_GEMV_INT8``, e4m3 ones
    (``fp8``) with ``INFERGRAFT_GEMV_FP8``."""
    return m == 1 and k % 4 == 0 and GEMV_ON and (GEMV_FP8 if fp8 else GEMV_INT8)


def int8_gemv_config(kind: str) -> dict:
    """The kind's one-row tiles for int8 rows: the bytes its 16-bit tiles keep in flight,
    in one tile (DEPTH 1) of twice the columns a step."""
    cfg = gemv_config(kind)
    return dict(cfg, BLOCK_K=2 * cfg["BLOCK_K"] * cfg["DEPTH"], DEPTH=1)


if HAVE_TRITON:

    @triton.jit
    def gemv_dot(x_ptr, w_ptr, rn, N, K, stride_wn, UP_ROWS, PAIRED: tl.constexpr,
                 BLOCK_K: tl.constexpr, DEPTH: tl.constexpr, EARLY: tl.constexpr,
                 PDL: tl.constexpr):
        """x [1, K] times W's rows rn (and, PAIRED, rows rn + UP_ROWS) -> two [1, BN]
        float32. Waits for the previous kernel (PDL) only after requesting its first
        DEPTH tiles; keeps DEPTH tiles in flight by hand (num_stages=1: no smem)."""
        rk = tl.arange(0, BLOCK_K)
        nmask = (rn < N)[:, None]
        w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]     # [BN, BK]
        u_ptrs = w_ptrs + UP_ROWS * stride_wn
        wa = tl.load(w_ptrs, mask=nmask & (rk < K)[None, :], other=0.0)
        ua = wa
        if PAIRED:
            ua = tl.load(u_ptrs, mask=nmask & (rk < K)[None, :], other=0.0)
        if DEPTH == 2:
            kb = (BLOCK_K + rk) < K
            wb = tl.load(w_ptrs + BLOCK_K, mask=nmask & kb[None, :], other=0.0)
            ub = wb
            if PAIRED:
                ub = tl.load(u_ptrs + BLOCK_K, mask=nmask & kb[None, :], other=0.0)
        pdl_wait(PDL)
        if EARLY:
            pdl_release(PDL)
        xa = tl.load(x_ptr + rk, mask=rk < K, other=0.0)
        if DEPTH == 2:
            xb = tl.load(x_ptr + BLOCK_K + rk, mask=kb, other=0.0)
        acc = tl.full(wa.shape, 0.0, tl.float32)                                 # [BN, BK]
        acc_up = tl.full(wa.shape, 0.0, tl.float32)
        for k0 in range(DEPTH * BLOCK_K, K, BLOCK_K):
            kmask = (k0 + rk) < K
            wc = tl.load(w_ptrs + k0, mask=nmask & kmask[None, :], other=0.0)
            uc = wc
            if PAIRED:
                uc = tl.load(u_ptrs + k0, mask=nmask & kmask[None, :], other=0.0)
            xc = tl.load(x_ptr + k0 + rk, mask=kmask, other=0.0)
            xf = xa.to(tl.float32)[None, :]
            acc += wa.to(tl.float32) * xf
            if PAIRED:
                acc_up += ua.to(tl.float32) * xf
            if DEPTH == 2:  # rotate the tiles in flight
                wa = wb
                ua = ub
                xa = xb
                wb = wc
                ub = uc
                xb = xc
            else:
                wa = wc
                ua = uc
                xa = xc
        xf = xa.to(tl.float32)[None, :]
        acc += wa.to(tl.float32) * xf
        if PAIRED:
            acc_up += ua.to(tl.float32) * xf
        if DEPTH == 2:
            xf = xb.to(tl.float32)[None, :]
            acc += wb.to(tl.float32) * xf
            if PAIRED:
                acc_up += ub.to(tl.float32) * xf
        if not EARLY:
            pdl_release(PDL)
        return tl.sum(acc, axis=1)[None, :], tl.sum(acc_up, axis=1)[None, :]    # [1, BN]

    @triton.jit
    def _byte_value(w, i: tl.constexpr, FP8: tl.constexpr):
        # byte i of each int32 word as a float32, without a convert instruction. int8:
        # (b ^ 0x80) = q + 128 in the mantissa of 2^23: the float 2^23 + 128 + q, less
        # 2^23 + 128. e4m3: its sign to bit 31, exponent and mantissa to bits 30-20 (a
        # float32 of exponent e - 127, a subnormal at e = 0), times 2^(127 - 7): exact
        b = (w >> (8 * i)) & 0xFF
        if FP8:
            f = (((b & 0x7F) << 20) | ((b & 0x80) << 24)).to(tl.float32, bitcast=True)
            return f * 1.329227995784916e36                                      # 2^120
        return (b ^ 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0

    @triton.jit
    def _int8_words_dot(acc, acc_up, w, u, PAIRED: tl.constexpr, x_ptr, k_el, K,
                        FP8: tl.constexpr):
        """acc (+ acc_up) += the four 8-bit columns of each int32 word of w (u) times x's:
        byte i of a word is column k_el + i (``_byte_value``: int8, or e4m3 with FP8)."""
        for i in tl.static_range(4):
            xi = tl.load(x_ptr + k_el + i, mask=(k_el + i) < K, other=0.0).to(tl.float32)
            acc += _byte_value(w, i, FP8) * xi[None, :]                          # [BN, BC]
            if PAIRED:
                acc_up += _byte_value(u, i, FP8) * xi[None, :]
        return acc, acc_up

    @triton.jit
    def gemv_dot_int8(x_ptr, w_ptr, rn, N, K, stride_wn, UP_ROWS, PAIRED: tl.constexpr,
                      BLOCK_K: tl.constexpr, EARLY: tl.constexpr, PDL: tl.constexpr,
                      FP8: tl.constexpr = False):
        """``gemv_dot`` for 8-bit rows (int8; e4m3 with FP8) read as int32 words (w_ptr:
        the [N, K / 4] int32 view, stride_wn in words; BLOCK_K columns = BLOCK_K / 4 words
        a tile), one tile ahead in flight; the row scales are the caller's epilogue."""
        BLOCK_C: tl.constexpr = BLOCK_K // 4
        rc = tl.arange(0, BLOCK_C)
        words = K // 4
        nmask = (rn < N)[:, None]
        w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + rc[None, :]     # [BN, BC]
        u_ptrs = w_ptrs + UP_ROWS * stride_wn
        wa = tl.load(w_ptrs, mask=nmask & (rc < words)[None, :], other=0)
        ua = wa
        if PAIRED:
            ua = tl.load(u_ptrs, mask=nmask & (rc < words)[None, :], other=0)
        pdl_wait(PDL)
        if EARLY:
            pdl_release(PDL)
        acc = tl.full(wa.shape, 0.0, tl.float32)                                 # [BN, BC]
        acc_up = tl.full(wa.shape, 0.0, tl.float32)
        k_el = 4 * rc  # each word's first column
        for c0 in range(BLOCK_C, words, BLOCK_C):
            cmask = (c0 + rc) < words
            wc = tl.load(w_ptrs + c0, mask=nmask & cmask[None, :], other=0)
            uc = wc
            if PAIRED:
                uc = tl.load(u_ptrs + c0, mask=nmask & cmask[None, :], other=0)
            acc, acc_up = _int8_words_dot(acc, acc_up, wa, ua, PAIRED, x_ptr, k_el, K, FP8)
            wa = wc
            ua = uc
            k_el += BLOCK_K
        acc, acc_up = _int8_words_dot(acc, acc_up, wa, ua, PAIRED, x_ptr, k_el, K, FP8)
        if not EARLY:
            pdl_release(PDL)
        return tl.sum(acc, axis=1)[None, :], tl.sum(acc_up, axis=1)[None, :]    # [1, BN]
else:
    gemv_dot = gemv_dot_int8 = None
