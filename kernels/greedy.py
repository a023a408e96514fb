"""Greedy decoding: the float32 logits and each row's argmax in one pass over the lm_head output.

The argmax follows ``torch.argmax``: ties go to the first index, and a NaN beats
everything (the row's first NaN wins), so a broken logit is never silently skipped.

It ends every decode step, so its latency counts: one program walking a 32000-wide row
waits on its loads one chunk after another, while the row split over 16 programs (the
last to finish picking among their winners) has all its loads in flight at once.
docs/kernels.md has the figures.
"""
import torch

from . import switches
from ._triton import HAVE_TRITON, last_to_arrive, next_pow2, pdl_enter, pdl_launch, tl, triton
from .paged_plan import counters_for

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check(y: torch.Tensor, out: torch.Tensor) -> None:
    if y.dim() != 2:
        raise ValueError(f"y must be 2-D logits [n, V], got shape {tuple(y.shape)}")
    if y.dtype not in _DTYPES:
        raise ValueError(f"y must be float16, bfloat16 or float32, got {y.dtype}")
    n, v = y.shape
    if n > 0 and v == 0:
        raise ValueError(f"y has {n} rows of width 0: an empty row has no argmax")
    if out.dtype != torch.int64:
        raise ValueError(f"out must be int64, got {out.dtype}")
    if tuple(out.shape) != (n,):
        raise ValueError(f"out must have shape ({n},) (one index per row of y), "
                         f"got {tuple(out.shape)}")
    if out.device != y.device:
        raise ValueError(f"out must be on y's device {y.device}, got {out.device}")
    if not out.is_contiguous():
        raise ValueError(f"out must be contiguous, got strides {out.stride()}")


def logits_argmax_torch(y: torch.Tensor, out: torch.Tensor, *, counters=None) -> torch.Tensor:
    # y: [n, V] -> new float32 [n, V]; out: [n] int64 <- argmax per row (written in place)
    _check(y, out)
    # copy=True: y.float() would hand back y itself when y is already float32
    logits = y.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
    if y.shape[0] > 0:
        torch.argmax(logits, -1, out=out)  # shape already matches: no resize, writes into out
    return logits


