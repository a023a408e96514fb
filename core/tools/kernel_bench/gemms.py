"""Kernel micro-benchmarks on CUDA: ``python -m infergraft.core.tools.kernel_bench.gemms``.

Reports achieved bandwidth against a measured device copy, for the decode GEMMs of a
LLaMA-2-7B-shaped layer (cuBLAS vs the skinny Triton GEMM over a config sweep), and the
per-kernel cost inside a CUDA graph. ``--split 1,32,64`` sweeps split-K (o, down) and the
unsplit kernel (qkv, gate_up) at those row counts against cuBLAS. ``--fused``: the fused
decode GEMMs (norm, SwiGLU, residual inside) against the kernels they replace.
``--int8``: the int8 weight-only GEMM against bf16, with a tile sweep; ``--fused --int8``:
the fused decode GEMMs on int8 weights; ``--int8 --prefill-paths``: the int8 prefill paths.
"""
from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from infergraft.kernels._triton import next_pow2

LLAMA7B_GEMMS = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096),
                 "down": (4096, 11008), "lm_head": (32000, 4096)}


def graph_time(fn, replays: int = 20, inner: int = 10) -> float:
    """Median seconds of one ``fn()`` call, captured ``inner`` times into a CUDA graph."""
    from infergraft.core.runner.cuda_graph import capture_graph

    def calls():
        for _ in range(inner):
            fn()
    g, _ = capture_graph(calls)  # after warm-up runs, like the engine's graphs
    times = [t / inner for t in replay_times(g, replays)]
    return sorted(times)[len(times) // 2]


def replay_times(graph, replays: int) -> list[float]:
    """Seconds of each of ``replays`` replays of a captured graph (CUDA events)."""
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return times


def sweep_linear(ms, dtype=torch.bfloat16, sweep=True):
    from infergraft.core.tools.bench import copy_bandwidth

    from infergraft.kernels.linear import linear_triton, skinny_config

    bw = copy_bandwidth("cuda")  # the same roofline as `infergraft bench`
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


def sweep_split(ms, dtype=torch.bfloat16) -> None:
    """Split-K partials (``linear_partials``) for the projections an add+RMSNorm follows,
    against cuBLAS and the unsplit skinny kernel: the best (S, tiles) per (GEMM, M)."""
    from infergraft.kernels.linear import skinny_gemm
    from infergraft.kernels.linear_partials import linear_partials_triton, split_config

    for name in ("o", "down", "qkv", "gate_up"):  # the last two: unsplit only (no norm follows)
        n, k = LLAMA7B_GEMMS[name]
        splits = (1, 2, 4, 8) if name in ("o", "down") else (1,)
        ws = [torch.randn(n, k, device="cuda", dtype=dtype) for _ in range(4)]
        nbytes = n * k * ws[0].element_size()
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            tb = lambda fn: nbytes / graph_time(fn, replays=5) / 1e12  # noqa: E731
            it = itertools.cycle(ws)
            line = (f"{name:7s} M={m:3d}  cuBLAS {tb(lambda: F.linear(x, next(it))):5.2f}  "
                    f"default {tb(lambda: linear_partials_triton(x, next(it))):5.2f} TB/s "
                    f"{split_config(m, n, k)}")
            best = (0, None)
            for sk, bn, bk, ns in itertools.product(splits, (32, 64, 128), (64, 128, 256), (3, 4)):
                cfg = dict(BLOCK_M=max(16, next_pow2(m)), BLOCK_N=bn, BLOCK_K=bk,
                           num_warps=4, num_stages=ns)
                try:
                    bw = tb(lambda: skinny_gemm(x, next(it), config=cfg, split_k=sk))
                except Exception:  # out of shared memory etc.
                    continue
                best = max(best, (bw, (sk, cfg)), key=lambda b: b[0])
            print(f"{line}  best {best[0]:5.2f} TB/s S={best[1][0]} {best[1][1]}", flush=True)
        del ws


def _tiles_str(cfg: dict) -> str:
    # BLOCK_N x BLOCK_K x stages / warps, e.g. 32x512x4/4w (+ swap)
    return (f"{cfg['BLOCK_N']}x{cfg['BLOCK_K']}x{cfg['num_stages']}/{cfg['num_warps']}w"
            f"{' swap' if cfg.get('SWAP') else ''}")


def _tile_times(call, tiles) -> list:
    """(seconds, config) of ``call(config)`` for each config that runs (others run out of
    shared memory and the like)."""
    out = []
    for cfg in tiles:
        try:
            out.append((graph_time(lambda: call(cfg), replays=5), cfg))
        except Exception:
            continue
    return out


def sweep_fused(m: int = 1, dtype=torch.bfloat16, int8: bool = False) -> None:
    """The fused decode GEMMs (kernels/fused_linear.py) against the kernel chains of the
    plain layer they replace (TB/s of weights; the chains' time counts all their kernels),
    with a small tile sweep. ``int8``: int8 weights with row scales on both sides (the
    plain chain's GEMM is then ``int8_linear``)."""
    from infergraft.kernels import fused_linear as FL
    from infergraft.kernels.int8_linear import int8_linear_triton, quantize_int8
    from infergraft.kernels.linear import linear_triton
    from infergraft.kernels.rms_norm import add_rms_norm_triton, rms_norm_triton
    from infergraft.kernels.silu_mul import silu_mul_triton

    dev = "cuda"
    x, xi = (torch.randn(m, k, device=dev, dtype=dtype) for k in (4096, 11008))
    g = torch.rand(4096, device=dev, dtype=dtype) + 0.5
    ss = x.float().square().sum(-1)[None].repeat(128, 1) / 128  # [P, M] partials
    tiles = [dict(BLOCK_M=max(16, next_pow2(m)), BLOCK_N=bn, BLOCK_K=bk,
                  num_warps=nw, num_stages=ns)
             for bn, bk, ns, nw in itertools.product((32, 64), (64, 128, 256, 512), (3, 4), (4, 8))]
    if not int8 and m > 1:  # y^T = W x^T tiles (wgmma), as the defaults take at 2-32 rows
        tiles += [dict(BLOCK_M=max(16, next_pow2(m)), BLOCK_N=bn, BLOCK_K=bk, num_warps=4,
                       num_stages=ns, SWAP=True)
                  for bn, bk, ns in itertools.product((64, 128), (64, 128, 256), (3, 4, 5))]

    def mm(a, w):  # the plain chain's GEMM; w = (weight, scale or None)
        return linear_triton(a, w[0]) if w[1] is None else int8_linear_triton(a, *w)
    cases = [  # name, weights, fused call (w, config), the plain layer's kernels (w)
        ("qkv normed", "qkv",
         lambda w, c: FL.normed_linear_triton(x, w[0], None, ss, 1e-6, w[1], config=c),
         lambda w: mm(rms_norm_triton(x, g, 1e-6), w)),
        ("gate_up normed+silu", "gate_up",
         lambda w, c: FL.normed_swiglu_triton(x, w[0], None, ss, 1e-6, w[1], config=c),
         lambda w: silu_mul_triton(mm(rms_norm_triton(x, g, 1e-6), w))),
        ("o+residual+sumsq", "o",
         lambda w, c: FL.linear_residual_triton(x, w[0], None, x, True, w[1], config=c),
         lambda w: add_rms_norm_triton(mm(x, w), x, g, 1e-6)),
        ("down+residual+sumsq", "down",
         lambda w, c: FL.linear_residual_triton(xi, w[0], None, x, True, w[1], config=c),
         lambda w: add_rms_norm_triton(mm(xi, w), x, g, 1e-6)),
    ]
    for name, gemm, fused, plain in cases:
        n, k = LLAMA7B_GEMMS[gemm]
        ws = [torch.randn(n, k, device=dev, dtype=dtype) / k ** 0.5 for _ in range(4)]
        ws = [quantize_int8(w) if int8 else (w, None) for w in ws]
        nbytes = n * k * ws[0][0].element_size() + (4 * n if int8 else 0)
        it = itertools.cycle(ws)
        tf = graph_time(lambda: fused(next(it), None))
        tp = graph_time(lambda: plain(next(it)))
        line = (f"{name:20s} M={m}  fused {tf * 1e6:5.1f} us ({nbytes / tf / 1e12:4.2f} TB/s)  "
                f"plain {tp * 1e6:5.1f} us ({nbytes / tp / 1e12:4.2f} TB/s)")
        top = sorted(_tile_times(lambda c: fused(next(it), c), tiles), key=lambda b: b[0])[:3]
        print(line + "  best " + "; ".join(
            f"{nbytes / t / 1e12:4.2f} {_tiles_str(c)}" for t, c in top), flush=True)
        del ws


def _tile_name(seconds: float, cfg: dict) -> str:
    return f"{seconds * 1e6:.1f} us {cfg['BLOCK_M']}x{_tiles_str(cfg)}"


def sweep_int8(ms) -> None:
    """The int8 weight-only GEMM (kernels/int8_linear.py) against the bf16 skinny GEMM on
    the same shapes: TB/s of the bytes each reads, with a tile sweep."""
    from infergraft.kernels.int8_linear import int8_linear_triton, quantize_int8
    from infergraft.kernels.linear import linear_triton

    def tiles(m):
        if m > 64:  # prefill: unswapped square tiles, and W as the MMA's register operand
            return [dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)] + [
                dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=ns, SWAP=True)
                for bm, bn, bk, nw, ns in itertools.product((64, 128, 256), (128, 256), (64, 128),
                                                            (4, 8), (3, 4))
                if not (bn == 256 and nw == 4)]
        return [dict(BLOCK_M=max(16, next_pow2(m)), BLOCK_N=bn, BLOCK_K=bk,
                     num_warps=4, num_stages=ns)
                for bn, bk, ns in itertools.product((32, 64), (128, 256, 512), (3, 4))]
    for name, (n, k) in LLAMA7B_GEMMS.items():
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(4)]
        packed = [quantize_int8(w) for w in ws]
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            it, itq = itertools.cycle(ws), itertools.cycle(packed)
            t16 = graph_time(lambda: linear_triton(x, next(it)))
            t8 = graph_time(lambda: int8_linear_triton(x, *next(itq)))
            ranked = sorted(_tile_times(lambda c: int8_linear_triton(x, *next(itq), config=c),
                                        tiles(m)), key=lambda b: b[0])
            print(f"{name:8s} M={m:2d}  bf16 {t16 * 1e6:6.1f} us "
                  f"({2 * n * k / t16 / 1e12:4.2f} TB/s)"
                  f"  int8 {t8 * 1e6:6.1f} us ({n * k / t8 / 1e12:4.2f} TB/s)  best "
                  f"{', '.join(_tile_name(t, c) for t, c in ranked[:4])}", flush=True)
        del ws, packed


