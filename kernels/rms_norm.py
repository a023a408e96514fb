"""RMSNorm, optionally fused with the residual add (LLaMA-style pre-norm).

``add_rms_norm`` also takes x as float32 partial sums [S, N, H] of a split-K GEMM
(``linear_partials``): it adds them up in order, rounds to the residual's dtype, then
adds the residual, so the split costs no reduce kernel of its own.

``unit_offset=True`` is Gemma's RMSNorm: it scales by ``1 + weight`` (the checkpoint
stores the offset from 1) and rounds once, ``(x * rstd * (1 + w)).to(dtype)`` all in
float32, where LLaMA's rounds the normalised row before the weight.
"""
import torch

from ._triton import (HAVE_TRITON, load_row_add_residual, norm_buffers, pdl_enter, pdl_launch,
                      tl, triton)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   unit_offset: bool = False) -> torch.Tensor:
    # x: [N, H] -> [N, H]; statistics in float32, like HF's LlamaRMSNorm (Gemma's with
    # unit_offset: Gemma2RMSNorm's operations, in its order)
    if unit_offset:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())
        return out.to(torch.promote_types(x.dtype, weight.dtype))
    if x.dtype == torch.float32 and weight.dtype == torch.float32:  # one op, not seven
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def sum_partials(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[S, N, H] float32 partials -> [N, H] in ``dtype``, added in split order like the
    kernel; [N, H] passes through."""
    if x.dim() == 2:
        return x
    total = x[0]
    for part in x[1:]:
        total = total + part
    return total.to(dtype)


def add_rms_norm_torch(x, residual, weight, eps, unit_offset: bool = False):
    """h = x + residual; returns (rms_norm(h) * weight, h). x may be split-K partials."""
    h = sum_partials(x, residual.dtype) + residual
    return rms_norm_torch(h, weight, eps, unit_offset), h


if HAVE_TRITON:

    @triton.jit
    def _rms_norm_kernel(
        x_ptr, r_ptr, w_ptr, out_ptr, h_ptr,
        stride_x, stride_r, stride_out, stride_h, stride_s,
        H, eps,
        HAS_RESIDUAL: tl.constexpr, NSPLIT: tl.constexpr, BLOCK_H: tl.constexpr,
        PDL: tl.constexpr, UNIT_OFFSET: tl.constexpr = False):
        pdl_enter(PDL)
        # One program per row; the whole row [BLOCK_H] lives in registers.
        row = tl.program_id(0).to(tl.int64)  # int64: row * stride may exceed 2**31
        cols = tl.arange(0, BLOCK_H)
        mask = cols < H
        x = load_row_add_residual(x_ptr, r_ptr, h_ptr, row, stride_x, stride_r, stride_h,
                                  cols, mask, HAS_RESIDUAL, NSPLIT, stride_s)
        xf = x.to(tl.float32)
        var = tl.sum(xf * xf, axis=0) / H
        rstd = 1.0 / tl.sqrt(var + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if UNIT_OFFSET:  # Gemma: (x * rstd) * (1 + w) in float32, one rounding
            y = xf * rstd
            w = w + 1.0
        else:  # round the normalised row to the input dtype before the weight, as the reference
            y = (xf * rstd).to(x.dtype).to(tl.float32)
        tl.store(out_ptr + row * stride_out + cols,
                 (y * w).to(out_ptr.dtype.element_ty), mask=mask)


def _num_warps(block: int) -> int:
    # enough threads to keep ~8-16 elements per thread on wide rows
    return 4 if block < 2048 else 8 if block < 8192 else 16


def _launch(x, residual, weight, eps, unit_offset=False):
    parts, stride_s, x_dtype = 1, 0, None
    if x.dim() == 3:  # split-K partials [S, N, H] float32, summed by the kernel
        assert residual is not None and x.dtype == torch.float32, \
            "x as [S, N, H] partial sums must be float32 and come with a residual"
        parts, stride_s, x_dtype = x.shape[0], x.stride(0), residual.dtype
        x = x[0]
    assert x.dim() == 2, f"x must be [N, H], got shape {tuple(x.shape)}"
    n, h = x.shape
    assert weight.shape == (h,), f"weight must be [{h}], got {tuple(weight.shape)}"
    assert x.device == weight.device, f"x on {x.device} but weight on {weight.device}"
    assert x.is_floating_point() and weight.is_floating_point(), "x and weight must be floating point"
    assert h <= 1 or x.stride(1) == 1, f"x must be contiguous in its last dim, strides {x.stride()}"
    assert weight.stride(0) == 1 or h <= 1, "weight must be contiguous"
    out, hbuf, r, block = norm_buffers(x, residual, weight, x_dtype)
    if n == 0 or h == 0:
        return out, hbuf
    _rms_norm_kernel[(n,)](
        x, r, weight, out, hbuf,
        x.stride(0), r.stride(0), out.stride(0), hbuf.stride(0),
        stride_s, h, float(eps),
        HAS_RESIDUAL=residual is not None, NSPLIT=parts, BLOCK_H=block,
        num_warps=_num_warps(block), UNIT_OFFSET=unit_offset,
        **pdl_launch(x.device))
    return out, hbuf


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    unit_offset: bool = False) -> torch.Tensor:
    # x: [N, H] (rows any stride, last dim contiguous), weight: [H] -> new [N, H]
    return _launch(x, None, weight, eps, unit_offset)[0]


def add_rms_norm_triton(x, residual, weight, eps, unit_offset: bool = False):
    """h = x + residual; returns (rms_norm(h) * weight, h), both new tensors."""
    return _launch(x, residual, weight, eps, unit_offset)