if HAVE_TRITON:

    @triton.jit
    def _logits_argmax_kernel(y_ptr, logits_ptr, out_ptr, stride_y, stride_l, V,
                              BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl_enter(PDL)
        # One program per row, walking it in [BLOCK] chunks; each lane keeps its own best.
        row = tl.program_id(0).to(tl.int64)  # int64: row * stride may exceed 2**31
        lanes = tl.arange(0, BLOCK)
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        # a lane that never beats -inf still names its first column: an all -inf row -> 0
        best_idx = lanes
        for start in range(0, V, BLOCK):
            cols = start + lanes                                          # [BLOCK]
            mask = cols < V
            x = tl.load(y_ptr + row * stride_y + cols, mask=mask, other=float("-inf"))
            x = x.to(tl.float32)  # exact for fp16 / bf16
            tl.store(logits_ptr + row * stride_l + cols, x, mask=mask)
            # a lane sees its columns in increasing order: strict > keeps the first of a
            # tie; a NaN takes a non-NaN best and is kept from then on (the first NaN)
            take = (x > best) | ((x != x) & (best == best))
            best = tl.where(take, x, best)
            best_idx = tl.where(take, cols, best_idx)
        tl.store(out_ptr + row, _first_best(best, best_idx, V).to(tl.int64))

    @triton.jit
    def _first_best(best, best_idx, V):
        """Of candidates (value, column): the smallest column among those holding the max,
        or among the NaNs if any (torch.argmax's choice)."""
        is_nan = best != best
        top = tl.max(tl.where(is_nan, float("-inf"), best), axis=0)
        has_nan = tl.max(is_nan.to(tl.int32), axis=0) > 0
        winner = tl.where(has_nan, is_nan, best == top)
        return tl.min(tl.where(winner, best_idx, V), axis=0)

    @triton.jit
    def _logits_argmax_split_kernel(y_ptr, logits_ptr, out_ptr, best_ptr, idx_ptr, sem_ptr,
                                    stride_y, stride_l, V, BLOCK: tl.constexpr,
                                    BLOCK_C: tl.constexpr, PDL: tl.constexpr):
        pdl_enter(PDL)
        # Program (row, c) takes columns [c * BLOCK, (c + 1) * BLOCK): its logits and its
        # best; the last of the row's programs to finish (a counter) picks among them.
        row = tl.program_id(0).to(tl.int64)
        c, chunks = tl.program_id(1), tl.num_programs(1)
        cols = c * BLOCK + tl.arange(0, BLOCK)                                # [BLOCK]
        mask = cols < V
        x = tl.load(y_ptr + row * stride_y + cols, mask=mask, other=float("-inf")).to(tl.float32)
        tl.store(logits_ptr + row * stride_l + cols, x, mask=mask)
        tl.store(best_ptr + row * chunks + c, _chunk_value(x))
        # an all -inf chunk names its first column (so an all -inf row -> 0)
        tl.store(idx_ptr + row * chunks + c, _first_best(x, cols, V))
        if last_to_arrive(sem_ptr + row, chunks):
            k = tl.arange(0, BLOCK_C)
            km = k < chunks
            best = tl.load(best_ptr + row * chunks + k, mask=km, other=float("-inf"),
                           cache_modifier=".cg")
            idx = tl.load(idx_ptr + row * chunks + k, mask=km, other=V, cache_modifier=".cg")
            # the chunks' winners in column order: the first best of them is the row's
            tl.store(out_ptr + row, _first_best(best, idx, V).to(tl.int64))
            tl.store(sem_ptr + row, 0)  # zero again for the next call or graph replay

    @triton.jit
    def _chunk_value(x):
        """A chunk's best value: NaN if it holds one, else its max."""
        has_nan = tl.max((x != x).to(tl.int32), axis=0) > 0
        return tl.where(has_nan, float("nan"), tl.max(x, axis=0))


#: columns per program of the split kernel: 16 programs a row at V = 32000
SPLIT_BLOCK = 2048
# the split kernel (INFERGRAFT_ARGMAX_SPLIT=0: one program walks each row)
SPLIT_ON = switches.value("INFERGRAFT_ARGMAX_SPLIT")


def logits_argmax_triton(y: torch.Tensor, out: torch.Tensor, block: int | None = None,
                         split: bool | None = None, *, counters=None) -> torch.Tensor:
    # y: [n, V] (rows any stride, last dim contiguous) -> new float32 [n, V]; out: [n] int64
    # ``block``: chunk width (a power of 2), for tests of the chunk boundaries. ``split``:
    # a row's chunks on as many programs, merged by the last to finish (a counter from
    # ``counters``, the caller's paged_plan.CounterPool, or the shared one), else one
    # program walks the row
    _check(y, out)
    if block is not None and (block < 16 or block & (block - 1)):
        raise ValueError(f"block must be a power of 2 >= 16, got {block}")
    n, v = y.shape
    if v > 1 and y.stride(1) != 1:
        raise ValueError(f"y must be contiguous in its last dim, got strides {y.stride()}")
    logits = torch.empty((n, v), dtype=torch.float32, device=y.device)
    if n == 0:
        return logits
    if SPLIT_ON if split is None else split:
        block_s = block or min(next_pow2(v), SPLIT_BLOCK)
        chunks = -(-v // block_s)
        sems = counters_for(counters, y.device, n) if chunks > 1 else None
        if sems is not None:
            best = torch.empty((n, chunks), dtype=torch.float32, device=y.device)
            idx = torch.empty((n, chunks), dtype=torch.int32, device=y.device)
            _logits_argmax_split_kernel[(n, chunks)](
                y, logits, out, best, idx, sems, y.stride(0), logits.stride(0), v,
                BLOCK=block_s, BLOCK_C=max(2, next_pow2(chunks)),
                num_warps=min(8, max(1, block_s // 256)), **pdl_launch(y.device))
            return logits
    # one program per row (latency, not bandwidth): 16 fp32 a thread per chunk, up to 32
    # warps, so V = 32000 takes 2 trips to memory, not 8
    block = block or min(next_pow2(v), 16384)
    warps = min(32, max(4, block // 512))
    _logits_argmax_kernel[(n,)](y, logits, out, y.stride(0), logits.stride(0), v,
                                BLOCK=block, num_warps=warps, **pdl_launch(y.device))
    return logits
