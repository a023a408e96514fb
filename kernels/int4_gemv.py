"""int4 weight-only GEMV for decode (one or a few rows of x), on CUDA cores.

At one row the GEMM reads every weight byte once and does little math with it, so the
kernel must stream the packed bytes at HBM speed in as few instructions a byte as it
can: it is near the SM's issue limit, not only the memory's. Each program owns BLOCK_N
rows of W (output columns) and one of SPLIT ranges of K, and reads each byte exactly
once, as contiguous [BLOCK_N, BLOCK_K / 2] uint8 tiles (16-byte loads). A byte holds
column 2c in its low nibble and 2c + 1 in its high one, so nothing is interleaved:

    sum_k w_k x_k = sum_c lo_c x_{2c} + hi_c x_{2c+1}

the low nibbles meet x's even columns and the high ones its odd columns (x's pairs of
columns loaded together and split in registers). A nibble becomes a float32 without an
int -> float conversion (those issue at a quarter of the FMA rate): a byte OR-ed into
the mantissa of 2^23 reads as 2^23 + b, the same masked to its high nibble as 2^23 +
16 hi, and two exact subtractions leave lo and 16 hi. The zero-point comes out of the
sums, sum (q - z) x = sum q x - z sum x, so it costs nothing a nibble. Each tile is
viewed as [BLOCK_N, groups in the tile, columns per group / 2]: the dot is summed per
group (or per fraction of one, when BLOCK_K < group_size), scaled by that group's
float32 scale and accumulated in float32 per row of x.

Split-K (SPLIT > 1, for narrow outputs whose column tiles leave SMs idle): split s
writes float32 partials [S, M, N] and ``_int4_reduce_kernel`` sums them in split order
(deterministic), adds the bias and rounds; no host sync, so a CUDA graph captures both.
"""
import torch

from ._triton import HAVE_TRITON, next_pow2, pdl_launch, pdl_release, pdl_wait, tl, triton

MAX_ROWS = 8  # rows of x one launch takes (each row is an unrolled pass over the tile)
SMS = 132  # streaming multiprocessors of the H200 the defaults are for


