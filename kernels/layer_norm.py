"""LayerNorm (mean and variance, weight and bias), optionally fused with the residual add
(GPT-2-style pre-norm)."""
import torch
import torch.nn.functional as F

from ._triton import HAVE_TRITON, load_row_add_residual, norm_buffers, tl, triton


def layer_norm_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                     eps: float) -> torch.Tensor:
    # x: [N, H] -> [N, H]; statistics and affine in float32, one rounding at the end
    # (what nn.LayerNorm does on the GPU for half-precision inputs)
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    y = F.layer_norm(x.float(), x.shape[-1:], weight.float(), bias.float(), eps)
    return y.to(out_dtype)


def add_layer_norm_torch(x, residual, weight, bias, eps):
    """h = x + residual; returns (layer_norm(h) * weight + bias, h)."""
    h = x + residual
    return layer_norm_torch(h, weight, bias, eps), h


if HAVE_TRITON:

    @triton.jit
    def _layer_norm_kernel(
        x_ptr, r_ptr, w_ptr, b_ptr, out_ptr, h_ptr,
        stride_x, stride_r, stride_out, stride_h,
        H, eps,
        HAS_RESIDUAL: tl.constexpr, BLOCK_H: tl.constexpr,
    ):
        # One program per row; the whole row [BLOCK_H] lives in registers.
        row = tl.program_id(0).to(tl.int64)  # int64: row * stride may exceed 2**31
        cols = tl.arange(0, BLOCK_H)
        mask = cols < H
        x = load_row_add_residual(x_ptr, r_ptr, h_ptr, row, stride_x, stride_r, stride_h,
                                  cols, mask, HAS_RESIDUAL)
        xf = x.to(tl.float32)
        # IEEE division: the GPU's default fast `/` can leave a constant row's mean an ulp
        # off, which rstd (~1/sqrt(eps) there) would blow up
        mean = tl.div_rn(tl.sum(xf, axis=0), H * 1.0)
        xc = tl.where(mask, xf - mean, 0.0)  # padding lanes must not enter the variance
        var = tl.sum(xc * xc, axis=0) / H
        rstd = 1.0 / tl.sqrt(var + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_out + cols,
                 (xc * rstd * w + b).to(out_ptr.dtype.element_ty), mask=mask)


def _num_warps(block: int) -> int:
    # enough threads to keep ~8-16 elements per thread on wide rows
    return 4 if block < 2048 else 8 if block < 8192 else 16


def _launch(x, residual, weight, bias, eps):
    assert x.dim() == 2, f"x must be [N, H], got shape {tuple(x.shape)}"
    n, h = x.shape
    for name, p in (("weight", weight), ("bias", bias)):
        assert p.shape == (h,), f"{name} must be [{h}], got {tuple(p.shape)}"
        assert p.device == x.device, f"x on {x.device} but {name} on {p.device}"
        assert p.is_floating_point(), f"{name} must be floating point, got {p.dtype}"
        assert h <= 1 or p.stride(0) == 1, f"{name} must be contiguous"
    assert x.is_floating_point(), f"x must be floating point, got {x.dtype}"
    assert h <= 1 or x.stride(1) == 1, f"x must be contiguous in its last dim, strides {x.stride()}"
    out, hbuf, r, block = norm_buffers(x, residual, weight)
    if n == 0 or h == 0:
        return out, hbuf
    _layer_norm_kernel[(n,)](
        x, r, weight, bias, out, hbuf,
        x.stride(0), r.stride(0), out.stride(0), hbuf.stride(0),
        h, float(eps),
        HAS_RESIDUAL=residual is not None, BLOCK_H=block, num_warps=_num_warps(block),
    )
    return out, hbuf


def layer_norm_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                      eps: float) -> torch.Tensor:
    # x: [N, H] (rows any stride, last dim contiguous), weight, bias: [H] -> new [N, H]
    return _launch(x, None, weight, bias, eps)[0]


def add_layer_norm_triton(x, residual, weight, bias, eps):
    """h = x + residual; returns (layer_norm(h) * weight + bias, h), both new tensors."""
    return _launch(x, residual, weight, bias, eps)
