"""SiLU(gate) * up on the fused gate_up projection output."""
import torch
import torch.nn.functional as F

from ._triton import HAVE_TRITON, next_pow2, tl, triton


def silu_mul_torch(x: torch.Tensor) -> torch.Tensor:
    # x: [T, 2I] (gate | up) -> [T, I]
    i = x.shape[-1] // 2
    return F.silu(x[..., :i]) * x[..., i:]
