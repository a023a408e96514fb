"""Greedy decoding: the float32 logits and each row's argmax in one pass over the lm_head output.

The argmax follows ``torch.argmax``: ties go to the first index, and a NaN beats
everything (the row's first NaN wins), so a broken logit is never silently skipped.
"""
import torch

from ._triton import HAVE_TRITON, next_pow2, pdl_enter, pdl_launch, tl, triton

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


def logits_argmax_torch(y: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
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
        # across lanes: the smallest column among the lanes holding the row's max
        is_nan = best != best
        top = tl.max(tl.where(is_nan, float("-inf"), best), axis=0)
        has_nan = tl.max(is_nan.to(tl.int32), axis=0) > 0
        winner = tl.where(has_nan, is_nan, best == top)
        idx = tl.min(tl.where(winner, best_idx, V), axis=0)
        tl.store(out_ptr + row, idx.to(tl.int64))


def logits_argmax_triton(y: torch.Tensor, out: torch.Tensor, block: int | None = None) -> torch.Tensor:
    # y: [n, V] (rows any stride, last dim contiguous) -> new float32 [n, V]; out: [n] int64
    # ``block``: chunk width (a power of 2), for tests of the chunk boundaries
    _check(y, out)
    if block is not None and (block < 16 or block & (block - 1)):
        raise ValueError(f"block must be a power of 2 >= 16, got {block}")
    n, v = y.shape
    if v > 1 and y.stride(1) != 1:
        raise ValueError(f"y must be contiguous in its last dim, got strides {y.stride()}")
    logits = torch.empty((n, v), dtype=torch.float32, device=y.device)
    if n == 0:
        return logits
    # it ends the decode step (one program per row: latency, not bandwidth): 16 fp32 a
    # thread per chunk, up to 32 warps, so V = 32000 takes 2 trips to memory, not 8
    block = block or min(next_pow2(v), 16384)
    warps = min(32, max(4, block // 512))
    _logits_argmax_kernel[(n,)](y, logits, out, y.stride(0), logits.stride(0), v,
                                BLOCK=block, num_warps=warps, **pdl_launch(y.device))
    return logits
