"""GELU(gate) * up on the fused gate_up projection output: the GELU-gated MLP (Gemma's
``gelu_pytorch_tanh``: the tanh approximation; ``gelu``: the exact erf form)."""
import torch
import torch.nn.functional as F

from ._triton import HAVE_TRITON, pdl_enter, tl, triton
from .gelu import _approximate
from .silu_mul import launch_gated

if HAVE_TRITON:
    from .silu_mul import gate_up_rows, store_gated


def gelu_mul_torch(x: torch.Tensor, approximate: str = "gelu_tanh") -> torch.Tensor:
    # x: [T, 2I] (gate | up) -> [T, I]; HF's act_fn(gate_proj(x)) * up_proj(x)
    i = x.shape[-1] // 2
    return F.gelu(x[..., :i], approximate=_approximate(approximate)) * x[..., i:]


if HAVE_TRITON:

    @triton.jit
    def _gelu_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, I, TANH: tl.constexpr,
                         BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl_enter(PDL)
        row, cols, mask, gate, up = gate_up_rows(x_ptr, stride_x, I, BLOCK)
        g = gate.to(tl.float32)
        if TANH:
            # 0.5 * (1 + tanh(u)) == sigmoid(2u), clamped so that exp() stays finite
            u = 0.7978845608028654 * (g + 0.044715 * g * g * g)  # sqrt(2/pi) * (...)
            act = g * tl.sigmoid(tl.minimum(tl.maximum(2.0 * u, -80.0), 80.0))
        else:
            act = 0.5 * g * (1.0 + tl.erf(g * 0.7071067811865476))  # g / sqrt(2)
        store_gated(out_ptr, stride_out, row, cols, mask, act, gate, up)


def gelu_mul_triton(x: torch.Tensor, approximate: str = "gelu_tanh") -> torch.Tensor:
    tanh = _approximate(approximate) == "tanh"
    return launch_gated(_gelu_mul_kernel, x, TANH=tanh)
