"""GELU on the (ungated) MLP's fc_in output: tanh approximation (GPT-2's ``gelu_new``)
or the exact erf form."""
import torch
import torch.nn.functional as F

from ._triton import HAVE_TRITON, row_chunk_launch, tl, triton

#: ModelSpec.activation -> F.gelu's ``approximate``
APPROXIMATIONS = {"gelu_tanh": "tanh", "gelu": "none"}


def _approximate(approximate: str) -> str:
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"unknown GELU variant {approximate!r}; choose one of "
                         f"{', '.join(APPROXIMATIONS)}")
    return APPROXIMATIONS[approximate]


def gelu_torch(x: torch.Tensor, approximate: str = "gelu_tanh") -> torch.Tensor:
    # x: [T, I] -> [T, I]; computed in float32, one rounding (as F.gelu does on the GPU)
    return F.gelu(x.float(), approximate=_approximate(approximate)).to(x.dtype)


if HAVE_TRITON:

    @triton.jit
    def _gelu_kernel(x_ptr, out_ptr, stride_x, stride_out, I,
                     TANH: tl.constexpr, BLOCK: tl.constexpr):
        # grid (T, cdiv(I, BLOCK)): wide MLPs (I ~ 10k) split a row over several programs
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)            # [BLOCK]
        mask = cols < I
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        if TANH:
            # 0.5 * (1 + tanh(u)) == sigmoid(2u): no tanh needed, saturates cleanly
            u = 0.7978845608028654 * (x + 0.044715 * x * x * x)  # sqrt(2/pi) * (...)
            # the clamp keeps exp() finite; sigmoid saturates long before |2u| = 80
            y = x * tl.sigmoid(tl.minimum(tl.maximum(2.0 * u, -80.0), 80.0))
        else:
            y = 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))  # x / sqrt(2)
        tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def gelu_triton(x: torch.Tensor, approximate: str = "gelu_tanh") -> torch.Tensor:
    # x: [T, I] (rows any stride, last dim contiguous) -> new [T, I]
    tanh = _approximate(approximate) == "tanh"
    assert x.dim() == 2, f"x must be [T, I], got shape {tuple(x.shape)}"
    assert x.is_floating_point(), f"x must be floating point, got {x.dtype}"
    t, i = x.shape
    assert i <= 1 or x.stride(1) == 1, f"x must be contiguous in its last dim, strides {x.stride()}"
    out = torch.empty((t, i), dtype=x.dtype, device=x.device)
    if t == 0 or i == 0:
        return out
    grid, meta = row_chunk_launch(t, i)
    _gelu_kernel[grid](x, out, x.stride(0), out.stride(0), i, TANH=tanh, **meta)
    return out
