"""int4 weight-only GEMMs (W4A16) on CUDA: ``python -m infergraft.core.tools.kernel_bench.int4``.

For each LLaMA-2-7B decoder GEMM (``gemms.LLAMA7B_GEMMS`` less the lm_head, which stays
bf16) and row count (``--rows``): the time inside a CUDA graph (``gemms.graph_time``,
weight copies rotated past L2) of the default int4 path, of the kernel it replaced
(``old_int4_linear``, kept here), of bf16 cuBLAS, and of each path at that row count
(gemv up to ``int4_gemv.MAX_ROWS`` rows, tiles, widen from 64 rows); the int4 bytes'
roofline at the measured copy bandwidth and the GB/s reached. Then one decoder layer's
sum per row count, times ``--layers``: the expected GEMM time a token at one row.

``--sweep``: GEMV configs at one row (BLOCK_N 4..128, BLOCK_K 128..1024, SPLIT 1..8, 2 /
4 / 8 warps), its best again at the other GEMV rows, tile / widen configs at every row
count; the best per shape and row count (one that fails to compile or launch is skipped
and counted). ``--json OUT``: every figure, with provenance. ``--smoke``: tiny shapes on
the CPU interpreter (host timing), to check that it runs."""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

from infergraft.kernels import int4_gemv as IG
from infergraft.kernels import int4_linear as IL
from infergraft.kernels._triton import interpreting, next_pow2, tl, triton
from .gemms import LLAMA7B_GEMMS, graph_time

SHAPES = {name: LLAMA7B_GEMMS[name] for name in ("qkv", "o", "gate_up", "down")}
SMOKE_SHAPES = {"qkv": (48, 64), "o": (16, 64), "gate_up": (80, 64), "down": (16, 96)}
ROTATE_BYTES = 128 << 20  # weight copies a graph cycles through: past the H200's L2
# from 64 rows: BLOCK_M, BLOCK_N, BLOCK_K, warps, SWAP, XSPLIT
PREFILL_TILES = ((64, 128, 64, 4, False, True), (64, 128, 128, 4, False, True),
                 (64, 128, 64, 4, False, False), (128, 128, 64, 8, True, False),
                 (128, 128, 64, 8, False, True), (64, 256, 64, 8, False, True),
                 (128, 256, 64, 8, True, False), (128, 64, 64, 4, False, True))


