"""SiLU(gate) * up on the fused gate_up projection output."""
import torch
import torch.nn.functional as F

from ._triton import HAVE_TRITON, pdl_enter, pdl_launch, row_chunk_launch, tl, triton


def silu_mul_torch(x: torch.Tensor) -> torch.Tensor:
    # x: [T, 2I] (gate | up) -> [T, I]
    i = x.shape[-1] // 2
    return F.silu(x[..., :i]) * x[..., i:]


if HAVE_TRITON:

    @triton.jit
    def gate_up_rows(x_ptr, stride_x, I, BLOCK: tl.constexpr):
        """This program's chunk of a gated activation's row: (row, cols, mask, gate, up)."""
        # grid (T, cdiv(I, BLOCK)): wide MLPs (I ~ 14k) split a row over several programs
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)            # [BLOCK]
        mask = cols < I
        gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        up = tl.load(x_ptr + row * stride_x + I + cols, mask=mask, other=0.0)
        return row, cols, mask, gate, up

    @triton.jit
    def store_gated(out_ptr, stride_out, row, cols, mask, act, gate, up):
        """act(gate) * up stored: act rounded to the input dtype before the product, as
        F.silu(..) * up (or F.gelu) does."""
        act = act.to(gate.dtype).to(tl.float32)
        tl.store(out_ptr + row * stride_out + cols,
                 (act * up.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, I, BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl_enter(PDL)
        row, cols, mask, gate, up = gate_up_rows(x_ptr, stride_x, I, BLOCK)
        g = gate.to(tl.float32)
        store_gated(out_ptr, stride_out, row, cols, mask, g * tl.sigmoid(g), gate, up)


def launch_gated(kernel, x: torch.Tensor, **constexprs) -> torch.Tensor:
    """x: [T, 2I] (gate | up; rows any stride, last dim contiguous) -> new [T, I], by
    ``kernel`` (a gated activation's: x, out, their row strides, I, its ``constexprs``)."""
    assert x.dim() == 2, f"x must be [T, 2I], got shape {tuple(x.shape)}"
    t, two_i = x.shape
    assert two_i % 2 == 0, f"last dim must be even (gate | up), got {two_i}"
    assert x.is_floating_point(), f"x must be floating point, got {x.dtype}"
    assert two_i == 0 or x.stride(1) == 1, f"x must be contiguous in its last dim, strides {x.stride()}"
    i = two_i // 2
    out = torch.empty((t, i), dtype=x.dtype, device=x.device)
    if t == 0 or i == 0:
        return out
    grid, meta = row_chunk_launch(t, i)
    kernel[grid](x, out, x.stride(0), out.stride(0), i, **constexprs, **meta,
                 **pdl_launch(x.device))
    return out


def silu_mul_triton(x: torch.Tensor) -> torch.Tensor:
    return launch_gated(_silu_mul_kernel, x)
