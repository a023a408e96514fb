"""The LM head: hidden states [n, H] x the vocabulary's rows [V, H] -> logits [n, V].

One wide GEMM, which cuBLAS streams at the copy rate on CUDA; the reference is the
projections' linear (on the CPU: ``cpu_linear``'s row blocks or oneDNN).
"""
import torch
import torch.nn.functional as F

from .linear import linear_torch


def lm_head_torch(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # x: [n, H], weight: [V, H] -> [n, V]: the projections' linear
    return linear_torch(x, weight)


def lm_head_triton(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """cuBLAS: one wide GEMM, which it streams at the copy rate."""
    return F.linear(x, weight)
