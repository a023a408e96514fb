"""Rotary position embedding (rotate-half layout, as HF LLaMA/Mistral/Qwen2)."""
import torch

from ._triton import HAVE_TRITON, next_pow2, tl, triton


def rotary_torch(q, k, cos, sin, positions):
    """q: [T, Hq, D], k: [T, Hkv, D]; cos/sin: [P, R/2] float32; positions: [T].

    Rotates the first R dims of every head (R = 2 * cos.shape[1] <= D); returns new
    (q, k) in the input dtype.
    """
    half = cos.shape[1]
    c = cos[positions].unsqueeze(1)  # [T, 1, R/2]
    s = sin[positions].unsqueeze(1)

    def rot(x):
        xf = x.float()
        x1, x2, rest = xf[..., :half], xf[..., half:2 * half], xf[..., 2 * half:]
        out = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], dim=-1)
        return out.to(x.dtype)

    return rot(q), rot(k)
