"""What a plain read reaches, against the copy roofline and our one-row GEMVs (CUDA):
``python -m infergraft.core.tools.kernel_bench.read``.

A Triton kernel that only reads (each program sums ITERS blocks of BLOCK contiguous
elements) streams a 2 GiB buffer, then buffers the size of each LLaMA-7B decode GEMM's
weight (each timed as a graph of 10 calls over 4 copies, as ``gemms.graph_time``),
then the batch-1 GEMV (``gemv.py``'s loop) on those shapes: how far each GEMV is from
what a read alone reaches. docs/kernels.md has what it printed.
"""
from __future__ import annotations

import itertools

import torch

from infergraft.kernels._triton import tl, triton
from .gemms import LLAMA7B_GEMMS, graph_time

READ_TILES = ((8192, 8, 8), (8192, 2, 8), (4096, 16, 4), (4096, 4, 4))  # BLOCK, ITERS, warps


@triton.jit
def _read_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    # one program: ITERS contiguous blocks of BLOCK elements, summed (so the loads stay)
    pid = tl.program_id(0)
    acc = tl.full((BLOCK,), 0.0, tl.float32)
    base = pid.to(tl.int64) * BLOCK * ITERS
    for i in range(ITERS):
        acc += tl.load(x_ptr + base + i * BLOCK + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc))


def read_bandwidth(nbytes: int, copies: int = 4) -> list[tuple[float, tuple]]:
    """(bytes per second, (BLOCK, ITERS, warps)) of the read kernel over ``nbytes`` of
    bf16 (rounded down to whole programs), for each tile of READ_TILES."""
    quantum = max(b * i for b, i, _ in READ_TILES)
    n = nbytes // 2 // quantum * quantum
    bufs = [torch.randn(n, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    it = itertools.cycle(bufs)
    out = []
    for block, iters, warps in READ_TILES:
        progs = n // (block * iters)
        sums = torch.empty(progs, device="cuda")
        t = graph_time(lambda: _read_kernel[(progs,)](next(it), sums, BLOCK=block, ITERS=iters,
                                                        num_warps=warps), replays=9)
        out.append((2 * n / t, (block, iters, warps)))
    return out


def main() -> int:
    from infergraft.core.tools.bench import copy_bandwidth

    from infergraft.kernels.linear import skinny_config, skinny_gemm

    print(f"copy (read + written) {copy_bandwidth('cuda') / 1e12:.3f} TB/s", flush=True)
    best = max(read_bandwidth(2 ** 31, copies=1))
    print(f"read 2 GiB: {best[0] / 1e12:.3f} TB/s (BLOCK, ITERS, warps = {best[1]})", flush=True)
    for name, (n, k) in LLAMA7B_GEMMS.items():
        best = max(read_bandwidth(n * k * 2))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        it = itertools.cycle(ws)
        t = graph_time(lambda: skinny_gemm(x, next(it), config=skinny_config(1, n, k)))
        print(f"{name:8s} {n * k * 2 / 1e6:6.1f} MB: read {best[0] / 1e12:.3f} TB/s, "
              f"batch-1 GEMV {n * k * 2 / t / 1e12:.3f} TB/s ({t * 1e6:.1f} us)", flush=True)
        del ws
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