def int8_prefill_paths(ms) -> None:
    """The three int8 prefill paths against bf16 cuBLAS per LLaMA-7B GEMM: the kernel with
    W as the MMA's register operand (SWAP), unswapped, and cuBLAS on the widened weight
    (``int8_linear.DEQUANT_MIN_ROWS`` picks the last)."""
    from infergraft.kernels import int8_linear as IL

    unswapped = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)
    for name, (n, k) in LLAMA7B_GEMMS.items():
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(2)]
        packed = [IL.quantize_int8(w) for w in ws]
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            it, itq = itertools.cycle(ws), itertools.cycle(packed)
            us = lambda fn: graph_time(fn, replays=5) * 1e6  # noqa: E731
            swap = dict(IL.int8_config(min(m, 1023), n, k), SWAP=True)
            t16 = us(lambda: F.linear(x, next(it)))
            t_swap = us(lambda: IL.int8_linear_triton(x, *next(itq), config=swap))
            t_plain = us(lambda: IL.int8_linear_triton(x, *next(itq), config=unswapped))
            widened = lambda q, s: F.linear(x, q * s.to(x.dtype)[:, None])  # noqa: E731
            t_wide = us(lambda: widened(*next(itq)))
            print(f"{name:8s} M={m:4d}  bf16 cuBLAS {t16:7.1f} us  int8 SWAP {t_swap:7.1f}  "
                  f"unswapped {t_plain:7.1f}  widened + cuBLAS {t_wide:7.1f}", flush=True)
        del ws, packed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--m", default=None, help="rows (default 1,8,32,64; --fused: 1)")
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--split", default=None, help="e.g. 1,8,32: split-K sweep for o and down")
    p.add_argument("--fused", action="store_true", help="fused decode GEMMs vs unfused")
    p.add_argument("--int8", action="store_true",
                   help="int8 weight-only GEMM vs bf16 (with --fused: the fused GEMMs on int8)")
    p.add_argument("--prefill-paths", action="store_true",
                   help="with --int8: SWAP / unswapped / widened + cuBLAS at prefill rows")
    a = p.parse_args(argv)
    kernel_gap()
    if a.fused:  # with --int8: the fused GEMMs on int8 weights
        for m in (a.m or "1").split(","):
            sweep_fused(int(m), int8=a.int8)
        return 0
    if a.int8 and a.prefill_paths:
        int8_prefill_paths([int(m) for m in (a.m or "512,1024,2048,4096").split(",")])
        return 0
    if a.int8:
        sweep_int8([int(m) for m in (a.m or "1,8,32").split(",")])
        return 0
    if a.split:
        sweep_split([int(m) for m in a.split.split(",")])
        return 0
    sweep_linear([int(m) for m in (a.m or "1,8,32,64").split(",")], sweep=not a.no_sweep)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
