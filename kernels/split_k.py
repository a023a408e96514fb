"""Split-K for the decode GEMMs that compute y^T tiles (``int4_mma``, ``fp8_mma``).

Narrow outputs (N = hidden) give too few column tiles to keep every SM streaming, so K is
split over S programs too. Each split stores float32 partials [S, M, N]; the last split
of a column tile to finish (a counter, ``last_to_arrive``) sums them in split order
(deterministic), adds the bias and stores y, then sets its counter back to 0. Where the
caller's ``CounterPool`` cannot give counters (it would have to grow inside a CUDA graph
capture), ``int4_gemv.reduce_partials`` does the sum in a second launch.
"""
import torch

from ._triton import HAVE_TRITON, last_to_arrive, tl, triton
from .int4_gemv import reduce_partials

if HAVE_TRITON:

    @triton.jit
    def store_tile(acc, y_ptr, p_ptr, cnt_ptr, b_ptr, rn, nmask, y_off, ymask, stride_ys,
                   SPLIT: tl.constexpr, FIXUP: tl.constexpr, HAS_BIAS: tl.constexpr):
        """acc [BN, BM] float32 (this program's share of y^T, columns rn) -> y, directly
        (SPLIT 1) or through the partials, summed by the tile's last split (FIXUP) or
        left for ``reduce_partials``. y_off / ymask: [BN, BM] offsets into y [M, N] (the
        partials' planes have the same layout, stride_ys apart)."""
        if SPLIT > 1:
            tl.store(p_ptr + tl.program_id(1) * stride_ys + y_off, acc, mask=ymask)
            if FIXUP:
                if last_to_arrive(cnt_ptr + tl.program_id(0), SPLIT):
                    acc = tl.load(p_ptr + y_off, mask=ymask, other=0.0)
                    for s in tl.static_range(1, SPLIT):
                        acc += tl.load(p_ptr + s * stride_ys + y_off, mask=ymask, other=0.0)
                    if HAS_BIAS:
                        acc += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[:, None]
                    tl.store(y_ptr + y_off, acc.to(y_ptr.dtype.element_ty), mask=ymask)
                    tl.atomic_xchg(cnt_ptr + tl.program_id(0), 0)
        else:
            if HAS_BIAS:
                acc += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[:, None]
            tl.store(y_ptr + y_off, acc.to(y_ptr.dtype.element_ty), mask=ymask)


def splits(tiles: int, split: int) -> tuple[int, int]:
    """(K tiles a split, splits) for ``split`` asked over ``tiles``: no empty split."""
    per = -(-tiles // split)
    return per, -(-tiles // per)


def auto_split(programs: int, tiles: int, sms: int = 132) -> int:
    """Split K until about two programs an SM, at most 8 ways, keeping >= 4 K tiles a
    split (untuned)."""
    split = 1
    while split < 8 and programs * split < 2 * sms and tiles >= 4 * split:
        split *= 2
    return split


def outputs(m: int, n: int, split: int, block_n: int, like: torch.Tensor, y, counters):
    """(y [M, N] in x's dtype, partials (y itself at one split), counters or None)."""
    from .paged_plan import counters_for

    if y is None:
        y = torch.empty((m, n), dtype=like.dtype, device=like.device)
    assert y.is_contiguous() and y.shape == (m, n), f"y must be contiguous [{m}, {n}]"
    if split == 1:
        return y, y, None
    parts = torch.empty((split, m, n), dtype=torch.float32, device=like.device)
    return y, parts, counters_for(counters, like.device, -(-n // block_n))


def finish(y, parts, cnt, bias):
    """y, after ``reduce_partials`` where the kernel could not sum the splits itself."""
    if parts is not y and cnt is None:
        reduce_partials(parts, bias, y)
    return y