if HAVE_TRITON:

    @triton.jit
    def int4_tile(q_rows, s_ptr, z_ptr, sz_rows, nmask, c, t, jg, KP, G,
                  BLOCK_K: tl.constexpr, SUB: tl.constexpr, GROUP: tl.constexpr):
        """K tile ``t`` of rows ``q_rows`` ([BN, 1, 1] pointers), byte columns ``c``
        [GT, SUB/2] -> (lo, 16 hi) float32 [BN, GT, SUB/2] (the nibbles, exact), the
        groups' scales and zero-points [BN, GT] float32 (sz_rows [BN, 1]: row * G)."""
        b = tl.load(q_rows + c[None, :, :], mask=nmask[:, None, None] & (c < KP)[None, :, :],
                    other=0).to(tl.int32)                                       # [BN, GT, SUB/2]
        g = (t * BLOCK_K + jg * SUB) // GROUP                                   # [GT]
        gmask = nmask[:, None] & (g < G)[None, :]
        s = tl.load(s_ptr + sz_rows + g[None, :], mask=gmask, other=0.0)        # [BN, GT]
        z = tl.load(z_ptr + sz_rows + g[None, :], mask=gmask, other=0).to(tl.float32)
        # 0x4B000000 is 2^23's float32 bits: a byte OR-ed in reads as 2^23 + b, and
        # masked to its high nibble as 2^23 + 16 hi (the module docstring)
        v = b | 0x4B000000
        h = (v & 0x4B0000F0).to(tl.float32, bitcast=True)
        lo = v.to(tl.float32, bitcast=True) - h  # the low nibble q, exact
        hi = h - 8388608.0  # 16 q, exact
        return lo, hi, s, z

    @triton.jit
    def int4_tile_dot(lo, hi, s, z, xe, xo):
        """One row of x against a tile: its even / odd columns xe, xo [GT, SUB/2] -> the
        tile's contribution to each weight row [BN]: sum (q - z) x = sum q x - z sum x,
        per group, times its scale."""
        sx = tl.sum(xe + xo, axis=1)                                            # [GT]
        d = tl.sum(lo * xe[None, :, :], axis=2) + \
            tl.sum(hi * xo[None, :, :], axis=2) * 0.0625                       # [BN, GT]
        return tl.sum((d - z * sx[None, :]) * s, axis=1)                        # [BN]

    # shape-only arguments stay unspecialised, so the LLaMA shapes share one compile
    @triton.jit(do_not_specialize=["N", "G", "TILES", "TILES_PER_SPLIT", "stride_ys"])
    def _int4_gemv_kernel(x_ptr, q_ptr, s_ptr, z_ptr, b_ptr, y_ptr, N, K, KP, G, TILES,
                          TILES_PER_SPLIT, stride_xm, stride_qn, stride_ym, stride_ys,
                          ROWS: tl.constexpr, BLOCK_M: tl.constexpr, GROUP: tl.constexpr,
                          SUB: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, EARLY: tl.constexpr,
                          PDL: tl.constexpr):
        # program (n, s): rows rn of W over K tiles [s * TILES_PER_SPLIT, ...) for all
        # ROWS rows of x; SUB = min(BLOCK_K, GROUP) columns share one scale
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        t_lo = tl.program_id(1) * TILES_PER_SPLIT
        t_hi = tl.minimum(t_lo + TILES_PER_SPLIT, TILES)
        nmask = rn < N
        jg = tl.arange(0, BLOCK_K // SUB)                                       # [GT]
        cb = jg[:, None] * (SUB // 2) + tl.arange(0, SUB // 2)[None, :]        # [GT, SUB/2]
        q_rows = q_ptr + rn.to(tl.int64)[:, None, None] * stride_qn            # [BN, 1, 1]
        sz_rows = rn.to(tl.int64)[:, None] * G                                  # [BN, 1]
        rm = tl.arange(0, BLOCK_M)
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)  # tl.zeros fails in the 3.9 interpreter
        pdl_wait(PDL)
        if EARLY:  # no shared memory held: the next kernel's CTAs may sit beside ours
            pdl_release(PDL)
        for t in range(t_lo, t_hi):
            c = t * (BLOCK_K // 2) + cb  # byte columns                        # [GT, SUB/2]
            lo, hi, s, z = int4_tile(q_rows, s_ptr, z_ptr, sz_rows, nmask, c, t, jg, KP, G,
                                     BLOCK_K, SUB, GROUP)
            for r in tl.static_range(ROWS):
                # x's columns (2c, 2c + 1) as pairs, split into the even and odd halves;
                # a masked x (past K) zeroes the padded nibble
                rk = 2 * c[:, :, None] + tl.arange(0, 2)[None, None, :]          # [GT, SUB/2, 2]
                xe, xo = tl.split(tl.load(x_ptr + r * stride_xm + rk, mask=rk < K,
                                          other=0.0).to(tl.float32))            # [GT, SUB/2]
                part = int4_tile_dot(lo, hi, s, z, xe, xo)                      # [BN]
                acc = tl.where(rm[:, None] == r, acc + part[None, :], acc)      # [BM, BN]
        if not EARLY:
            pdl_release(PDL)
        mask = (rm[:, None] < ROWS) & nmask[None, :]
        if PARTIAL:
            p = y_ptr + tl.program_id(1) * stride_ys + rm[:, None] * stride_ym + rn[None, :]
            tl.store(p, acc, mask=mask)
        else:
            if HAS_BIAS:
                acc += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :],
                     acc.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _int4_reduce_kernel(p_ptr, b_ptr, y_ptr, MN, N, S: tl.constexpr,
                            HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        # y [M, N] = sum over s of partials [S, M, N] (in split order) + bias, rounded
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = i < MN
        pdl_wait(PDL)
        pdl_release(PDL)
        acc = tl.load(p_ptr + i, mask=mask, other=0.0)
        for s in tl.static_range(1, S):
            acc += tl.load(p_ptr + s * MN + i, mask=mask, other=0.0)
        if HAS_BIAS:
            acc += tl.load(b_ptr + i % N, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + i, acc.to(y_ptr.dtype.element_ty), mask=mask)


def split_for(programs: int, tiles: int, max_split: int = 4, min_tiles: int = 4,
              per_sm: int = 2) -> int:
    """Split-K for a launch of ``programs`` column tiles over ``tiles`` K tiles: the
    smallest power of 2 up to ``max_split`` that gives ``per_sm`` programs per SM, keeping
    at least ``min_tiles`` K tiles per split."""
    split = 1
    while split < max_split and programs * split < per_sm * SMS \
            and tiles >= 2 * split * min_tiles:
        split *= 2
    return split


def gemv_config(m: int, n: int, k: int, group_size: int) -> dict:
    """Meta-parameters of ``_int4_gemv_kernel`` for an M x N x K GEMM (M <= MAX_ROWS): the
    best of the H200 sweep (``python -m infergraft.core.tools.kernel_bench.int4 --sweep``, the
    LLaMA-2-7B decode GEMMs, docs/kernels.md) at one and two rows. Narrow outputs (o,
    down) take 32 rows of W a program on 2 warps and split K 8 / 4 ways; wide ones (qkv,
    gate_up) 128 x 256 tiles split 4 ways at one row, 128-column tiles at two."""
    if n < 8192:
        return dict(PATH="gemv", BLOCK_N=32, BLOCK_K=256, SPLIT=8 if m == 1 else 4,
                    num_warps=2, num_stages=1, EARLY=True)
    if m == 1:
        return dict(PATH="gemv", BLOCK_N=128, BLOCK_K=256, SPLIT=4, num_warps=4,
                    num_stages=1, EARLY=True)
    wide = n >= 16384  # gate_up
    return dict(PATH="gemv", BLOCK_N=128 if wide else 64, BLOCK_K=128, SPLIT=4,
                num_warps=4 if wide else 2, num_stages=1, EARLY=True)


def reduce_partials(parts: torch.Tensor, bias, y: torch.Tensor) -> torch.Tensor:
    """y [M, N] (contiguous) = the sum of float32 partials [S, M, N] in split order, plus
    the bias, rounded to y's dtype: one launch, no host sync."""
    s, m, n = parts.shape
    block = min(1024, next_pow2(m * n))
    _int4_reduce_kernel[(triton.cdiv(m * n, block),)](
        parts, parts if bias is None else bias, y, m * n, n, S=s, HAS_BIAS=bias is not None,
        BLOCK=block, num_warps=4, **pdl_launch(y.device))
    return y


def int4_gemv_triton(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                     zeros: torch.Tensor, group_size: int, in_features: int, bias=None,
                     config=None, partials: bool = False, y=None) -> torch.Tensor:
    """x2 [M, K] (unit column stride, 1 <= M <= MAX_ROWS), the packed weight as
    ``int4_linear_torch`` takes it (checked by ``int4_linear_triton``) -> y [M, N] in x's
    dtype (into ``y`` if given, contiguous). ``partials``: the float32 split-K partials
    [S, M, N] instead (no bias)."""
    m, k = x2.shape
    n, kp = qweight.shape
    g = scales.shape[1]
    assert 0 < m <= MAX_ROWS, f"the int4 GEMV takes 1..{MAX_ROWS} rows, got {m}"
    cfg = dict(config or gemv_config(m, n, k, group_size))
    cfg.pop("PATH", None)
    bk, split = cfg.pop("BLOCK_K"), cfg.pop("SPLIT", 1)
    assert bk >= 32 and bk & (bk - 1) == 0, f"BLOCK_K {bk} must be a power of 2 >= 32"
    tiles = -(-k // bk)
    per = -(-tiles // split)
    split = -(-tiles // per)  # no empty split
    if y is None:
        y = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    out = y if split == 1 and not partials else \
        torch.empty((split, m, n), dtype=torch.float32, device=x2.device)
    _int4_gemv_kernel[(triton.cdiv(n, cfg["BLOCK_N"]), split)](
        x2, qweight, scales, zeros, qweight if bias is None else bias, out, n, k, kp, g,
        tiles, per, x2.stride(0), qweight.stride(0), n, m * n, ROWS=m,
        BLOCK_M=next_pow2(m), GROUP=group_size, SUB=min(bk, group_size), BLOCK_K=bk,
        HAS_BIAS=bias is not None, PARTIAL=out is not y, **cfg, **pdl_launch(x2.device))
    if partials:
        return out
    return y if out is y else reduce_partials(out, bias, y)
