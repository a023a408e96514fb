"""float32 linear on the CPU: row blocks over the threads at a few rows, oneDNN above.

torch's float32 ``F.linear`` is MKL's GEMM. At a few rows it reads the weight on one
thread, well below what the cores stream together. Cut into row blocks and handed to one
batched GEMM, the blocks run on the intra-op threads. From 5 rows on, oneDNN's GEMM (the
op inductor uses on the CPU, on the same dense weight) is the faster of the two, and
faster than MKL's (docs/kernels.md has the figures). Each output is the same K-long float32 dot product summed in another order (about 1e-6
relative to MKL's). ``int8_linear_cpu`` feeds int8 rows into it, widened chunk by chunk.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

MAX_BLOCK_ROWS = 4  # row blocks up to here, oneDNN above (the faster on each side)
MIN_BLOCK_ROWS = 64  # smaller blocks cost more in batching than their threads gain


def blocks(n_out: int) -> int:
    """Row blocks for an [n_out, K] weight: two per intra-op thread, of at least
    MIN_BLOCK_ROWS rows (1 = no split)."""
    threads = torch.get_num_threads()
    t = min(2 * threads, n_out // MIN_BLOCK_ROWS)
    return t if threads >= 2 and t >= 2 else 1


@functools.cache
def onednn_available() -> bool:
    """oneDNN's linear runs here (x86 builds; not every platform's torch has it)."""
    try:
        x, w = torch.ones(1, 8), torch.ones(4, 8)
        return torch.backends.mkldnn.is_available() and bool(
            (torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "") == 8).all())
    except (AttributeError, RuntimeError):
        return False


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """float32 on the CPU with a contiguous [N, K] weight: one of the two paths below."""
    return x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32 \
        and weight.dim() == 2 and weight.is_contiguous() and x.numel() > 0


def linear_cpu(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """``F.linear``: row blocks at <= MAX_BLOCK_ROWS rows (where they split), oneDNN above,
    ``F.linear`` itself where neither applies."""
    if not applies(x, weight):
        return F.linear(x, weight, bias)
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    m, t = x2.shape[0], blocks(n)
    if m > MAX_BLOCK_ROWS or t == 1:
        if not (torch.backends.mkldnn.enabled and onednn_available()):  # honour the switch
            return F.linear(x, weight, bias)
        y = torch.ops.mkldnn._linear_pointwise(x2.contiguous(), weight, bias, "none", [], "")
        return y.reshape(*x.shape[:-1], n)
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


INT8_CHUNK_BYTES = 4 << 20  # widened int8 rows per GEMM: a chunk that stays in cache


def int8_linear_cpu(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                    bias=None) -> torch.Tensor:
    """(x q^T) * s (+ b) in float32, as ``int8_linear_torch``: the int8 rows widened a
    cache-sized chunk at a time (the whole weight widened at once is 4x its bytes
    written to memory and read back; a chunk stays in cache)."""
    n, k = qweight.shape
    x2 = x.reshape(-1, k).float()
    rows = max(MIN_BLOCK_ROWS, INT8_CHUNK_BYTES // (4 * max(1, k)))
    y = torch.empty((x2.shape[0], n), dtype=torch.float32)
    for r0 in range(0, n, rows):  # [M, K] x [rows, K]^T -> [M, rows]
        y[:, r0:r0 + rows] = linear_cpu(x2, qweight[r0:r0 + rows].float())
    y *= scale
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], n)
