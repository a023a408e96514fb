"""The mixture-of-experts MLP of the fused decode layer at few rows: the input norm, the
router, softmax top-k routing, each (token, expert) pair's SwiGLU and the weighted sum
over a token's experts, added to the residual stream, in three kernels and no host sync.

At decode the grouped GEMMs of kernels/fused_moe.py cost more in launches than in bytes
(the routing's softmax, top-k and renormalisation, the sort and the segment offsets are
a dozen small kernels a layer), and their tiles leave most SMs idle at one token. Here:

1. ``_route_kernel``, a program per (block of experts, token): RMSNorm of the stream row
   (its statistic from the previous GEMM's partial sums of squares, the norm's weight
   applied: the norm does not fold into the router, since the experts read the same
   normed row) -> the router's logits in the model dtype, as HF's router Linear; the
   first block also stores the normed row for the experts.
2. ``_gate_up_kernel``, a program per (pair, block of I): the token's top-k recomputed from
   its logits (softmax in float32, the largest k in descending order, the lowest id first
   among equals, renormalised where asked: a few hundred FMAs), then the one-row loop of
   kernels/gemv.py over its expert's gate and up rows, SiLU(gate) * up stored per pair.
3. ``_down_kernel``, a program per (token, block of H): the same top-k, then one loop over
   (expert, K tile) that keeps two W tiles in flight across the experts' boundaries; each
   expert's output rounded and weighted as the reference does, summed in top-k order,
   added to the stream, with the new stream's partial sums of squares (the next norm's).

Only the active experts' rows are read (one token: k experts, nothing else). A pair
reads its expert's rows even where another token of the step picked it too, so the
policy takes this path where the step's pairs hardly share experts
(``takes_pair_path``); otherwise the grouped kernels.
"""
import torch
import torch.nn.functional as F

from . import switches
from ._triton import HAVE_TRITON, next_pow2, pdl_launch, pdl_release, pdl_wait, tl, triton
from .fused_moe import fused_moe_torch
from .gemv import gemv_dot

# steps of up to this many tokens may take the pair path (0: never)
DECODE_MAX_ROWS = switches.value("INFERGRAFT_MOE_DECODE_ROWS")
# the pair path reads an expert once a pair: taken where that is at most this much more
# than the step's distinct experts are expected to weigh (one token: exactly as much)
PAIR_BYTES_SLACK = 1.1


