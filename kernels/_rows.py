"""The rows a weight-only GEMM launcher works on: x [..., K] as a row-major [M, K] view (a
copy only where its last dim is strided) and the output [M, N] it fills."""
import torch


def gemm_rows(x: torch.Tensor, k: int, n: int) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """(x2 [M, K] with unit column stride, y [M, N] empty in x's dtype, x's leading dims):
    the launcher returns ``y.reshape(*lead, n)``."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if k > 1 and x2.stride(1) != 1:
        x2 = x2.contiguous()
    return x2, torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device), lead
