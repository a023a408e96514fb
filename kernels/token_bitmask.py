"""Token bitmasks on logits: the rows of a step that a constraint restricts (a JSON schema,
a regex, a grammar: core/logits_processor.py), all masked in one launch.

``bitmask`` [R, W] int32 holds one row per constrained logits row ``rows[r]``: bit
``t % 32`` of word ``t // 32`` set means token ``t`` is allowed (xgrammar's and
llguidance's layout). A disallowed token's logit becomes -inf, and so does every token
at or past ``32 * W`` (logits wider than the mask: a model's vocabulary padded beyond its
tokenizer's). Rows of ``logits`` that ``rows`` does not name are left as they are, so the
unconstrained requests of a batch keep exactly their logits.

``rows`` must be distinct and within ``logits``' rows: the launcher checks shapes, dtypes
and devices, not the values (that would wait for the device).
"""
import torch

from ._triton import HAVE_TRITON, tl, triton

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BITS = 32  # tokens per int32 word


def _check(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.dtype not in _DTYPES:
        raise ValueError(f"logits must be 2-D [B, V] float32, float16 or bfloat16, got "
                         f"{logits.dtype} of shape {tuple(logits.shape)}")
    if bitmask.dim() != 2 or bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be 2-D [R, W] int32, got {bitmask.dtype} of shape "
                         f"{tuple(bitmask.shape)}")
    if not bitmask.is_contiguous():
        raise ValueError(f"bitmask must be contiguous, got strides {bitmask.stride()}")
    if rows.dim() != 1 or rows.dtype != torch.int64 or rows.shape[0] != bitmask.shape[0]:
        raise ValueError(f"rows must be 1-D int64 with one entry per bitmask row "
                         f"({bitmask.shape[0]}), got {rows.dtype} of shape {tuple(rows.shape)}")
    if rows.shape[0] > logits.shape[0]:
        raise ValueError(f"{rows.shape[0]} bitmask rows for {logits.shape[0]} logits rows: "
                         "each constrained row is named once")
    if not (logits.device == bitmask.device == rows.device):
        raise ValueError(f"logits, bitmask and rows must share a device, got {logits.device}, "
                         f"{bitmask.device}, {rows.device}")


def apply_token_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor,
                              rows: torch.Tensor) -> torch.Tensor:
    # logits: [B, V] masked in place at rows [R]; bitmask: [R, W] int32. Returns logits.
    _check(logits, bitmask, rows)
    r, v = rows.shape[0], logits.shape[1]
    if r == 0:
        return logits
    # each word against its 32 one-bit words (1 << 31 is int32's sign bit): [R, 32 W]
    bits = (torch.ones(BITS, dtype=torch.int64) << torch.arange(BITS)).to(torch.int32)
    banned = (bitmask.unsqueeze(-1) & bits.to(bitmask.device)).view(r, -1) == 0
    n = min(v, banned.shape[1])
    picked = logits[rows]  # [R, V], a copy
    picked[:, :n].masked_fill_(banned[:, :n], float("-inf"))
    picked[:, n:] = float("-inf")  # past the mask's 32 W tokens
    logits[rows] = picked
    return logits


if HAVE_TRITON:

    @triton.jit
    def _apply_token_bitmask_kernel(logits_ptr, bitmask_ptr, rows_ptr, stride_l, stride_b,
                                    V, W, BLOCK: tl.constexpr):
        # Program (r, c): columns [c * BLOCK, (c + 1) * BLOCK) of logits row rows[r].
        r = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)               # [BLOCK]
        row = tl.load(rows_ptr + r)  # int64: row * stride may exceed 2**31
        words = tl.load(bitmask_ptr + r * stride_b + cols // 32, mask=cols < W * 32, other=0)
        # an arithmetic shift of a negative word still leaves the wanted bit at bit 0
        allowed = (words >> (cols % 32)) & 1
        tl.store(logits_ptr + row * stride_l + cols, float("-inf"),
                 mask=(cols < V) & (allowed == 0))


def apply_token_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor,
                               rows: torch.Tensor, block: int = 1024) -> torch.Tensor:
    # logits: [B, V] (last dim contiguous) masked in place at rows [R]; bitmask: [R, W]
    # int32. ``block``: columns per program (a power of 2, for tests of the boundaries).
    _check(logits, bitmask, rows)
    if logits.shape[1] > 1 and logits.stride(1) != 1:
        raise ValueError(f"logits must be contiguous in its last dim, got strides "
                         f"{logits.stride()}")
    if block < 32 or block & (block - 1):
        raise ValueError(f"block must be a power of 2 >= 32, got {block}")
    r, v = rows.shape[0], logits.shape[1]
    if r == 0 or v == 0:
        return logits
    grid = (r, triton.cdiv(v, block))
    _apply_token_bitmask_kernel[grid](logits, bitmask, rows, logits.stride(0),
                                      bitmask.stride(0), v, bitmask.shape[1], BLOCK=block)
    return logits
