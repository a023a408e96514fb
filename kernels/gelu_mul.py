"""GELU(gate) * up on the fused gate_up projection output: the GELU-gated MLP (Gemma's
``gelu_pytorch_tanh``: the tanh approximation; ``gelu``: the exact erf form)."""
import torch
import torch.nn.functional as F

from ._triton import HAVE_TRITON, pdl_enter, tl, triton
from .gelu import _approximate
from .silu_mul import launch_gated


def gelu_mul_torch(x: torch.Tensor, approximate: str = "gelu_tanh") -> torch.Tensor:
    # x: [T, 2I] (gate | up) -> [T, I]; HF's act_fn(gate_proj(x)) * up_proj(x)
    i = x.shape[-1] // 2
    return F.gelu(x[..., :i], approximate=_approximate(approximate)) * x[..., i:]


if HAVE_TRITON:

    @triton.jit
    def _gelu_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, I, TANH: tl.constexpr,
                         BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl_enter(PDL)
        # grid (T, cdiv(I, BLOCK)): wide MLPs (I ~ 14k) split a row over several programs
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)            # [BLOCK]
        mask = cols < I
        gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        up = tl.load(x_ptr + row * stride_x + I + cols, mask=mask, other=0.0)
        g = gate.to(tl.float32)
        if TANH:
            # 0.5 * (1 + tanh(u)) == sigmoid(2u), clamped so that exp() stays finite
            u = 0.7978845608028654 * (g + 0.044715 * g * g * g)  # sqrt(2/pi) * (...)
            act = g * tl.sigmoid(tl.minimum(tl.maximum(2.0 * u, -80.0), 80.0))
        else:
            act = 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))  # g / sqrt(2)
        # round gelu(gate) to the input dtype before the product, as F.gelu(..) * up does
        act = act.to(gate.dtype).to(tl.float32)
        tl.store(out_ptr + row * stride_out + cols,
                 (act * up.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


def gelu_mul_triton(x: torch.Tensor, approximate: str = "gelu_tanh") -> torch.Tensor:
    tanh = _approximate(approximate) == "tanh"
    return launch_gated(_gelu_mul_kernel, x, TANH=tanh)
