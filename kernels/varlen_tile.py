"""The per-tile work of ``varlen_attention``'s kernel (Triton device functions): which
sequence a program's query tile belongs to, and one tile's online softmax over its keys.
Beside the kernel so that each file stays readable; only ``varlen_attention`` uses them."""
from __future__ import annotations

from ._triton import HAVE_TRITON, last_to_arrive, soft_cap, tl, triton
from .kv8 import accumulate_values, join4, key_scores, q_operand, split4
from .paged_attention import _merge_splits

if HAVE_TRITON:

    @triton.jit
    def _find_seq(cu_ptr, tile, nseq, BLOCK_Q: tl.constexpr):
        """The last b in [0, nseq] whose tiles start at or before ``tile`` (tile start of
        b: cu[b] // BLOCK_Q + b, strictly rising in b); nseq: the padding rows' tiles."""
        lo: tl.int32 = 0
        hi = nseq + 1
        while lo < hi:
            mid = (lo + hi) // 2
            if tl.load(cu_ptr + mid) // BLOCK_Q + mid <= tile:
                lo = mid + 1
            else:
                hi = mid
        return lo - 1

    @triton.jit
    def _attend_tile(
        q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, bt_ptr, out_ptr, acc_ptr, m_ptr, l_ptr, sem_ptr,
        stride_qt, stride_qh, stride_kb, stride_ks, stride_vb, stride_vs,
        stride_ksb, stride_kss, stride_vsb, stride_vss, stride_ot, stride_oh,
        scale, window, softcap, BS, D, hkv, tile, q0, qlen, j, length,
        GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr,
        QUANT: tl.constexpr, IEEE: tl.constexpr, SPLIT: tl.constexpr, FUSED: tl.constexpr,
        SOFTCAP: tl.constexpr, WIDEN: tl.constexpr, FP8: tl.constexpr, ASM: tl.constexpr):
        """Tokens j * BLOCK_Q ... of one sequence (rows from q0, qlen of them, length tokens
        after this step) x the GROUP query heads of kv head hkv, over this split's keys.
        kc/vc/ks/vs point at kv head hkv, bt at the sequence's table row. SOFTCAP: each
        score s becomes softcap * tanh(s / softcap) before the mask (Gemma 2). WIDEN: how
        8-bit K/V reach the dots (kv8.py; the word modes read kc/vc as int32 words)."""
        sp, nsplit = tl.program_id(2), tl.num_programs(2)
        hq = tl.num_programs(1) * GROUP
        r = tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        qi, g = r // GROUP, r % GROUP  # row r: token qi of the tile, query head g of the group
        head = hkv * GROUP + g                                              # [M]
        local = j * BLOCK_Q + qi                                            # [M]
        rmask = (qi < BLOCK_Q) & (local < qlen)
        tok = (q0 + local).to(tl.int64)
        qpos = length - qlen + local                                        # [M]
        wlo = tl.where(window > 0, qpos - window, -1)  # a row sees keys in (wlo, qpos]
        # 1) the keys any row of the tile sees: [lo_t, hi_t), never below the first
        # query's window (blocks there may be freed) nor past the context; split sp
        # takes whole key tiles [lo_t + sp * P, lo_t + (sp + 1) * P), P from the actual
        # span (a graph captured for a wide table still spreads short ones over S)
        first = length - qlen + j * BLOCK_Q
        hi_t = length - qlen + tl.minimum(j * BLOCK_Q + BLOCK_Q, qlen)
        lo_t = tl.where(window > 0, tl.maximum(first - window + 1, 0), 0)
        per = ((hi_t - lo_t + nsplit - 1) // nsplit + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        lo = lo_t + sp * per
        hi = tl.minimum(lo + per, hi_t)
        q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=rmask[:, None] & dmask[None, :], other=0.0)      # [M, D]
        qk, qs = q_operand(q, scale, WIDEN)  # the score dot's q, its rows' factors [M]
        c0, c1, c2, c3 = split4(qk)  # the word modes' column groups (else unused)
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.full([BLOCK_M], 0.0, tl.float32)  # tl.zeros fails in the 3.9 interpreter
        acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
        a0 = tl.full([BLOCK_M, BLOCK_D // 4], 0.0, tl.float32)  # the word modes' p V
        a1, a2, a3 = a0, a0, a0
        # 2) online softmax; a row may see none of a key tile (causal or window), so its
        # max stays -inf and is read as 0 in the exponents
        for n0 in range(lo, hi, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            valid = pos < hi                                                # [N]
            blk = tl.load(bt_ptr + pos // BS, mask=valid, other=0).to(tl.int64)
            off = (pos % BS).to(tl.int64)
            s = key_scores(qk, c0, c1, c2, c3, kc_ptr, blk * stride_kb + off * stride_ks,
                           valid, d, dmask, D, BLOCK_D, WIDEN, FP8, ASM, IEEE, False)  # [M, N]
            if QUANT:
                s = s * tl.load(ks_ptr + blk * stride_ksb + off * stride_kss, mask=valid,
                                other=0.0)[None, :]
            seen = valid[None, :] & (pos[None, :] <= qpos[:, None]) \
                & (pos[None, :] > wlo[:, None])                               # [M, N]
            s = s * qs[:, None]
            if SOFTCAP:
                s = soft_cap(s, softcap)
            s = tl.where(seen, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_use)
            p = tl.exp(s - m_use[:, None])                                # [M, N]
            l = l * alpha + tl.sum(p, 1)
            acc, a0, a1, a2, a3 = accumulate_values(
                acc, a0, a1, a2, a3, alpha, p, vs_ptr, blk * stride_vsb + off * stride_vss,
                vc_ptr, blk * stride_vb + off * stride_vs, valid, d, dmask, D, BLOCK_D,
                qk.dtype, QUANT, WIDEN, FP8, ASM, IEEE)
            m = m_new
        if WIDEN >= 2:
            acc = join4(a0, a1, a2, a3)
        md_mask = rmask[:, None] & dmask[None, :]
        if SPLIT:
            # 3) scratch rows (tok * Hq + head) * S + sp; a split a row sees nothing of
            # stores m=-inf, l=0, acc=0, and weighs 0 in the merge
            row = (tok * hq + head) * nsplit + sp                            # [M]
            tl.store(acc_ptr + row[:, None] * D + d[None, :], acc, mask=md_mask)
            tl.store(m_ptr + row, m, mask=rmask)
            tl.store(l_ptr + row, l, mask=rmask)
            if FUSED:
                cnt = sem_ptr + tile * tl.num_programs(1) + hkv  # this (tile, kv head)
                if last_to_arrive(cnt, nsplit):
                    # last to finish: the other S - 1 partials are visible (acquire)
                    h0 = hkv * GROUP
                    t0 = (q0 + j * BLOCK_Q).to(tl.int64)
                    for i in range(0, tl.minimum(BLOCK_Q, qlen - j * BLOCK_Q)):
                        tt = t0 + i  # the tile's tokens, one at a time
                        _merge_splits(acc_ptr, m_ptr, l_ptr, (tt * hq + h0) * nsplit, GROUP,
                                      out_ptr + tt * stride_ot + h0 * stride_oh, stride_oh,
                                      nsplit, D, BLOCK_H, BLOCK_S, BLOCK_D)
                    tl.store(cnt, 0)  # zero again for the next call or graph replay
        else:
            # every row sees at least its own key (l > 0); rows past the tile's are masked
            out = acc / tl.where(l > 0, l, 1.0)[:, None]
            tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=md_mask)
else:
    _find_seq = _attend_tile = None