def route(logits: torch.Tensor, top_k: int, renormalize: bool):
    """Router logits [T, E] -> (weights [T, k] float32, expert ids [T, k]): softmax over
    all experts in float32, the top_k (as torch.topk orders them), renormalised to sum
    to 1 where ``renormalize``, as HF's MixtralTopKRouter / Qwen3MoeTopKRouter do."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def takes_pair_path(rows: int, experts: int, top_k: int) -> bool:
    """Whether a step of ``rows`` tokens takes ``moe_decode``'s pair path: at most
    ``DECODE_MAX_ROWS`` rows, and its pairs (rows x top_k, each reading an expert) within
    ``PAIR_BYTES_SLACK`` of the distinct experts that uniform routing picks on average."""
    if not 0 < rows <= DECODE_MAX_ROWS:
        return False
    distinct = experts * (1 - (1 - top_k / experts) ** rows)
    return rows == 1 or rows * top_k <= PAIR_BYTES_SLACK * distinct


def _normed(stream, sum_sq, norm_weight, eps):
    # stream [T, H], sum_sq [P, T] partial sums of its squares -> RMSNorm(stream) [T, H],
    # rounded as rms_norm_torch rounds (the normed row, then the weight's product)
    rstd = torch.rsqrt(sum_sq.sum(0)[:, None] / stream.shape[1] + eps)
    return norm_weight * (stream.float() * rstd).to(stream.dtype)


def moe_decode_torch(stream, sum_sq, norm_weight, eps, w_router, w_gate_up, w_down, top_k,
                     renormalize, want_sum_sq=True):
    """stream [T, H] (the residual stream), sum_sq [P, T] float32 (partial sums of its
    squares), norm_weight [H], w_router [E, H], w_gate_up [E, 2I, H], w_down [E, H, I] ->
    (stream + MoE(RMSNorm(stream)) [T, H], its sums of squares [1, T] or None)."""
    x = _normed(stream, sum_sq, norm_weight, eps)
    weights, ids = route(F.linear(x, w_router), top_k, renormalize)
    out = stream + fused_moe_torch(x, w_gate_up, w_down, weights, ids)
    return out, (out.float().square().sum(-1)[None] if want_sum_sq else None)


if HAVE_TRITON:

    @triton.jit
    def _top_k(logits_ptr, E, E_POW2: tl.constexpr, TOP_K: tl.constexpr,
               K_POW2: tl.constexpr, RENORM: tl.constexpr):
        """A token's routing from its logits row: (expert ids, weights) [K_POW2], slot j <
        TOP_K the j-th largest softmax probability (float32), renormalised where RENORM."""
        re = tl.arange(0, E_POW2)
        z = tl.load(logits_ptr + re, mask=re < E, other=float("-inf")).to(tl.float32)
        # a row of no token (a graph's capture reads attention over no keys: NaN) must
        # still pick experts that exist: NaN logits count as -inf, NaN probabilities as 0
        z = tl.where(z == z, z, float("-inf"))
        p = tl.exp(z - tl.max(z, axis=0))
        p = p / tl.sum(p, axis=0)  # padding: exp(-inf) = 0
        p = tl.where(p == p, p, 0.0)
        left = tl.where(re < E, p, -1.0)
        slots = tl.arange(0, K_POW2)
        ids = tl.zeros((K_POW2,), tl.int32)
        weights = tl.zeros((K_POW2,), tl.float32)
        for j in tl.static_range(TOP_K):
            best = tl.max(left, axis=0)
            idx = tl.minimum(tl.min(tl.where(left == best, re, E_POW2), axis=0), E - 1)
            ids = tl.where(slots == j, idx, ids)
            weights = tl.where(slots == j, best, weights)
            left = tl.where(re == idx, -2.0, left)
        if RENORM:
            weights = weights / tl.sum(weights, axis=0)
        return ids, weights

    @triton.jit
    def _slot(values, j, N: tl.constexpr):
        """values[j] of a register vector [N] (a masked sum: no dynamic indexing)."""
        slots = tl.arange(0, N)
        return tl.sum(tl.where(slots == j, values, 0), axis=0)

    @triton.jit
    def _route_kernel(x_ptr, ss_ptr, g_ptr, w_ptr, xn_ptr, logits_ptr, T, E, H, P, eps,
                      stride_x, stride_w, P_POW2: tl.constexpr, BLOCK_E: tl.constexpr,
                      BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        pe, t = tl.program_id(0), tl.program_id(1)
        re = pe * BLOCK_E + tl.arange(0, BLOCK_E)
        rk = tl.arange(0, BLOCK_K)
        emask = (re < E)[:, None]
        w_ptrs = w_ptr + re[:, None].to(tl.int64) * stride_w + rk[None, :]     # [BE, BK]
        # the router's first tile depends on no earlier kernel: requested before the wait
        w = tl.load(w_ptrs, mask=emask & (rk < H)[None, :], other=0.0)
        pdl_wait(PDL)
        pdl_release(PDL)
        ps = tl.arange(0, P_POW2)
        total = tl.sum(tl.load(ss_ptr + ps * T + t, mask=ps < P, other=0.0), axis=0)
        rstd = tl.rsqrt(total / H + eps)
        out_ty = xn_ptr.dtype.element_ty
        acc = tl.zeros((BLOCK_E, BLOCK_K), tl.float32)
        for k0 in range(0, H, BLOCK_K):
            kk = k0 + rk
            kmask = kk < H
            nxt = tl.load(w_ptrs + k0 + BLOCK_K, mask=emask & (kk + BLOCK_K < H)[None, :],
                          other=0.0)
            x = tl.load(x_ptr + t * stride_x + kk, mask=kmask, other=0.0).to(tl.float32)
            g = tl.load(g_ptr + kk, mask=kmask, other=0.0).to(tl.float32)
            xn = (g * (x * rstd).to(out_ty).to(tl.float32)).to(out_ty)         # [BK]
            tl.store(xn_ptr + t * H + kk, xn, mask=kk < tl.where(pe == 0, H, 0))  # the first block
            acc += w.to(tl.float32) * xn.to(tl.float32)[None, :]
            w = nxt
        logits = tl.sum(acc, axis=1).to(logits_ptr.dtype.element_ty)            # [BE]
        tl.store(logits_ptr + t * E + re, logits, mask=re < E)

    @triton.jit
    def _gate_up_kernel(xn_ptr, logits_ptr, w_ptr, act_ptr, E, H, I, stride_we, stride_wn,
                        E_POW2: tl.constexpr, TOP_K: tl.constexpr, K_POW2: tl.constexpr,
                        RENORM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        DEPTH: tl.constexpr, PDL: tl.constexpr):
        pair, pn = tl.program_id(0), tl.program_id(1)
        t = pair // TOP_K
        pdl_wait(PDL)  # the logits and normed rows of the route kernel
        ids, _ = _top_k(logits_ptr + t * E, E, E_POW2, TOP_K, K_POW2, RENORM)
        e = _slot(ids, pair - t * TOP_K, K_POW2)
        rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        gate, up = gemv_dot(xn_ptr + t * H, w_ptr + e.to(tl.int64) * stride_we, rn, I, H,
                            stride_wn, I, True, BLOCK_K, DEPTH, True, PDL)     # [1, BN]
        # rounded where the reference rounds: the projection, silu(gate), the product
        out_ty = act_ptr.dtype.element_ty
        g = gate.to(out_ty).to(tl.float32)
        act = (g * tl.sigmoid(g)).to(out_ty).to(tl.float32) * up.to(out_ty).to(tl.float32)
        cols = pn * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tl.store(act_ptr + pair.to(tl.int64) * I + cols, act.to(out_ty), mask=cols < I)

    @triton.jit
    def _down_tile(w_ptr, rn, ids, s, KT, I, stride_we, stride_wn, TOP_K: tl.constexpr,
                   K_POW2: tl.constexpr, BLOCK_K: tl.constexpr):
        """Step s's W tile [BN, BK]: expert slot s // KT, K tile s % KT (none past the last)."""
        j = s // KT
        kk = (s - j * KT) * BLOCK_K + tl.arange(0, BLOCK_K)
        e = _slot(ids, j, K_POW2).to(tl.int64)
        return tl.load(w_ptr + e * stride_we + rn[:, None].to(tl.int64) * stride_wn
                       + kk[None, :], mask=(kk < tl.where(j < TOP_K, I, 0))[None, :], other=0.0)

    @triton.jit
    def _down_kernel(act_ptr, logits_ptr, w_ptr, x_ptr, out_ptr, ss_out_ptr, T, E, H, I,
                     stride_we, stride_wn, stride_x, stride_out, E_POW2: tl.constexpr,
                     TOP_K: tl.constexpr, K_POW2: tl.constexpr, RENORM: tl.constexpr,
                     SUM_SQ: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     EARLY: tl.constexpr, PDL: tl.constexpr):
        t, pn = tl.program_id(0), tl.program_id(1)
        if not EARLY:
            pdl_wait(PDL)  # the activations of the gate_up kernel
            pdl_release(PDL)
        # EARLY: the routing and the first W tiles before the wait. The logits are the
        # route kernel's, complete here: this grid launches only once every gate_up
        # program has released it, which each does after its own wait for the route kernel
        ids, weights = _top_k(logits_ptr + t * E, E, E_POW2, TOP_K, K_POW2, RENORM)
        rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.minimum(rn, H - 1)  # a block past H reads row H - 1, stores nothing
        rk = tl.arange(0, BLOCK_K)
        kt = tl.cdiv(I, BLOCK_K)
        steps = TOP_K * kt
        # two tiles in flight throughout, across the experts' boundaries
        wa = _down_tile(w_ptr, rows, ids, 0, kt, I, stride_we, stride_wn, TOP_K, K_POW2, BLOCK_K)
        wb = _down_tile(w_ptr, rows, ids, 1, kt, I, stride_we, stride_wn, TOP_K, K_POW2, BLOCK_K)
        if EARLY:
            pdl_wait(PDL)  # the activations of the gate_up kernel
            pdl_release(PDL)
        acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
        total = tl.zeros((BLOCK_N,), tl.float32)
        out_ty = out_ptr.dtype.element_ty
        for s in range(0, steps):
            wc = _down_tile(w_ptr, rows, ids, s + 2, kt, I, stride_we, stride_wn, TOP_K,
                            K_POW2, BLOCK_K)
            j = s // kt
            kk = (s - j * kt) * BLOCK_K + rk
            a = tl.load(act_ptr + (t * TOP_K + j).to(tl.int64) * I + kk, mask=kk < I,
                        other=0.0)
            acc += wa.to(tl.float32) * a.to(tl.float32)[None, :]
            if (s + 1) % kt == 0:  # expert j done: its output rounded, weighted, rounded
                y = tl.sum(acc, axis=1).to(out_ty).to(tl.float32)
                total += (y * _slot(weights, j, K_POW2)).to(out_ty).to(tl.float32)
                acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
            wa = wb
            wb = wc
        nmask = rn < H
        r = tl.load(x_ptr + t * stride_x + rn, mask=nmask, other=0.0).to(tl.float32)
        new = (r + total.to(out_ty).to(tl.float32)).to(out_ty)
        tl.store(out_ptr + t * stride_out + rn, new, mask=nmask)
        if SUM_SQ:  # this block's share of the new stream's sum of squares
            nf = tl.where(nmask, new.to(tl.float32), 0.0)
            tl.store(ss_out_ptr + pn * T + t, tl.sum(nf * nf, axis=0))


