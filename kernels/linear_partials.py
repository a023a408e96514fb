"""Split-K for the projections an add+RMSNorm follows (``linear_partials``): narrow outputs
(N = hidden, the o and down projections) give too few column tiles to keep every SM
streaming, so the K axis is split over S programs too and each writes float32 partial sums
[S, M, N] (``linear.skinny_gemm(split_k=)``). No reduce kernel: the add+RMSNorm that
follows sums the partials as it loads them.
"""
import torch

from ._triton import next_pow2
from .cpu_linear import linear_cpu
from .linear import MAX_ROWS, linear_triton, skinny_gemm


def split_config(m: int, n: int, k: int) -> tuple[int, dict] | None:
    """(S, tiles) for ``linear_partials``, or None where one unsplit GEMM is as fast (the
    module docstring says why). Tiles from ``python -m infergraft.core.tools.kernel_bench.gemms
    --split 1,32,64``; docs/kernels.md has the figures."""
    if n > 8192:  # wide outputs already fill the GPU with column tiles
        return None
    if m <= 16:
        # the GEMM alone gains, but the norm after it, reading S float32 rows, loses as
        # much: the decode step is no faster
        return None
    block_m = max(16, next_pow2(m))
    if k <= 4096:
        return 2, dict(BLOCK_M=block_m, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=4)
    return 4, dict(BLOCK_M=block_m, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=4)


def linear_partials_torch(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """The reference never splits: [M, N] (consumers accept [M, N] or [S, M, N])."""
    return linear_cpu(x, weight, bias)


def linear_partials_triton(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """x W^T (+ b) as float32 partials [S, M, N] where split-K pays, else as ``linear``.
    Only for outputs consumed by ``add_rms_norm`` (which sums the partials)."""
    m, k = x.shape
    plan = split_config(m, weight.shape[0], k) if x.dtype != torch.float32 else None
    if plan is None or not 0 < m <= MAX_ROWS:
        return linear_triton(x, weight, bias)
    return skinny_gemm(x, weight, bias, plan[1], split_k=plan[0])
