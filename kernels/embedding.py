"""Token embedding fused with the first RMSNorm's statistic (sum of squares per row).

The fused decode step starts with ``F.embedding`` then ``h.float().square().sum(-1)``:
four torch kernels; ``embed_sum_sq_triton`` does both in one launch.
"""
import torch
import torch.nn.functional as F

from ._triton import HAVE_TRITON, next_pow2, pdl_launch, pdl_release, pdl_wait, tl, triton

_ID_DTYPES = (torch.int32, torch.int64)
_WEIGHT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_CHUNK = 8192  # widest chunk of a row held in registers at once


def _check(tokens: torch.Tensor, weight: torch.Tensor) -> None:
    if tokens.dim() != 1 or tokens.dtype not in _ID_DTYPES:
        raise ValueError(f"tokens must be a 1-D int32 or int64 tensor of ids, got shape "
                         f"{tuple(tokens.shape)} dtype {tokens.dtype}")
    if weight.dim() != 2 or weight.dtype not in _WEIGHT_DTYPES:
        raise ValueError(f"weight must be a 2-D [V, H] float16, bfloat16 or float32 table, got "
                         f"shape {tuple(weight.shape)} dtype {weight.dtype}")
    if tokens.device != weight.device:
        raise ValueError(f"tokens on {tokens.device} but weight on {weight.device}: "
                         "they must be on the same device")
    if weight.shape[1] > 1 and weight.stride(1) != 1:
        raise ValueError(f"weight must be contiguous in its last dim (any row stride), "
                         f"strides {weight.stride()}")
    # Ids are checked only where it is free (CPU): on CUDA this would sync the host, and
    # the op runs inside CUDA graphs; there the engine has validated ids at admission.
    if tokens.device.type == "cpu" and tokens.numel():
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= weight.shape[0]:
            raise ValueError(f"token ids must lie in [0, {weight.shape[0]}), got min {lo} max {hi}")


def embed_sum_sq_torch(tokens: torch.Tensor, weight: torch.Tensor):
    # tokens: [T], weight: [V, H] -> (h [T, H] weight.dtype, sum_sq [1, T] float32)
    _check(tokens, weight)
    h = F.embedding(tokens, weight)
    return h, h.float().square().sum(-1)[None]


if HAVE_TRITON:

    @triton.jit
    def _embed_sum_sq_kernel(tok_ptr, w_ptr, h_ptr, ss_ptr, stride_tok, stride_w, H,
                             BLOCK: tl.constexpr, PDL: tl.constexpr):
        # the previous kernel may have written the tokens (the last step's argmax): wait
        # for it, then release at once so the next kernel's weight preload overlaps us
        pdl_wait(PDL)
        pdl_release(PDL)
        row = tl.program_id(0).to(tl.int64)  # one program per token; int64: row * H
        # no bounds check (none in a CUDA graph): Engine.encode validates ids at admission
        tok = tl.load(tok_ptr + row * stride_tok).to(tl.int64)
        src = w_ptr + tok * stride_w
        dst = h_ptr + row * H
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, H, BLOCK):  # one pass unless H > 8192
            cols = start + tl.arange(0, BLOCK)  # [BLOCK]
            mask = cols < H
            x = tl.load(src + cols, mask=mask, other=0.0)
            tl.store(dst + cols, x, mask=mask)  # raw copy: bit-exact h
            xf = x.to(tl.float32)
            acc += xf * xf
        tl.store(ss_ptr + row, tl.sum(acc, axis=0))


def embed_sum_sq_triton(tokens: torch.Tensor, weight: torch.Tensor):
    # tokens: [T] (any stride), weight: [V, H] (rows any stride, last dim contiguous)
    # -> (h [T, H] new contiguous, weight.dtype; sum_sq [1, T] float32)
    _check(tokens, weight)
    t, h = tokens.shape[0], weight.shape[1]
    out = torch.empty((t, h), dtype=weight.dtype, device=weight.device)
    sum_sq = torch.empty((1, t), dtype=torch.float32, device=weight.device)
    if t == 0:
        return out, sum_sq
    block = min(next_pow2(h), _MAX_CHUNK)
    _embed_sum_sq_kernel[(t,)](
        tokens, weight, out, sum_sq, tokens.stride(0), weight.stride(0), h,
        BLOCK=block, num_warps=8 if block >= 4096 else 4,
        **pdl_launch(tokens.device))
    return out, sum_sq