@triton.jit
def _old_int4_kernel(x_ptr, q_ptr, s_ptr, z_ptr, y_ptr, M, N, K, G, stride_xm, stride_qn,
                     stride_ym, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # the kernel int4_linear.py had before the GEMV: every byte read for both its
    # columns (cols // 2), one tl.dot of x padded to 16 rows, no bias
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mmask, nmask = rm < M, rn < N
    shift = ((rk % 2) * 4)[None, :]
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + rk
        kmask = cols < K
        x = tl.load(x_ptr + rm[:, None] * stride_xm + cols[None, :],
                    mask=mmask[:, None] & kmask[None, :], other=0.0)            # [BM, BK]
        b = tl.load(q_ptr + rn[:, None] * stride_qn + (cols // 2)[None, :],
                    mask=nmask[:, None] & kmask[None, :], other=0)              # [BN, BK]
        z = tl.load(z_ptr + rn * G + k0 // GROUP, mask=nmask, other=0)
        s = tl.load(s_ptr + rn * G + k0 // GROUP, mask=nmask, other=0.0)
        w = (((b.to(tl.int32) >> shift) & 0xF) - z.to(tl.int32)[:, None]).to(x.dtype)
        acc += tl.dot(x, tl.trans(w)) * s[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


def old_int4_linear(x, qweight, scales, zeros, group_size, k):
    """The replaced kernel with the tiles its ``int4_config`` chose (x: 16-bit [M, K])."""
    m, n = x.shape[0], qweight.shape[0]
    if m <= 64:
        bm, bn, bk, w = max(16, next_pow2(m)), 32 if n < 8192 else 64, min(group_size, 128), 4
    else:
        bm, bn, bk, w = 128 if m >= 256 else 64, 128, min(group_size, 64), 8
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _old_int4_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        x, qweight, scales, zeros, y, m, n, k, scales.shape[1], x.stride(0),
        qweight.stride(0), y.stride(0), GROUP=group_size, BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_K=bk, num_warps=w, num_stages=3)
    return y


def int4_bytes(n: int, k: int, group_size: int, m: int, elem: int = 2) -> int:
    """What an int4 GEMM must move: nibbles, scales and zero-points, x and y."""
    g = -(-k // group_size)
    return n * -(-k // 2) + 5 * n * g + elem * m * (k + n)


def gemv_grid(n: int, k: int, small: bool = False) -> list[dict]:
    """The one-row sweep: BLOCK_N x BLOCK_K x warps with 32..128 bytes a thread, each
    with the splits that leave at most 8 programs an SM and 2 K tiles a split."""
    out = []
    for bn, bk, w in itertools.product((4, 8, 16, 32, 64, 128), (128, 256, 512, 1024), (2, 4, 8)):
        if not 32 <= bn * bk // 2 // (32 * w) <= 128:
            continue
        for split in (1, 2, 4, 8):
            if split == 1 or (-(-n // bn) * split <= 8 * IG.SMS and -(-k // bk) >= 2 * split):
                out.append(dict(PATH="gemv", BLOCK_N=bn, BLOCK_K=bk, SPLIT=split,
                                num_warps=w, num_stages=1, EARLY=True))
    return out[:3] if small else out


def tile_grid(m: int, n: int, k: int, group_size: int, small: bool = False) -> list[dict]:
    """Tensor-core tiles for M rows (and, from 64 rows, the widened weight's)."""
    bks = [b for b in (64, 128) if group_size % b == 0] or [group_size]
    out = []
    if m <= 64:
        for bn, bk, swap in itertools.product((64, 128), bks, (False, True)):
            auto = IG.split_for(-(-n // bn), -(-k // bk), max_split=8, min_tiles=2)
            for split in sorted({1, auto, 2 * auto}):
                out.append(dict(PATH="tiles", BLOCK_M=max(16, next_pow2(m)), BLOCK_N=bn,
                                BLOCK_K=bk, SPLIT=split, SWAP=swap, XSPLIT=True,
                                num_warps=4, num_stages=3))
    else:
        for bm, bn, bk, w, swap, xs in PREFILL_TILES:
            out.append(dict(PATH="tiles", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=min(bk, bks[-1]),
                            SPLIT=1, SWAP=swap, XSPLIT=xs, num_warps=w, num_stages=3))
        out += [dict(PATH="widen", BLOCK_N=bn, num_warps=w)
                for bn, w in ((16, 4), (32, 4), (64, 8))]
    return out[:2] if small else out


def cfg_str(cfg: dict) -> str:
    if cfg["PATH"] == "gemv":
        return f"gemv {cfg['BLOCK_N']}x{cfg['BLOCK_K']} S{cfg['SPLIT']} {cfg['num_warps']}w"
    if cfg["PATH"] == "widen":
        return f"widen {cfg['BLOCK_N']} {cfg['num_warps']}w"
    return (f"tiles {cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']} S{cfg.get('SPLIT', 1)} "
            f"{cfg['num_warps']}w{cfg['num_stages']}s{' swap' if cfg.get('SWAP') else ''}"
            f"{' xsplit' if cfg.get('XSPLIT') else ''}")


class Timer:
    """Seconds of one call: inside a CUDA graph on CUDA, one host-timed call elsewhere."""

    def __init__(self, device: str, replays: int = 20):
        self.cuda, self.replays = device == "cuda", replays

    def __call__(self, fn, replays=None) -> float:
        if self.cuda:
            return graph_time(fn, replays=replays or self.replays)
        fn()
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    def attempt(self, fn, skipped: list, what: str, replays=None):
        try:
            return self(fn, replays)
        except Exception as e:  # out of shared memory, a config the kernel refuses, ...
            first = str(e).splitlines()[0][:120] if str(e) else ""
            skipped.append(f"{what}: {type(e).__name__}: {first}")
            return None


def sweep(name, m, configs, call, timer, nbytes, skipped) -> list:
    """(seconds, config) of each config that runs, fastest first; prints the best three."""
    ranked = sorted(((t, c) for c in configs
                     if (t := timer.attempt(lambda: call(c), skipped, cfg_str(c), replays=5))
                     is not None), key=lambda r: r[0])
    best = "; ".join(f"{t * 1e6:.1f} us {nbytes / t / 1e9:.0f} GB/s {cfg_str(c)}"
                     for t, c in ranked[:3])
    print(f"  sweep {name:8s} M={m:4d} {len(ranked)}/{len(configs)} ran: {best}", flush=True)
    return ranked


def bench_shape(name, n, k, args, dev, timer, bw, sweeping, small, best_gemv) -> list[dict]:
    gs, dt = args.group, getattr(torch, args.dtype)
    w = torch.randn(n, k, device=dev) / k ** 0.5
    copies = lambda nbytes, most: min(most, max(2, -(-ROTATE_BYTES // nbytes)))  # noqa: E731
    packed = [IL.quantize_int4(w * (1 + i / 64), gs)
              for i in range(copies(int4_bytes(n, k, gs, 1), 16))]
    packed = [(p.qweight, p.scales, p.zeros) for p in packed]
    dense = [w.to(dt) for _ in range(copies(2 * n * k, 8))]
    out = []
    for m in args.rows:
        x = torch.randn(m, k, device=dev, dtype=dt)
        it, itd, skipped = itertools.cycle(packed), itertools.cycle(dense), []
        call = lambda c: IL.int4_linear_triton(x, *next(it), gs, k, config=c)  # noqa: E731
        nbytes = int4_bytes(n, k, gs, m)
        cfg = IL.int4_config(m, n, k, gs)
        r = dict(shape=name, n=n, k=k, m=m, bytes=nbytes, config=cfg, roofline_s=nbytes / bw,
                 default_s=timer.attempt(lambda: call(None), skipped, "default"),
                 old_s=timer.attempt(lambda: old_int4_linear(x, *next(it), gs, k), skipped, "old"),
                 bf16_s=timer.attempt(lambda: F.linear(x, next(itd)), skipped, "bf16"), paths={})
        paths = {"gemv": IG.gemv_config(m, n, k, gs)} if m <= IG.MAX_ROWS else {}
        paths["tiles"] = IL.tiles_config(m, n, k, gs)
        if m >= 64:
            paths["widen"] = dict(PATH="widen", BLOCK_N=32, num_warps=4)
        for path, c in paths.items():
            r["paths"][path] = timer.attempt(lambda: call(c), skipped, path)
        us = lambda t: "  fail" if t is None else f"{t * 1e6:6.1f}"  # noqa: E731
        gbps = nbytes / r["default_s"] / 1e9 if r["default_s"] else 0.0
        print(f"{name:8s} M={m:4d}  int4 {us(r['default_s'])} us "
              f"({gbps:5.0f} GB/s, {cfg_str(cfg)})  old {us(r['old_s'])}"
              f"  bf16 {us(r['bf16_s'])}  roofline {us(r['roofline_s'])}  | "
              + "  ".join(f"{p} {us(t)}" for p, t in r["paths"].items()), flush=True)
        if sweeping:
            grid = tile_grid(m, n, k, gs, small)
            if m == 1:
                grid = gemv_grid(n, k, small) + grid
            elif m <= IG.MAX_ROWS:  # the one-row winners, with their splits
                grid = [dict(c, SPLIT=s) for c in best_gemv.get(name, []) for s in (1, 2, 4)] + grid
            ranked = sweep(name, m, grid, call, timer, nbytes, skipped)
            if m == 1:  # the four fastest GEMV tiles, whatever their split
                tops = {}
                for _, c in (r for r in ranked if r[1]["PATH"] == "gemv"):
                    tops.setdefault((c["BLOCK_N"], c["BLOCK_K"], c["num_warps"]), dict(c, SPLIT=1))
                best_gemv[name] = list(tops.values())[:4]
            r["sweep"] = [dict(s=t, config=c) for t, c in ranked[:8]]
        if skipped:
            print(f"  {name} M={m}: {len(skipped)} skipped, e.g. {skipped[0]}", flush=True)
        r["skipped"] = skipped
        out.append(r)
    return out


def layer_totals(results, rows, layers) -> dict:
    """Per row count: one layer's GEMMs summed (default, old, bf16, roofline), x layers."""
    totals = {}
    for m in rows:
        rs = [r for r in results if r["m"] == m]
        t = {key: sum(r[key] or 0.0 for r in rs)
             for key in ("default_s", "old_s", "bf16_s", "roofline_s")}
        totals[m] = t
        us = {key[:-2]: f"{v * 1e6:8.1f}" for key, v in t.items()}
        ms = {key[:-2]: f"{v * layers * 1e3:.3f}" for key, v in t.items()}
        print(f"layer M={m:4d}: int4 {us['default']} us  old {us['old']}  bf16 {us['bf16']}  "
              f"roofline {us['roofline']}  -> x{layers}: int4 {ms['default']} ms, old "
              f"{ms['old']}, bf16 {ms['bf16']}, roofline {ms['roofline']}", flush=True)
    return totals


def sweep_summary(results, layers) -> None:
    """The sweep's best per shape and row count against the default, and a layer's sum
    (times ``layers``) if each GEMM took its best."""
    print("sweep's best (default -> best):")
    for m in sorted({r["m"] for r in results}):
        rs = [r for r in results if r["m"] == m and r.get("sweep")]
        for r in rs:
            t, c = r["sweep"][0]["s"], r["sweep"][0]["config"]
            print(f"  {r['shape']:8s} M={m:4d}  {(r['default_s'] or 0) * 1e6:7.1f} -> "
                  f"{t * 1e6:7.1f} us ({r['bytes'] / t / 1e9:5.0f} GB/s)  {cfg_str(c)}  {c}")
        if rs:
            best = sum(min(r["default_s"] or 1.0, r["sweep"][0]["s"]) for r in rs)
            print(f"  layer    M={m:4d}  best {best * 1e6:7.1f} us -> x{layers}: "
                  f"{best * layers * 1e3:.3f} ms", flush=True)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default=None, help="row counts (default 1,2,4,8,16,32,512)")
    p.add_argument("--shapes", default=",".join(SHAPES), help="of qkv,o,gate_up,down")
    p.add_argument("--group", type=int, default=128, choices=IL.GROUP_SIZES)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--sweep", action="store_true", help="time config grids, print the best")
    p.add_argument("--json", default=None, help="write every figure to this file")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, CPU interpreter")
    a = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    if a.smoke and not cuda and not interpreting():  # Triton reads it at import
        os.execve(sys.executable, [sys.executable, "-m", __spec__.name, *argv],
                  dict(os.environ, TRITON_INTERPRET="1"))
    if not cuda and not a.smoke:
        p.error("needs CUDA (or --smoke for the CPU interpreter)")
    from infergraft.core.tools.bench import copy_bandwidth
    from infergraft.core.tools.provenance import provenance

    dev = "cuda" if cuda else "cpu"
    shapes = SMOKE_SHAPES if a.smoke else SHAPES
    shapes = {s: shapes[s] for s in a.shapes.split(",")}
    a.rows = [int(m) for m in (a.rows or ("1,2,17" if a.smoke else "1,2,4,8,16,32,512")).split(",")]
    if a.smoke:
        a.group, a.dtype = 32, "float16"
    bw = copy_bandwidth(dev, nbytes=1 << 22, repeats=2) if a.smoke else copy_bandwidth(dev)
    print(f"{dev} copy bandwidth {bw / 1e9:.0f} GB/s; group {a.group}, {a.dtype}; "
          f"GEMV_MAX_ROWS {IL.GEMV_MAX_ROWS}, WIDEN_MIN_ROWS {IL.WIDEN_MIN_ROWS}", flush=True)
    timer, best_gemv, results = Timer(dev), {}, []
    t0 = time.time()
    for name, (n, k) in shapes.items():
        results += bench_shape(name, n, k, a, dev, timer, bw, a.sweep, a.smoke, best_gemv)
    totals = layer_totals(results, a.rows, a.layers)
    if a.sweep:
        sweep_summary(results, a.layers)
    print(f"done in {time.time() - t0:.0f} s", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(provenance=provenance(), device=dev, copy_bandwidth=bw, group=a.group,
                           dtype=a.dtype, rows=a.rows, results=results, layer=totals),
                      f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