#: (route: experts a program and its K step; gate_up and down: W rows a program, K step),
#: the one-row loop's tiles (kernels/gemv.py's SwiGLU and o kinds)
#: DOWN_EARLY: the down kernel routes and requests its first tiles before its PDL wait
DECODE_TILES = dict(ROUTE_E=1, ROUTE_K=2048, GATE_UP_N=16, GATE_UP_K=256, GATE_UP_DEPTH=1,
                    GATE_UP_WARPS=4, DOWN_N=8, DOWN_K=512, DOWN_WARPS=4, DOWN_EARLY=True)


def _check(stream, sum_sq, norm_weight, w_router, w_gate_up, w_down, top_k):
    assert stream.dim() == 2 and stream.is_contiguous() and stream.dtype in (
        torch.float32, torch.float16, torch.bfloat16), \
        f"stream must be a contiguous float [T, H], got {tuple(stream.shape)} {stream.dtype}"
    t, h = stream.shape
    assert sum_sq.dim() == 2 and sum_sq.shape[1] == t and sum_sq.is_contiguous() and \
        sum_sq.dtype == torch.float32, f"sum_sq must be contiguous float32 [P, {t}] partial " \
        f"sums, got {tuple(sum_sq.shape)} {sum_sq.dtype}"
    assert w_gate_up.dim() == 3 and w_gate_up.shape[2] == h and w_gate_up.shape[1] % 2 == 0, \
        f"w_gate_up must be [E, 2I, {h}], got {tuple(w_gate_up.shape)}"
    e, i = w_gate_up.shape[0], w_gate_up.shape[1] // 2
    for name, w, shape in (("norm_weight", norm_weight, (h,)), ("w_router", w_router, (e, h)),
                           ("w_gate_up", w_gate_up, (e, 2 * i, h)),
                           ("w_down", w_down, (e, h, i))):
        assert w.shape == shape and w.dtype == stream.dtype and w.is_contiguous(), \
            f"{name} must be contiguous {stream.dtype} {shape}, got {tuple(w.shape)} " \
            f"{w.dtype} (8-bit experts take the grouped kernels)"
    assert 1 <= top_k <= e, f"top_k must be in [1, {e}] (the experts), got {top_k}"
    return t, h, e, i


