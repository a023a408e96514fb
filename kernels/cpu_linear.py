"""Few-row float32 linear on the CPU, the weight's row blocks spread over the threads.

At decode (a few rows) MKL's float32 GEMM reads the weight on one thread: SmolLM2's
113 MB LM head takes 7.1 ms on one thread and 7.3 on two, ~15 GB/s where two cores
stream ~50. Cut into row blocks and handed to one batched GEMM, the blocks run on the
intra-op threads: 1.7-2.5 ms (``docs/BENCHMARKS.md``, CPU). Each output is the same
K-long float32 dot product; only which thread computes it changes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

MAX_ROWS = 8  # from 16 rows on MKL's own threading is as fast (measured, 2 cores)


MIN_BLOCK_ROWS = 64  # smaller blocks cost more in batching than their threads gain


def blocks(n_out: int) -> int:
    """Row blocks for an [n_out, K] weight: two per intra-op thread, of at least
    MIN_BLOCK_ROWS rows (1 = no split)."""
    threads = torch.get_num_threads()
    t = min(2 * threads, n_out // MIN_BLOCK_ROWS)
    return t if threads >= 2 and t >= 2 else 1


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    rows = x.numel() // max(1, x.shape[-1])
    return x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32 \
        and 0 < rows <= MAX_ROWS and weight.dim() == 2 and weight.is_contiguous() \
        and blocks(weight.shape[0]) > 1


def linear_cpu(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """``F.linear`` for float32 x with few rows (``applies``), else ``F.linear`` itself."""
    if not applies(x, weight):
        return F.linear(x, weight, bias)
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    m, t = x2.shape[0], blocks(n)
    main = n - n % t
    # weight rows [t, main / t, K] x x^T [t, K, M] -> [t, main / t, M] -> [M, main]
    y = torch.bmm(weight[:main].view(t, main // t, k), x2.t().expand(t, k, m))
    y = y.reshape(main, m).t()
    if main < n:  # the last n % t rows
        y = torch.cat([y, F.linear(x2, weight[main:])], dim=1)
    y = y.contiguous()
    if bias is not None:
        y += bias
    return y.reshape(*x.shape[:-1], n)
