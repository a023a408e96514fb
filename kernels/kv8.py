"""8-bit K/V (int8 or e4m3, a float32 scale per token and head) in attention's dots: how
decode attention (``paged_attention``) and the varlen step (``varlen_tile``) widen a key or
value tile, chosen at each launch by ``INFERGRAFT_KV8_WIDEN`` so one process can time each.

- ``cvt`` (0): Triton's converts to q's dtype (``.to``), the shipped path. On sm_90 an
  e4m3 -> bf16 convert goes through fp16 and float32: several instructions a byte, which
  bound the loop (MHA: each widened element serves one query row).
- ``f16`` (1): converts to fp16 (e4m3: one ``cvt.rn.f16x2.e4m3x2`` a pair), the dots in
  fp16: q is taken to fp16 once per program, each row times a power of two that puts its
  largest |q| in [2^14, 2^15) (exact: ``f16_rows``), its inverse joining the softmax scale.
- ``words`` (2): the cache read as int32 words of four values, widened by ``fp8_mma``'s
  bit tricks (``_bytes4``: integer ops and one packed multiply-add or subtract a pair, no
  convert) into q's dtype. Byte j of word c is column 4c + j, so q K^T is four dots of q's
  columns 4c + j (q split once per program), and p V four dots into four accumulators of
  those columns, interleaved once after the loop.
- ``words16`` (3): ``words`` into fp16 (int8: one ``prmt`` and a packed subtract a pair,
  where bf16 needs float32), q in fp16 as ``f16``.

Scales stay where they were: k's multiplies the scores' columns, v's p's columns. The modes
other than ``cvt`` take p times v_scale * 2^14 / (the tile's largest v_scale), in [0, 2^14]
(fp16 keeps its digits where p * v_scale alone falls below fp16's normal range, as ``cvt``
with fp16 q loses them), and multiply the tile's p V by that largest scale / 2^14. Their launch plans count key tiles by bytes: the plan
tuned for 16-bit K/V with twice the keys a tile, the same bytes in flight
(``paged_plan.launch_plan``'s ``kv_bytes``). The word modes need head_dim a multiple of 4
and a padded head_dim of 64 or more (a dot's inner side >= 16); elsewhere they run ``f16``.
"""
from __future__ import annotations

import torch

from . import switches
from ._triton import HAVE_TRITON, next_pow2, tl, triton
from .kv_write import QUANT_KV_DTYPES

MODES = ("cvt", "f16", "words", "words16")
CVT, F16, WORDS, WORDS16 = range(4)


def widen_mode(q: torch.Tensor, k_cache: torch.Tensor) -> int:
    """The ``MODES`` index a launch over this q and cache takes: ``cvt`` for 16-bit or
    float32 K/V and for float32 q (an IEEE dot), else ``INFERGRAFT_KV8_WIDEN``'s (a word
    mode falls back to ``f16`` where the cache cannot be read as words)."""
    if k_cache.dtype not in QUANT_KV_DTYPES or q.dtype == torch.float32:
        return CVT
    mode = MODES.index(switches.value("INFERGRAFT_KV8_WIDEN"))
    d = k_cache.shape[-1]
    if mode >= WORDS and not (d % 4 == 0 and next_pow2(d) >= 64 and _word_aligned(k_cache)):
        return F16
    return mode


def _word_aligned(cache: torch.Tensor) -> bool:
    return cache.stride(-1) == 1 and cache.storage_offset() % 4 == 0 \
        and all(s % 4 == 0 for s in cache.stride()[:-1])


def as_words(cache: torch.Tensor, mode: int) -> torch.Tensor:
    """The cache as a kernel of ``mode`` reads it: int32 words [..., D / 4] for the word
    modes (strides in words), else itself."""
    return cache.view(torch.int32) if mode >= WORDS else cache


