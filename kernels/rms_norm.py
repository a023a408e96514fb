"""RMSNorm, optionally fused with the residual add (LLaMA-style pre-norm)."""
import torch

from ._triton import HAVE_TRITON, next_pow2, tl, triton


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [N, H] -> [N, H]; statistics in float32, like HF's LlamaRMSNorm
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm_torch(x, residual, weight, eps):
    """h = x + residual; returns (rms_norm(h) * weight, h)."""
    h = x + residual
    return rms_norm_torch(h, weight, eps), h
