"""The int4 GEMMs of the fused decode layer (kernels/fused_linear.py's, for ``Int4Weight``
at 1..``MAX_ROWS`` rows): ``int4_gemv.py``'s CUDA-core loop with the fused layer's
prologue and epilogues, its split-K summed inside the kernel.

- Prologue: the input RMSNorm, whose weight g is not folded into the int4 weight
  (quantising W g would widen each group by the norm's outliers). x is multiplied by g as
  it loads (per input column, so it commutes with the per-group dequantisation); the
  row's 1 / rms, from the stream's sums of squares (partials [P, M] from the previous
  GEMM's epilogue), scales the row's dot in the epilogue. A GPTQ act order's ``perm``
  is the same load's gather (x[..., perm] and g[perm]).
- Epilogues (fused_linear's): the bias; SwiGLU, a program's rows BLOCK_N / 2 gate rows
  and the up rows below them; RoPE and the K/V write (``rotary.rope_pair_store``), a
  program's rows BLOCK_N / 2 dims of a head and their rotate-half partners; the residual
  add and the next norm's sums of squares [programs, M].
- Split-K: each split stores float32 partials [S, M, N] (N the weight's rows); the last
  split of a column tile to finish (``last_to_arrive``) sums them in split order and runs
  the epilogue, then zeroes its counter: no reduce launch. Where the pool has no counters
  to give (it would grow inside a CUDA graph capture) the launch takes one split.
"""
import torch

from ._triton import HAVE_TRITON, last_to_arrive, next_pow2, pdl_launch, pdl_release, \
    pdl_wait, tl, triton
from .int4_gemv import MAX_ROWS, gemv_config  # noqa: F401  (MAX_ROWS: the rows it takes)
if HAVE_TRITON:
    from .int4_gemv import int4_tile, int4_tile_dot
from .rotary import rope_pair_store