if HAVE_TRITON:
    from .fp8_mma import _bytes4

    @triton.jit
    def f16_rows(x):
        """x [M, D] (16-bit) -> (fp16 [M, D]: each row times 2^e, its largest |x| then in
        [2^14, 2^15); float32 [M]: 2^-e). Exact: a power of two moves only the exponent,
        and fp16 holds bf16's 8 significant bits (down to 2^-38 of the row's largest)."""
        xf = x.to(tl.float32)
        top = tl.max(tl.abs(xf), 1)
        # biased exponent E of the largest: |x| < 2^(E - 126); 2^(141 - E) puts it under
        # 2^15. E >= 15 keeps 2^(E - 141) a normal float32 (a zero row: any factor)
        e = tl.minimum(tl.maximum((top.to(tl.int32, bitcast=True) >> 23) & 0xFF, 15), 254)
        up = ((268 - e) << 23).to(tl.float32, bitcast=True)
        down = ((e - 14) << 23).to(tl.float32, bitcast=True)
        return (xf * up[:, None]).to(tl.float16), down

    @triton.jit
    def q_operand(q, scale, WIDEN: tl.constexpr):
        """q [M, D] as the score dot takes it, and the row factors [M] of the scores
        (scale, times the fp16 rows' 2^-e)."""
        if (WIDEN == 1) | (WIDEN == 3):
            qk, down = f16_rows(q)
            qs = down * scale
        else:
            qk = q
            qs = tl.full([q.shape[0]], 1.0, tl.float32) * scale
        return qk, qs

    @triton.jit
    def split4(x):
        """x [M, 4W] -> its columns 4c + j for j = 0..3, four [M, W]."""
        e, o = tl.split(tl.reshape(x, (x.shape[0], x.shape[1] // 4, 2, 2)))
        x0, x2 = tl.split(e)
        x1, x3 = tl.split(o)
        return x0, x1, x2, x3

    @triton.jit
    def join4(x0, x1, x2, x3):
        """``split4``'s inverse: four [M, W] -> [M, 4W], x_j's column c at 4c + j."""
        e = tl.join(x0, x2)                                                 # [M, W, 2]
        o = tl.join(x1, x3)
        return tl.reshape(tl.join(e, o), (x0.shape[0], x0.shape[1] * 4))

    @triton.jit
    def load_words(c_ptr, row, valid, D, BLOCK_D: tl.constexpr):
        """Rows ``row`` [N] (word offsets) of an int32 view of an 8-bit cache: [N, D / 4]."""
        w = tl.arange(0, BLOCK_D // 4)
        return tl.load(c_ptr + row[:, None] + w[None, :],
                       mask=valid[:, None] & (w < D // 4)[None, :], other=0)

    @triton.jit
    def scores_words(q0, q1, q2, q3, kw, FP8: tl.constexpr, ASM: tl.constexpr):
        """q K^T [M, N] (float32) from q's four column groups [M, W] and K's words [N, W]."""
        k0, k1, k2, k3 = _bytes4(kw, q0.dtype, FP8, ASM)                     # [N, W]
        s = tl.dot(q0, tl.trans(k0))
        s = tl.dot(q1, tl.trans(k1), s)
        s = tl.dot(q2, tl.trans(k2), s)
        return tl.dot(q3, tl.trans(k3), s)

    @triton.jit
    def key_scores(qk, q0, q1, q2, q3, kc_ptr, krow, valid, d, dmask, D,
                   BLOCK_D: tl.constexpr, WIDEN: tl.constexpr, FP8: tl.constexpr,
                   ASM: tl.constexpr, IEEE: tl.constexpr, K_T: tl.constexpr):
        """q K^T [M, N] (float32, before any scale) for the keys at rows ``krow`` [N]
        (element offsets, or word offsets in the word modes); q0..q3: ``split4(qk)`` for
        the word modes (else unused). K_T (8-bit, byte modes): K read as [D, N] and widened,
        not read as [N, D], widened and transposed."""
        if WIDEN >= 2:
            s = scores_words(q0, q1, q2, q3, load_words(kc_ptr, krow, valid, D, BLOCK_D),
                             FP8, ASM)
        else:
            if K_T:
                kf = tl.load(kc_ptr + krow[None, :] + d[:, None],
                             mask=dmask[:, None] & valid[None, :], other=0.0).to(qk.dtype)
            else:
                k = tl.load(kc_ptr + krow[:, None] + d[None, :],
                            mask=valid[:, None] & dmask[None, :], other=0.0)   # [N, D]
                kf = tl.trans(k.to(qk.dtype))                                 # [D, N]
            if IEEE:
                s = tl.dot(qk, kf, input_precision="ieee")
            else:
                s = tl.dot(qk, kf)
        return s

    @triton.jit
    def value_weights(p, vs_ptr, vsrow, valid, QUANT: tl.constexpr, WIDEN: tl.constexpr):
        """(p times the v scales of its keys, the factor of its p V): ``cvt`` p * v_scale
        and 1; the other modes p * v_scale * 2^14 / m and m / 2^14, m the tile's largest
        v_scale (p V stays far below float32's range: |p V| <= 2^14 * 448 * keys)."""
        if QUANT:
            vsc = tl.load(vs_ptr + vsrow, mask=valid, other=0.0)                # [N]
            if WIDEN == 0:
                pw, top = p * vsc[None, :], 1.0
            else:  # times 2^14: fp16 keeps 2^-38 of the largest at full precision
                top = tl.max(vsc, 0)
                top = tl.where(top > 0, top, 1.0)
                pw = p * (vsc * (16384.0 / top))[None, :]
                top = top * (1.0 / 16384.0)
        else:
            pw, top = p, 1.0
        return pw, top

    @triton.jit
    def value_dot(pw, vc_ptr, vrow, valid, d, dmask, DT: tl.constexpr, IEEE: tl.constexpr):
        """p V [M, D] over the values at rows ``vrow`` [N] (byte modes and 16-bit K/V):
        float32 K/V an IEEE product; else p rounded to DT, V widened to DT, tensor cores."""
        v = tl.load(vc_ptr + vrow[:, None] + d[None, :],
                    mask=valid[:, None] & dmask[None, :], other=0.0)             # [N, D]
        if IEEE:
            pv = tl.dot(pw, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(pw.to(DT), v.to(DT))
        return pv

    @triton.jit
    def value_words(pw, vc_ptr, vrow, valid, D, BLOCK_D: tl.constexpr, FP8: tl.constexpr,
                    ASM: tl.constexpr):
        """p V in four column groups [M, W] (columns 4c + j), V read as words: p rounded
        to q's dtype of the dot (fp16 or bf16, ``pw``'s)."""
        v0, v1, v2, v3 = _bytes4(load_words(vc_ptr, vrow, valid, D, BLOCK_D), pw.dtype,
                                 FP8, ASM)                                      # [N, W]
        return tl.dot(pw, v0), tl.dot(pw, v1), tl.dot(pw, v2), tl.dot(pw, v3)

    @triton.jit
    def accumulate_values(acc, a0, a1, a2, a3, alpha, p, vs_ptr, vsrow, vc_ptr, vrow, valid,
                          d, dmask, D, BLOCK_D: tl.constexpr, DT: tl.constexpr,
                          QUANT: tl.constexpr, WIDEN: tl.constexpr, FP8: tl.constexpr,
                          ASM: tl.constexpr, IEEE: tl.constexpr):
        """A key tile's p V added to the running sums, which ``alpha`` rescales first:
        ``acc`` [M, D] (16-bit and byte modes; p rounded to DT, the dot's dtype, on tensor
        cores; float32 IEEE), or the word modes' four column groups ``a0``..``a3``. Returns
        all five, the ones its mode does not use unchanged."""
        # p times the v scales (over the tile's largest, which scales its p V)
        pw, top = value_weights(p, vs_ptr, vsrow, valid, QUANT, WIDEN)
        if WIDEN >= 2:
            p0, p1, p2, p3 = value_words(pw.to(DT), vc_ptr, vrow, valid, D, BLOCK_D, FP8,
                                         ASM)                                   # 4 x [M, D/4]
            a0 = a0 * alpha[:, None] + p0 * top
            a1 = a1 * alpha[:, None] + p1 * top
            a2 = a2 * alpha[:, None] + p2 * top
            a3 = a3 * alpha[:, None] + p3 * top
        else:
            pv = value_dot(pw, vc_ptr, vrow, valid, d, dmask, DT, IEEE)         # [M, D]
            acc = acc * alpha[:, None] + pv * top
        return acc, a0, a1, a2, a3
else:
    f16_rows = q_operand = split4 = join4 = load_words = scores_words = key_scores = None
    value_weights = value_dot = value_words = accumulate_values = None
