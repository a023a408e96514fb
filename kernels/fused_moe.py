"""Fused mixture-of-experts MLP: each token through its top-k SwiGLU experts, the
outputs weighted by the routing weights and summed per token.

The (token, k) pairs are grouped by expert: sorted by expert id on the device, each
expert's pairs a segment of the sorted order (its offsets found by a binary search), cut
into tiles of BLOCK_M rows. Two grouped GEMMs run over the tiles, a program per (tile,
column block), each reading only its own expert's weights: gate_up with SiLU(gate) * up
in its epilogue (the activations stored in sorted order, so the next GEMM reads its rows
contiguously), then down with each pair's routing weight applied, stored at the pair's
own row; a third kernel sums each token's k rows. Nothing waits for the host: the grid is
sized by an upper bound on the tiles (an expert with tokens adds at most one part-filled
tile: ``min(E, T k) + T k // BLOCK_M``), which a program past the last tile leaves at
once, so the op runs inside CUDA graphs, and at decode with one token only its k experts'
weights are read (k tiles). With ``residual`` (the fused decode layer's stream) the sum
kernel also adds it and stores the new stream's partial sums of squares.

Weights: w_gate_up [E, 2I, H] (each expert's gate rows, then its up rows), w_down
[E, H, I], in x's dtype, or 8-bit rows (int8, float8_e4m3fn) with a float32 scale a row
([E, 2I], [E, H]: ``Quantizer.scaled_rows``), widened in registers.
"""
import torch
import torch.nn.functional as F

from ._rows import check_row_dtype
from ._triton import HAVE_TRITON, next_pow2, tl, triton
from .fp8_linear import fp8_native


def _project(x, w, scale):
    # x: [M, K], w: [N, K] (8-bit rows with scale [N]) -> [M, N] in x's dtype
    if scale is None:
        return F.linear(x, w)
    return (F.linear(x.float(), w.float()) * scale).to(x.dtype)


def _sum_pairs(y: torch.Tensor, k: int) -> torch.Tensor:
    # y: [T k, H] each pair's weighted output -> [T, H]: the k added in order, in float32
    y = y.view(-1, k, y.shape[-1])
    acc = y[:, 0].float()
    for j in range(1, k):
        acc = acc + y[:, j].float()
    return acc.to(y.dtype)


def _onto_stream(out, residual, sum_sq: bool):
    # out [T, H] -> out, or residual + out (the fused decode layer's stream) and, with
    # ``sum_sq``, its sums of squares per row [1, T] float32
    if residual is None:
        return out
    out = residual + out
    return out, (out.float().square().sum(-1)[None] if sum_sq else None)


