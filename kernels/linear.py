"""Skinny GEMM for decode: y = x W^T (+ b) with few rows (M <= 64), weight-bandwidth bound.

At decode every weight is read once per step, so the kernel's job is to stream W at
full HBM bandwidth: tiles of W [BLOCK_N, BLOCK_K] go through a software-pipelined
tl.dot (rows of x are padded to 16, the tensor-core minimum; the waste is free because
the GEMM is memory-bound). Larger M goes to cuBLAS (F.linear).

Split-K: narrow outputs (N = hidden: the o and down projections) give too few column
tiles to keep every SM streaming, so K is split over S programs too. Each writes its
float32 partial tile to scratch and bumps a per-tile counter; the last to arrive sums
the S partials in split order (deterministic, whichever program is last), stores the
output and resets the counter, so no reduce kernel is launched.
"""
import functools

import torch
import torch.nn.functional as F

from ._triton import HAVE_TRITON, next_pow2, pdl_enter, pdl_launch, tl, triton

MAX_SKINNY_M = 16  # above this cuBLAS streams the weights as fast (H200 sweep) ...
MAX_SPLIT_M = 64  # ... except narrow N, where split-K beats it up to here
MAX_TILES = 1 << 16  # column tiles one split-K launch may have (counters per device)


def linear_torch(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    # x: [M, K], weight: [N, K], bias: [N] -> [M, N]
    return F.linear(x, weight, bias)


if HAVE_TRITON:

    @triton.jit
    def _skinny_gemm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, count_ptr, M, N, K, K_SPLIT,
                            stride_xm, stride_wn, stride_ym,
                            HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        pdl_enter(PDL)
        # one program per (BLOCK_N output columns, K_SPLIT slice of K); all M rows at
        # once, so W is read once
        pid = tl.program_id(0)
        split = tl.program_id(1)
        k_lo = split * K_SPLIT
        k_hi = tl.minimum(k_lo + K_SPLIT, K)
        rm = tl.arange(0, BLOCK_M)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + rm[:, None] * stride_xm + (k_lo + rk)[None, :]                # [BM, BK]
        w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + (k_lo + rk)[None, :]   # [BN, BK]
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)  # tl.zeros fails in the 3.9 interpreter
        for k0 in range(k_lo, k_hi, BLOCK_K):
            kmask = (k0 + rk) < k_hi
            x = tl.load(x_ptrs, mask=(rm[:, None] < M) & kmask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=(rn[:, None] < N) & kmask[None, :], other=0.0)
            acc += tl.dot(x, tl.trans(w))                                       # [BM, BN]
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if HAS_BIAS:
            if split == 0:  # the bias goes into one split only
                acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        y_ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :]
        if SPLIT:
            tile = rm[:, None] * N + rn[None, :]                                # [BM, BN]
            tl.store(part_ptr + split * M * N + tile, acc, mask=mask)
            # acq_rel: our partial is visible before the count, and the last program
            # sees every partial counted before it
            arrived = tl.atomic_add(count_ptr + pid, 1, sem="acq_rel")
            nsplit = tl.num_programs(1)
            if arrived == nsplit - 1:  # the last split of this column tile
                total = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
                for s in range(0, nsplit):  # split order: the same sum whoever is last
                    total += tl.load(part_ptr + s * M * N + tile, mask=mask, other=0.0,
                                     cache_modifier=".cg")  # L2: other SMs wrote them
                tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=mask)
                tl.atomic_xchg(count_ptr + pid, 0)  # ready for the next launch
        else:
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def skinny_config(m: int, n: int, k: int) -> tuple[int, dict]:
    """(S, tiles) for [M, K] x [N, K]^T: S > 1 splits K. From sweeps on an H200 over the
    LLaMA-7B decode GEMMs (``kernels/benchmarks.py``, ``--split 1,32,64``; TB/s of
    weights): wide N likes wide tiles and no split (gate_up, lm_head 4.1-4.2 at M=1; qkv
    3.9); narrow N (o 4096x4096, down 4096x11008) has too few column tiles and splits K:
    o 3.2-3.3 at M=1 (unsplit 2.9, cuBLAS 2.4), 3.1 at M=32 (cuBLAS 2.4); down 3.7-3.8
    at M=1 (unsplit 3.7, cuBLAS 3.3), 3.5 at M=32 (cuBLAS 3.2)."""
    block_m = max(16, next_pow2(m))
    if n >= 16384:
        return 1, dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)
    if n > 8192:  # fused qkv
        return 1, dict(BLOCK_M=block_m, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=4)
    if m <= 16:
        return 4, dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)
    if k <= 4096:
        return 2, dict(BLOCK_M=block_m, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=4)
    return 4, dict(BLOCK_M=block_m, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=4)


def linear_triton(x: torch.Tensor, weight: torch.Tensor, bias=None, config=None) -> torch.Tensor:
    # x: [M, K] (last dim contiguous), weight: [N, K] contiguous -> new [M, N]
    assert x.dim() == 2 and weight.dim() == 2, f"x {tuple(x.shape)}, weight {tuple(weight.shape)}"
    m, n = x.shape[0], weight.shape[0]
    # float32 stays on cuBLAS (exact fp32, no tf32): the skinny path is for bf16/fp16
    if m == 0 or x.dtype == torch.float32 or m > MAX_SPLIT_M:
        return F.linear(x, weight, bias)
    split, cfg = config or skinny_config(m, n, x.shape[1])
    if m > MAX_SKINNY_M and split == 1:  # wide N at 17..64 rows: cuBLAS is as fast
        return F.linear(x, weight, bias)
    return skinny_gemm(x, weight, bias, cfg, split)


@functools.lru_cache(maxsize=None)
def _tile_counters(device: torch.device) -> torch.Tensor:
    """Per-device arrival counters of split-K tiles; each launch leaves them at zero.
    (Shared by all split-K launches: kernels on one stream run one after another.)"""
    return torch.zeros(MAX_TILES, dtype=torch.int32, device=device)


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias=None, config=None,
                split_k: int = 1) -> torch.Tensor:
    """The Triton kernel itself, any float dtype (tests call it directly in float32).
    ``split_k``: split K over up to that many programs per column tile (whole K tiles)."""
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k, f"x has K={k} but weight is {tuple(weight.shape)}"
    assert x.dtype == weight.dtype, f"x {x.dtype} != weight {weight.dtype}"
    assert weight.is_contiguous() and (k <= 1 or x.stride(1) == 1), "weight and x rows must be contiguous"
    assert bias is None or bias.shape == (n,), f"bias must be [{n}]"
    assert 0 < m <= MAX_SPLIT_M, f"skinny GEMM takes 1..{MAX_SPLIT_M} rows, got {m}"
    cfg = dict(config or skinny_config(m, n, k)[1])
    block_k, tiles = cfg["BLOCK_K"], triton.cdiv(n, cfg["BLOCK_N"])
    k_split = triton.cdiv(triton.cdiv(k, max(1, split_k)), block_k) * block_k
    splits = triton.cdiv(k, k_split) if k else 1
    assert splits == 1 or tiles <= MAX_TILES, f"{tiles} column tiles > {MAX_TILES}"
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    part = torch.empty((splits, m, n), dtype=torch.float32, device=x.device) if splits > 1 else y
    counts = _tile_counters(x.device) if splits > 1 else y
    _skinny_gemm_kernel[(tiles, splits)](
        x, weight, bias if bias is not None else weight, y, part, counts, m, n, k, k_split,
        x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, SPLIT=splits > 1, **cfg, **pdl_launch(x.device))
    return y
