"""Kernel micro-benchmarks on CUDA: ``python -m infergraft.kernels.benchmarks``.

Reports achieved bandwidth against a measured device copy, for the decode GEMMs of a
LLaMA-2-7B-shaped layer (cuBLAS vs the skinny Triton GEMM over a config sweep), and the
per-kernel cost inside a CUDA graph. ``--fused`` instead times the GEMMs with the norm /
SiLU*mul prologue and residual epilogue folded in against the unfused kernel chains.
"""
from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

LLAMA7B_GEMMS = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096),
                 "down": (4096, 11008), "lm_head": (32000, 4096)}


def graph_time(fn, replays: int = 20, inner: int = 10) -> float:
    """Median seconds of one ``fn()`` call, captured ``inner`` times into a CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(inner):
            fn()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / inner)
    return sorted(times)[len(times) // 2]


def copy_bw() -> float:
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    return 2 * x.numel() / graph_time(lambda: y.copy_(x), inner=3)


def sweep_linear(ms, dtype=torch.bfloat16, sweep=True):
    from .linear import linear_triton, skinny_config

    bw = copy_bw()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    # several weight copies so consecutive calls do not hit L2
    for name, (n, k) in LLAMA7B_GEMMS.items():
        ws = [torch.randn(n, k, device="cuda", dtype=dtype) for _ in range(4)]
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            nbytes = n * k * x.element_size()
            it = itertools.cycle(ws)
            t_cublas = graph_time(lambda: F.linear(x, next(it)))
            it = itertools.cycle(ws)
            t_def = graph_time(lambda: linear_triton(x, next(it)))
            ref = F.linear(x, ws[0]).float()
            err = (linear_triton(x, ws[0]).float() - ref).norm() / ref.norm()
            line = (f"{name:8s} M={m:3d}  cuBLAS {nbytes / t_cublas / 1e12:5.2f} TB/s  "
                    f"triton(default {skinny_config(m, n, k)['BLOCK_N']}x"
                    f"{skinny_config(m, n, k)['BLOCK_K']}) {nbytes / t_def / 1e12:5.2f} TB/s "
                    f"err {err:.1e}")
            if sweep and m == 1:
                best = (0, None)
                for bn, bk, nw, ns in itertools.product((16, 32, 64), (128, 256, 512), (4, 8), (3, 4)):
                    cfg = dict(BLOCK_M=max(16, m), BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=ns)
                    try:
                        it = itertools.cycle(ws)
                        t = graph_time(lambda: linear_triton(x, next(it), config=cfg), replays=5)
                    except Exception:  # out of shared memory etc.
                        continue
                    if nbytes / t > best[0]:
                        best = (nbytes / t, cfg)
                line += f"  best {best[0] / 1e12:5.2f} TB/s {best[1]}"
            print(line, flush=True)
        del ws


def kernel_gap() -> None:
    """Cost of one tiny kernel inside a graph: the per-kernel overhead decode pays."""
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    t = graph_time(lambda: x.add_(1), inner=200)
    print(f"tiny kernel in a CUDA graph: {t * 1e6:.2f} us each")


def bench_fused(ms=(1, 8), dtype=torch.bfloat16, eps=1e-6) -> None:
    """fused_linear vs the kernels it replaces, per decode GEMM, inside a CUDA graph."""
    from .fused_linear import fused_linear_triton
    from .linear import linear_triton
    from .rms_norm import rms_norm_triton
    from .silu_mul import silu_mul_triton

    # GEMM, norm, swiglu, residual as the fused decoder layer calls them
    cases = [("qkv", True, False, False), ("gate_up", True, True, False),
             ("down", False, False, True), ("o", False, False, True)]
    for name, norm, swiglu, res in cases:
        n, k = LLAMA7B_GEMMS[name]
        # several weight copies so consecutive calls do not hit L2 (o is 32 MB)
        ws = [torch.randn(n, k, device="cuda", dtype=dtype) / k ** 0.5 for _ in range(4)]
        nw = torch.ones(k, device="cuda", dtype=dtype)  # folded into W: the same maths
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            r = torch.randn(m, n, device="cuda", dtype=dtype) if res else None
            kw = dict(rms_eps=eps if norm else None, swiglu=swiglu, residual=r)

            def fused(w, config=None):
                return fused_linear_triton(x, w, **kw, config=config)

            def chain(w):  # the launches the fused kernel replaces
                y = linear_triton(rms_norm_triton(x, nw, eps) if norm else x, w)
                y = silu_mul_triton(y) if swiglu else y
                return y if r is None else y + r

            nbytes = n * k * ws[0].element_size()
            it = itertools.cycle(ws)
            t_fused = graph_time(lambda: fused(next(it)))
            it = itertools.cycle(ws)
            t_chain = graph_time(lambda: chain(next(it)))
            ref = chain(ws[0]).float()
            err = (fused(ws[0]).float() - ref).norm() / ref.norm()
            what = "+".join(p for p, on in (("norm", norm), ("swiglu", swiglu), ("residual", res)) if on)
            best = (0.0, None)
            for bn, bk, ns in itertools.product((16, 32, 64), (128, 256), (3, 4)):
                cfg = dict(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, num_warps=4, num_stages=ns)
                try:
                    it = itertools.cycle(ws)
                    t = graph_time(lambda: fused(next(it), cfg), replays=5)
                except Exception:  # out of shared memory etc.
                    continue
                best = max(best, (nbytes / t, cfg), key=lambda b: b[0])
            what += f" (best {best[0] / 1e12:.2f} TB/s at N{best[1]['BLOCK_N']}K{best[1]['BLOCK_K']}s{best[1]['num_stages']})"
            print(f"{name:8s} {what:15s} M={m:2d}  fused {t_fused * 1e6:6.1f} us "
                  f"{nbytes / t_fused / 1e12:5.2f} TB/s  unfused {t_chain * 1e6:6.1f} us "
                  f"{nbytes / t_chain / 1e12:5.2f} TB/s  saved {(t_chain - t_fused) * 1e6:5.1f} us  "
                  f"err {err:.1e}", flush=True)
        del ws


def sweep_wide(ms, dtype=torch.bfloat16) -> None:
    """The skinny kernel beyond its dispatch limit (M > MAX_SKINNY_M) against cuBLAS."""
    from . import linear

    limit, linear.MAX_SKINNY_M = linear.MAX_SKINNY_M, max(ms)
    try:
        for name, (n, k) in LLAMA7B_GEMMS.items():
            ws = [torch.randn(n, k, device="cuda", dtype=dtype) for _ in range(4)]
            nbytes = n * k * ws[0].element_size()
            for m in ms:
                x = torch.randn(m, k, device="cuda", dtype=dtype)
                it = itertools.cycle(ws)
                line = f"{name:8s} M={m:3d}  cuBLAS {nbytes / graph_time(lambda: F.linear(x, next(it))) / 1e12:5.2f} TB/s"
                best = (0, None)
                for bn, bk, ns in itertools.product((32, 64), (64, 128), (3, 4)):
                    cfg = dict(BLOCK_M=m, BLOCK_N=bn, BLOCK_K=bk, num_warps=4, num_stages=ns)
                    try:
                        it = itertools.cycle(ws)
                        t = graph_time(lambda: linear.skinny_gemm(x, next(it), config=cfg), replays=5)
                    except Exception:  # out of shared memory etc.
                        continue
                    best = max(best, (nbytes / t, cfg), key=lambda b: b[0])
                print(f"{line}  skinny best {best[0] / 1e12:5.2f} TB/s {best[1]}", flush=True)
            del ws
    finally:
        linear.MAX_SKINNY_M = limit


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--m", default="1,8,32,64")
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--fused", action="store_true",
                   help="only the fused norm/SiLU/residual GEMMs vs unfused, at M=1 and 8 (--m ignored)")
    p.add_argument("--wide", default=None, help="e.g. 32,64: the skinny kernel above its limit")
    a = p.parse_args(argv)
    kernel_gap()
    if a.wide:
        sweep_wide([int(m) for m in a.wide.split(",")])
        return 0
    if a.fused:
        bench_fused()
        return 0
    sweep_linear([int(m) for m in a.m.split(",")], sweep=not a.no_sweep)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