def moe_decode_triton(stream, sum_sq, norm_weight, eps, w_router, w_gate_up, w_down, top_k,
                      renormalize, want_sum_sq=True, tiles=None):
    """As ``moe_decode_torch`` (16-bit or float32 weights of the stream's dtype); the new
    stream's sums of squares as partials [P, T] (a program's block of H each)."""
    t, h, e, i = _check(stream, sum_sq, norm_weight, w_router, w_gate_up, w_down, top_k)
    cfg = dict(DECODE_TILES, **(tiles or {}))
    dev, dt = stream.device, stream.dtype
    xn = torch.empty((t, h), dtype=dt, device=dev)
    logits = torch.empty((t, e), dtype=dt, device=dev)
    act = torch.empty((t * top_k, i), dtype=dt, device=dev)
    out = torch.empty_like(stream)
    blocks = triton.cdiv(h, cfg["DOWN_N"])
    parts = torch.empty((blocks, t), dtype=torch.float32, device=dev) if want_sum_sq else None
    pdl = pdl_launch(dev)
    routing = dict(E_POW2=next_pow2(e), TOP_K=top_k, K_POW2=max(2, next_pow2(top_k)),
                   RENORM=bool(renormalize))
    _route_kernel[(triton.cdiv(e, cfg["ROUTE_E"]), t)](
        stream, sum_sq, norm_weight, w_router, xn, logits, t, e, h, sum_sq.shape[0], eps,
        stream.stride(0), w_router.stride(0), P_POW2=max(2, next_pow2(sum_sq.shape[0])),
        BLOCK_E=cfg["ROUTE_E"], BLOCK_K=cfg["ROUTE_K"], num_warps=4, **pdl)
    _gate_up_kernel[(t * top_k, triton.cdiv(i, cfg["GATE_UP_N"]))](
        xn, logits, w_gate_up, act, e, h, i, w_gate_up.stride(0), w_gate_up.stride(1),
        **routing, BLOCK_N=cfg["GATE_UP_N"], BLOCK_K=cfg["GATE_UP_K"],
        DEPTH=cfg["GATE_UP_DEPTH"], num_warps=cfg["GATE_UP_WARPS"], num_stages=1, **pdl)
    _down_kernel[(t, blocks)](
        act, logits, w_down, stream, out, out if parts is None else parts, t, e, h, i,
        w_down.stride(0), w_down.stride(1), stream.stride(0), out.stride(0), **routing,
        SUM_SQ=want_sum_sq, BLOCK_N=cfg["DOWN_N"], BLOCK_K=cfg["DOWN_K"],
        EARLY=cfg["DOWN_EARLY"], num_warps=cfg["DOWN_WARPS"], num_stages=1, **pdl)
    return out, parts