def fused_moe_torch(x, w_gate_up, w_down, topk_weights, topk_ids, gate_up_scale=None,
                    down_scale=None, sync_free=None, residual=None, sum_sq=False):
    # x: [T, H]; w_gate_up [E, 2I, H], w_down [E, H, I]; topk_weights [T, k] float32,
    # topk_ids [T, k] in [0, E) -> [T, H]. A loop over the experts: on the CPU those with
    # tokens, each on its rows; elsewhere (``sync_free``) every expert on every row, its
    # pairs kept by a mask: no host sync, so the op may be captured in a CUDA graph.
    # ``residual`` [T, H]: returns (residual + the output, its sums of squares or None).
    k, h = topk_ids.shape[1], x.shape[1]
    flat, weights = topk_ids.reshape(-1), topk_weights.reshape(-1).float()
    y = torch.zeros((flat.numel(), h), dtype=x.dtype, device=x.device)  # [T k, H]: each pair's
    sync_free = x.device.type != "cpu" if sync_free is None else sync_free
    every = torch.arange(flat.numel(), device=x.device)
    for e in range(w_gate_up.shape[0]) if sync_free else flat.unique().tolist():
        pairs = every if sync_free else (flat == e).nonzero()[:, 0]
        gu = _project(x[pairs // k], w_gate_up[e], None if gate_up_scale is None
                      else gate_up_scale[e])  # [n, 2I]
        gate, up = gu.chunk(2, dim=-1)
        out = _project(F.silu(gate) * up, w_down[e], None if down_scale is None
                       else down_scale[e])  # [n, H]
        out = (out.float() * weights[pairs, None]).to(x.dtype)
        if sync_free:
            y = torch.where((flat == e)[:, None], out, y)
        else:
            y[pairs] = out
    return _onto_stream(_sum_pairs(y, k), residual, sum_sq)


if HAVE_TRITON:

    @triton.jit
    def _dot_rows(a, w, FP8: tl.constexpr, IEEE: tl.constexpr):
        """a [BM, BK] times the rows w [BN, BK] -> [BM, BN] float32; w widened to a's dtype
        first (exact from int8 or e4m3, whose bytes arrive as uint8 and are reinterpreted)."""
        if FP8:
            w = w.to(tl.float8e4nv, bitcast=True)
        w = w.to(a.dtype)
        if IEEE:  # float32: no tf32
            return tl.dot(a, tl.trans(w), input_precision="ieee")
        return tl.dot(a, tl.trans(w))

    @triton.jit
    def _tile_rows(tile_end_ptr, seg_ptr, E, E_POW2: tl.constexpr, BLOCK_M: tl.constexpr):
        """This program's tile: (its expert, its rows of the sorted pairs, their mask).
        tile_end [E]: the running sum of each expert's tiles; the expert is the first whose
        sum passes the tile's index (E: the tile is past the last, nothing to do)."""
        t = tl.program_id(0)
        idx = tl.arange(0, E_POW2)
        ends = tl.load(tile_end_ptr + idx, mask=idx < E, other=2147483647)
        expert = tl.sum((ends <= t).to(tl.int32))
        first = tl.max(tl.where(ends <= t, ends, 0))  # the expert's first tile
        e = tl.minimum(expert, E - 1)  # (a tile past the last reads nothing: rows masked)
        start = tl.load(seg_ptr + e)
        end = tl.where(expert < E, tl.load(seg_ptr + e + 1), start)
        rows = start + (t - first) * BLOCK_M + tl.arange(0, BLOCK_M)
        return expert, e, rows, rows < end

    @triton.jit
    def _gate_up_kernel(x_ptr, w_ptr, s_ptr, order_ptr, seg_ptr, tile_end_ptr, act_ptr,
                        E, I, H, TOP_K, stride_x, stride_we, stride_wn, stride_act,
                        HAS_SCALE: tl.constexpr, FP8: tl.constexpr, IEEE: tl.constexpr,
                        E_POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):
        expert, e, rows, rmask = _tile_rows(tile_end_ptr, seg_ptr, E, E_POW2, BLOCK_M)
        if expert < E:
            pairs = tl.load(order_ptr + rows, mask=rmask, other=0)             # [BM]
            tokens = (pairs // TOP_K).to(tl.int64)
            cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)           # [BN]
            cmask = cols < I
            w = w_ptr + e.to(tl.int64) * stride_we
            acc_g = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
            acc_u = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
            for k0 in range(0, H, BLOCK_K):
                kk = k0 + tl.arange(0, BLOCK_K)
                kmask = kk < H
                a = tl.load(x_ptr + tokens[:, None] * stride_x + kk[None, :],
                            mask=rmask[:, None] & kmask[None, :], other=0.0)    # [BM, BK]
                wmask = cmask[:, None] & kmask[None, :]
                wg = tl.load(w + cols[:, None] * stride_wn + kk[None, :], mask=wmask, other=0)
                wu = tl.load(w + (cols[:, None] + I) * stride_wn + kk[None, :], mask=wmask,
                             other=0)                                            # [BN, BK]
                acc_g += _dot_rows(a, wg, FP8, IEEE)
                acc_u += _dot_rows(a, wu, FP8, IEEE)
            if HAS_SCALE:  # 8-bit rows: their scales after the sum
                s = s_ptr + e.to(tl.int64) * 2 * I
                acc_g *= tl.load(s + cols, mask=cmask, other=0.0)[None, :]
                acc_u *= tl.load(s + I + cols, mask=cmask, other=0.0)[None, :]
            # rounded where the reference rounds: the projection, silu(gate), the product
            out_ty = act_ptr.dtype.element_ty
            g = acc_g.to(out_ty).to(tl.float32)
            act = (g * tl.sigmoid(g)).to(out_ty).to(tl.float32) * acc_u.to(out_ty).to(tl.float32)
            tl.store(act_ptr + rows[:, None].to(tl.int64) * stride_act + cols[None, :],
                     act.to(out_ty), mask=rmask[:, None] & cmask[None, :])

    @triton.jit
    def _down_kernel(act_ptr, w_ptr, s_ptr, order_ptr, seg_ptr, tile_end_ptr, weights_ptr,
                     y_ptr, E, H, I, stride_act, stride_we, stride_wn, stride_y,
                     HAS_SCALE: tl.constexpr, FP8: tl.constexpr, IEEE: tl.constexpr,
                     E_POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
        expert, e, rows, rmask = _tile_rows(tile_end_ptr, seg_ptr, E, E_POW2, BLOCK_M)
        if expert < E:
            cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)           # [BN] of H
            cmask = cols < H
            w = w_ptr + e.to(tl.int64) * stride_we
            acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
            for k0 in range(0, I, BLOCK_K):
                kk = k0 + tl.arange(0, BLOCK_K)
                kmask = kk < I
                a = tl.load(act_ptr + rows[:, None].to(tl.int64) * stride_act + kk[None, :],
                            mask=rmask[:, None] & kmask[None, :], other=0.0)    # [BM, BK]
                wd = tl.load(w + cols[:, None] * stride_wn + kk[None, :],
                             mask=cmask[:, None] & kmask[None, :], other=0)      # [BN, BK]
                acc += _dot_rows(a, wd, FP8, IEEE)
            if HAS_SCALE:
                acc *= tl.load(s_ptr + e.to(tl.int64) * H + cols, mask=cmask, other=0.0)[None, :]
            pairs = tl.load(order_ptr + rows, mask=rmask, other=0).to(tl.int64)  # [BM]
            weight = tl.load(weights_ptr + pairs, mask=rmask, other=0.0)         # [BM] f32
            out_ty = y_ptr.dtype.element_ty
            y = acc.to(out_ty).to(tl.float32) * weight[:, None]
            tl.store(y_ptr + pairs[:, None] * stride_y + cols[None, :], y.to(out_ty),
                     mask=rmask[:, None] & cmask[None, :])

    @triton.jit
    def _sum_pairs_kernel(y_ptr, out_ptr, r_ptr, ss_ptr, T, H, stride_y, stride_out,
                          TOP_K: tl.constexpr, RESIDUAL: tl.constexpr, SUM_SQ: tl.constexpr,
                          BLOCK: tl.constexpr):
        # grid (T, cdiv(H, BLOCK)): token t's TOP_K rows added in order, in float32; with
        # RESIDUAL added to the stream r (out: the new stream), SUM_SQ its block's sum of
        # squares at ss[block, t]
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < H
        acc = tl.full((BLOCK,), 0.0, tl.float32)
        for j in tl.static_range(TOP_K):
            acc += tl.load(y_ptr + (t * TOP_K + j) * stride_y + cols, mask=mask,
                           other=0.0).to(tl.float32)
        out = acc.to(out_ptr.dtype.element_ty)
        if RESIDUAL:  # the same stride as out (both [T, H] contiguous)
            r = tl.load(r_ptr + t * stride_out + cols, mask=mask, other=0.0).to(tl.float32)
            out = (r + out.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + t * stride_out + cols, out, mask=mask)
        if SUM_SQ:
            of = tl.where(mask, out.to(tl.float32), 0.0)
            tl.store(ss_ptr + tl.program_id(1) * T + t, tl.sum(of * of, axis=0))


def moe_blocks(pairs: int, experts: int, h: int, i: int, dtype) -> dict:
    """Tile sizes for ``pairs`` (token, expert) pairs over ``experts`` experts: rows a
    tile as many as an expert has on average (16 at decode), 64 columns, K steps of 64
    (32 in float32)."""
    per_expert = pairs / max(1, min(experts, pairs))
    block_m = 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64
    block_k = 32 if dtype == torch.float32 else 64
    return dict(BLOCK_M=block_m, BLOCK_N=max(16, min(64, next_pow2(max(h, i)))),
                BLOCK_K=max(16, min(block_k, next_pow2(min(h, i)))))


def tile_bound(pairs: int, experts: int, block_m: int) -> int:
    """The programs (tiles) a launch covers, from the shapes alone: at most
    ``pairs // block_m`` full tiles plus a part-filled one for each expert with pairs
    (one token at decode: its k experts, k tiles)."""
    return min(experts, pairs) + pairs // block_m


def _check(x, w_gate_up, w_down, topk_weights, topk_ids, gate_up_scale, down_scale):
    assert x.dim() == 2 and x.dtype in (torch.float32, torch.float16, torch.bfloat16) and \
        x.stride(-1) == 1, f"x must be [T, H] float with unit column stride, got " \
        f"{tuple(x.shape)} {x.dtype} stride {x.stride()}"
    t, h = x.shape
    assert w_gate_up.dim() == 3 and w_gate_up.is_contiguous() and w_gate_up.shape[2] == h \
        and w_gate_up.shape[1] % 2 == 0, f"w_gate_up must be contiguous [E, 2I, {h}], got " \
        f"{tuple(w_gate_up.shape)}"
    e, i = w_gate_up.shape[0], w_gate_up.shape[1] // 2
    assert w_down.shape == (e, h, i) and w_down.is_contiguous(), \
        f"w_down must be contiguous [{e}, {h}, {i}], got {tuple(w_down.shape)}"
    assert topk_ids.dim() == 2 and topk_ids.shape[0] == t and \
        topk_weights.shape == topk_ids.shape and topk_weights.dtype == torch.float32, \
        f"topk_ids [T, k] and float32 topk_weights [T, k] for T={t}, got " \
        f"{tuple(topk_ids.shape)}, {tuple(topk_weights.shape)} {topk_weights.dtype}"
    for w, s, rows in ((w_gate_up, gate_up_scale, 2 * i), (w_down, down_scale, h)):
        if s is None:
            assert w.dtype == x.dtype, f"weights {w.dtype} != x {x.dtype} (8-bit rows need a scale)"
        else:
            check_row_dtype(w)
            assert s.shape == (e, rows) and s.dtype == torch.float32 and s.is_contiguous(), \
                f"scale must be contiguous float32 [{e}, {rows}], got {tuple(s.shape)} {s.dtype}"
    return t, h, e, i


def _operands(w, scale, x):
    """(the weight as the kernel reads it: e4m3 as its bytes, its scale or a stand-in
    pointer, whether it is e4m3)."""
    fp8 = w.dtype == torch.float8_e4m3fn
    return (w.view(torch.uint8) if fp8 else w), (x if scale is None else scale), fp8


def fused_moe_triton(x, w_gate_up, w_down, topk_weights, topk_ids, gate_up_scale=None,
                     down_scale=None, blocks=None, residual=None, sum_sq=False):
    # as fused_moe_torch; topk_ids must lie in [0, E) (a pair of another id is never
    # written); with ``residual`` its sums of squares as partials [P, T] (a block each)
    t, h, e, i = _check(x, w_gate_up, w_down, topk_weights, topk_ids, gate_up_scale, down_scale)
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype and \
            residual.is_contiguous(), f"residual must be contiguous {x.dtype} " \
            f"{tuple(x.shape)}, got {tuple(residual.shape)} {residual.dtype}"
    if torch.float8_e4m3fn in (w_gate_up.dtype, w_down.dtype) and not fp8_native(x.device):
        # Triton loads e4m3 on sm_89+ only: the reference's loop without a host sync
        onto = {} if residual is None else dict(residual=residual, sum_sq=sum_sq)
        return fused_moe_torch(x, w_gate_up, w_down, topk_weights, topk_ids, gate_up_scale,
                               down_scale, sync_free=True, **onto)
    k = topk_ids.shape[1]
    n = t * k
    out = torch.empty((t, h), dtype=x.dtype, device=x.device)
    if n == 0:
        return out if residual is None else (out, None)
    cfg = dict(blocks or moe_blocks(n, e, h, i, x.dtype))
    bm = cfg["BLOCK_M"]
    # 1) the pairs grouped by expert: sorted_ids[seg[j]:seg[j+1]] are expert j's, and
    #    order[r] is the pair (t * k + slot) at sorted row r
    sorted_ids, order = torch.sort(topk_ids.reshape(-1).to(torch.int32), stable=True)
    seg = torch.searchsorted(sorted_ids, torch.arange(e + 1, dtype=torch.int32,
                                                      device=x.device), out_int32=True)
    tile_end = torch.cumsum((seg[1:] - seg[:-1] + bm - 1) // bm, 0, dtype=torch.int32)
    tiles = tile_bound(n, e, bm)
    # 2) gate_up with SiLU * up, then down with the routing weights, then the sum per token
    act = torch.empty((n, i), dtype=x.dtype, device=x.device)  # sorted order
    y = torch.empty((n, h), dtype=x.dtype, device=x.device)  # pair order
    flags = dict(IEEE=x.dtype == torch.float32, E_POW2=next_pow2(e), **cfg, num_warps=4)
    (wgu, sgu, fp8gu), (wd, sd, fp8d) = (_operands(w, s, x) for w, s in
                                         ((w_gate_up, gate_up_scale), (w_down, down_scale)))
    _gate_up_kernel[(tiles, triton.cdiv(i, cfg["BLOCK_N"]))](
        x, wgu, sgu, order, seg, tile_end, act, e, i, h, k, x.stride(0), wgu.stride(0),
        wgu.stride(1), act.stride(0), HAS_SCALE=gate_up_scale is not None, FP8=fp8gu, **flags)
    _down_kernel[(tiles, triton.cdiv(h, cfg["BLOCK_N"]))](
        act, wd, sd, order, seg, tile_end, topk_weights.reshape(-1).contiguous(), y, e, h, i,
        act.stride(0), wd.stride(0), wd.stride(1), y.stride(0),
        HAS_SCALE=down_scale is not None, FP8=fp8d, **flags)
    block = min(next_pow2(h), 1024)
    grid = (t, triton.cdiv(h, block))
    parts = torch.empty((grid[1], t), dtype=torch.float32, device=x.device) \
        if residual is not None and sum_sq else None
    _sum_pairs_kernel[grid](y, out, out if residual is None else residual,
                            out if parts is None else parts, t, h, y.stride(0), out.stride(0),
                            TOP_K=k, RESIDUAL=residual is not None, SUM_SQ=parts is not None,
                            BLOCK=block, num_warps=4)
    return out if residual is None else (out, parts)