if HAVE_TRITON:

    @triton.jit
    def _rows_of(pid, N, UP_ROWS, BLOCK_N: tl.constexpr, SWIGLU: tl.constexpr,
                 ROPE: tl.constexpr):
        """The weight rows [BLOCK_N] of program ``pid`` and their mask. Paired (SwiGLU,
        RoPE): the first BLOCK_N / 2 and, UP_ROWS below, their partners."""
        i = tl.arange(0, BLOCK_N)
        hb: tl.constexpr = BLOCK_N // 2
        if ROPE:  # head pid // (tiles a half-head), dims j0.. of it (UP_ROWS = D / 2)
            head = pid // (UP_ROWS // hb)
            col = head * 2 * UP_ROWS + pid % (UP_ROWS // hb) * hb + i % hb
            rn = col + (i // hb) * UP_ROWS
            nmask = rn < N
        elif SWIGLU:  # gate columns pid * hb.., up rows UP_ROWS (= I) below
            col = pid * hb + i % hb
            rn = col + (i // hb) * UP_ROWS
            nmask = col < UP_ROWS
        else:
            rn = pid * BLOCK_N + i
            nmask = rn < N
        return rn, nmask

    @triton.jit(do_not_specialize=["N", "G", "TILES", "TILES_PER_SPLIT", "UP_ROWS",
                                   "SS_PARTS", "stride_ys"])
    def _int4_fused_kernel(x_ptr, q_ptr, s_ptr, z_ptr, b_ptr, g_ptr, perm_ptr, ss_ptr, r_ptr,
                           ss_out_ptr, y_ptr, p_ptr, cnt_ptr, N, K, KP, G, TILES,
                           TILES_PER_SPLIT, UP_ROWS, SS_PARTS, stride_xm, stride_qn, stride_ym,
                           stride_rm, stride_ys, eps,
                           pos_ptr, cos_ptr, sin_ptr, idx0_ptr, idx1_ptr, kc_ptr, vc_ptr,
                           stride_cs, stride_c0, stride_c1, stride_ch, HQ, HKV,
                           ROWS: tl.constexpr, BLOCK_M: tl.constexpr, GROUP: tl.constexpr,
                           SUB: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           HAS_BIAS: tl.constexpr, GAMMA: tl.constexpr, PERM: tl.constexpr,
                           NORM: tl.constexpr, BLOCK_P: tl.constexpr, SWIGLU: tl.constexpr,
                           ROPE: tl.constexpr, RESIDUAL: tl.constexpr, SUM_SQ: tl.constexpr,
                           SPLIT: tl.constexpr, EARLY: tl.constexpr, PDL: tl.constexpr):
        # program (n, s): weight rows rn over K tiles [s * TILES_PER_SPLIT, ...) for all
        # ROWS rows of x (int4_gemv's loop: SUB = min(BLOCK_K, GROUP) columns a scale)
        pid = tl.program_id(0)
        rn, nmask = _rows_of(pid, N, UP_ROWS, BLOCK_N, SWIGLU, ROPE)
        t_lo = tl.program_id(1) * TILES_PER_SPLIT
        t_hi = tl.minimum(t_lo + TILES_PER_SPLIT, TILES)
        jg = tl.arange(0, BLOCK_K // SUB)                                       # [GT]
        cb = jg[:, None] * (SUB // 2) + tl.arange(0, SUB // 2)[None, :]        # [GT, SUB/2]
        q_rows = q_ptr + rn.to(tl.int64)[:, None, None] * stride_qn            # [BN, 1, 1]
        sz_rows = rn.to(tl.int64)[:, None] * G                                  # [BN, 1]
        rm = tl.arange(0, BLOCK_M)
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
        pdl_wait(PDL)
        if EARLY:  # no shared memory held: the next kernel's CTAs may sit beside ours
            pdl_release(PDL)
        for t in range(t_lo, t_hi):
            c = t * (BLOCK_K // 2) + cb  # byte columns                        # [GT, SUB/2]
            lo, hi, s, z = int4_tile(q_rows, s_ptr, z_ptr, sz_rows, nmask, c, t, jg, KP, G,
                                     BLOCK_K, SUB, GROUP)
            # the packed columns (2c, 2c + 1) and where x holds them (act order: perm)
            rk = 2 * c[:, :, None] + tl.arange(0, 2)[None, None, :]              # [GT, SUB/2, 2]
            kmask = rk < K
            if PERM:
                src = tl.load(perm_ptr + rk, mask=kmask, other=0)
            else:
                src = rk
            if GAMMA:  # the norm's weight, shared by every row
                gam = tl.load(g_ptr + src, mask=kmask, other=0.0).to(tl.float32)
            for r in tl.static_range(ROWS):
                xr = tl.load(x_ptr + r * stride_xm + src, mask=kmask, other=0.0).to(tl.float32)
                if GAMMA:
                    xr = xr * gam
                xe, xo = tl.split(xr)                                           # [GT, SUB/2]
                part = int4_tile_dot(lo, hi, s, z, xe, xo)                      # [BN]
                acc = tl.where(rm[:, None] == r, acc + part[None, :], acc)      # [BM, BN]
        if not EARLY:
            pdl_release(PDL)
        rmask = rm < ROWS
        off = rm[:, None] * N + rn[None, :]  # into a partials plane [M, N]    # [BM, BN]
        omask = rmask[:, None] & nmask[None, :]
        go = pid >= 0  # (a scalar tensor: whether this program runs the epilogue)
        if SPLIT > 1:
            tl.store(p_ptr + tl.program_id(1) * stride_ys + off, acc, mask=omask)
            go = last_to_arrive(cnt_ptr + pid, SPLIT)
        if go:
            if SPLIT > 1:  # the last split: every partial is visible, summed in order
                acc = tl.load(p_ptr + off, mask=omask, other=0.0)
                for sp in tl.static_range(1, SPLIT):
                    acc += tl.load(p_ptr + sp * stride_ys + off, mask=omask, other=0.0)
                tl.atomic_xchg(cnt_ptr + pid, 0)  # zero for the next call or graph replay
            if NORM:  # the row's 1 / rms from the stream's partial sums of squares
                rp = tl.arange(0, BLOCK_P)
                ss = tl.load(ss_ptr + rp[:, None] * ROWS + rm[None, :],
                             mask=(rp < SS_PARTS)[:, None] & rmask[None, :], other=0.0)
                acc = acc * (1.0 / tl.sqrt(tl.sum(ss, axis=0) / K + eps))[:, None]
            if HAS_BIAS:
                acc += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
            _epilogue(acc, pid, rm, rmask, rn, nmask, N, UP_ROWS, y_ptr, stride_ym, r_ptr,
                      stride_rm, ss_out_ptr, pos_ptr, cos_ptr, sin_ptr, idx0_ptr, idx1_ptr,
                      kc_ptr, vc_ptr, stride_cs, stride_c0, stride_c1, stride_ch, HQ, HKV,
                      ROWS, BLOCK_M, BLOCK_N, SWIGLU, ROPE, RESIDUAL, SUM_SQ)

    @triton.jit
    def _epilogue(acc, pid, rm, rmask, rn, nmask, N, UP_ROWS, y_ptr, stride_ym, r_ptr,
                  stride_rm, ss_out_ptr, pos_ptr, cos_ptr, sin_ptr, idx0_ptr, idx1_ptr, kc_ptr,
                  vc_ptr, stride_cs, stride_c0, stride_c1, stride_ch, HQ, HKV,
                  ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  SWIGLU: tl.constexpr, ROPE: tl.constexpr, RESIDUAL: tl.constexpr,
                  SUM_SQ: tl.constexpr):
        """acc [BM, BN] float32, the finished products of rows rn (bias in) -> stored as
        linear.py's skinny kernel stores them, rounded at the same points."""
        out_ty = y_ptr.dtype.element_ty
        hb: tl.constexpr = BLOCK_N // 2
        if ROPE or SWIGLU:  # the first half's columns and their partners: [BM, BN/2] each
            a, p = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, hb)), (0, 2, 1)))
            a = a.to(out_ty).to(tl.float32)  # the projection rounded, as stored unfused
            p = p.to(out_ty).to(tl.float32)
        if ROPE:
            head = pid // (UP_ROWS // hb)
            rope_pair_store(a, p, rm, rmask, head, pid % (UP_ROWS // hb) * hb, UP_ROWS, y_ptr,
                            stride_ym, pos_ptr, cos_ptr, sin_ptr, stride_cs, idx0_ptr, idx1_ptr,
                            kc_ptr, vc_ptr, stride_c0, stride_c1, stride_ch, HQ, HKV, hb)
        elif SWIGLU:  # silu(gate) rounded, times up: silu_mul on the stored gate_up
            act = (a * tl.sigmoid(a)).to(out_ty).to(tl.float32)
            cols = pid * hb + tl.arange(0, hb)
            tl.store(y_ptr + rm[:, None] * stride_ym + cols[None, :], (act * p).to(out_ty),
                     mask=rmask[:, None] & (cols < UP_ROWS)[None, :])
        else:
            ymask = rmask[:, None] & nmask[None, :]
            if RESIDUAL:  # the projection rounded, then + r like `x + residual` in torch
                r = tl.load(r_ptr + rm[:, None] * stride_rm + rn[None, :], mask=ymask, other=0.0)
                acc = acc.to(out_ty).to(tl.float32) + r.to(tl.float32)
            y = acc.to(out_ty)
            tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], y, mask=ymask)
            if SUM_SQ:  # the next RMSNorm's statistic, of the stored (rounded) values
                yf = tl.where(ymask, y.to(tl.float32), 0.0)
                tl.store(ss_out_ptr + pid * ROWS + rm, tl.sum(yf * yf, axis=1), mask=rmask)


def fused_config(m: int, n: int, k: int, group_size: int, half: int = 0) -> dict:
    """Tiles of an M x N x K fused int4 GEMM: ``int4_gemv.gemv_config``'s (the H200 sweep of
    the unfused GEMV); a RoPE program's BLOCK_N / 2 dims divide ``half`` a head."""
    cfg = dict(gemv_config(m, n, k, group_size))
    cfg.pop("PATH", None)
    while half and cfg["BLOCK_N"] > 2 and half % (cfg["BLOCK_N"] // 2):
        cfg["BLOCK_N"] //= 2
    return cfg


def launch_int4_fused(x, w, bias, y, *, gemm: str, norm=None, sum_sq=None, eps=0.0,
                      residual=None, sum_sq_out=False, rope=None, counters=None, config=None):
    """x [M, K] (1..MAX_ROWS rows, unit column stride), ``w`` an ``Int4Weight`` -> y, the
    programs' sums of squares [programs, M] where ``sum_sq_out`` (else None). ``gemm``:
    "linear" (y [M, N]), "swiglu" (y [M, N / 2]) or "qkv_rope" (y = rotated q [M, Hq * D];
    ``rope`` = (positions, cos, sin, idx0, idx1, k_cache, v_cache, Hq, Hkv)). ``norm``:
    the norm weight [K] applied in the prologue; ``sum_sq`` [P, M] float32: the rows'
    1 / rms (RMSNorm); ``residual`` [M, N]. Callers check shapes."""
    from .paged_plan import counters_for

    m, k = x.shape
    n, kp = w.qweight.shape
    half = rope[1].shape[1] if rope is not None else 0
    cfg = dict(config or fused_config(m, n, k, w.group_size, half))
    bk, bn, split = cfg.pop("BLOCK_K"), cfg["BLOCK_N"], cfg.pop("SPLIT", 1)
    tiles = -(-k // bk)
    per = -(-tiles // split)
    split = -(-tiles // per)  # no empty split
    paired = gemm != "linear"
    programs = n // bn if gemm == "qkv_rope" else -(-(n // 2 if paired else n) //
                                                      (bn // 2 if paired else bn))
    cnt = counters_for(counters, x.device, programs) if split > 1 else None
    if cnt is None and split > 1:  # no counters to be had inside a graph capture
        split, per = 1, tiles
    parts = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 \
        else y
    ss_out = torch.empty((programs, m), dtype=torch.float32, device=x.device) if sum_sq_out \
        else None
    pos, cos, sin, idx0, idx1, kc, vc, hq, hkv = rope or (y,) * 7 + (0, 0)

    def opt(t):
        return y if t is None else t

    _int4_fused_kernel[(programs, split)](
        x, w.qweight, w.scales, w.zeros, opt(bias), opt(norm), opt(w.perm), opt(sum_sq),
        opt(residual), opt(ss_out), y, parts, opt(cnt), n, k, kp, w.scales.shape[1], tiles,
        per, half if rope is not None else n // 2, 1 if sum_sq is None else sum_sq.shape[0],
        x.stride(0), w.qweight.stride(0), y.stride(0),
        0 if residual is None else residual.stride(0), m * n, float(eps),
        pos, cos, sin, idx0, idx1, kc, vc, cos.stride(0) if rope else 0,
        *(kc.stride()[:3] if rope else (0, 0, 0)), hq, hkv,
        ROWS=m, BLOCK_M=next_pow2(m), GROUP=w.group_size, SUB=min(bk, w.group_size),
        BLOCK_K=bk, HAS_BIAS=bias is not None, GAMMA=norm is not None,
        PERM=w.perm is not None, NORM=sum_sq is not None,
        BLOCK_P=1 if sum_sq is None else next_pow2(sum_sq.shape[0]), SWIGLU=gemm == "swiglu",
        ROPE=gemm == "qkv_rope", RESIDUAL=residual is not None, SUM_SQ=sum_sq_out,
        SPLIT=split, **cfg, **pdl_launch(x.device))
    return y, ss_out
