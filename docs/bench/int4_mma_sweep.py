"""int4-g128 decode GEMMs: ``kernels/int4_mma.py`` beside the shipped paths, on CUDA.

    python3 docs/bench/int4_mma_sweep.py [--rows 1,8,16,32,64] [--quick]

For each LLaMA-2-7B decoder GEMM and row count: the time inside a CUDA graph (weight copies
rotated past L2) of bf16 cuBLAS, the shipped int4 path (``int4_config``), and the
tensor-core kernel with its nibbles by inline assembly over a few tiles at 1 and 32 rows
(and once by shifts and converts: what the assembly saves); each against the int4 bytes' copy roofline
(packed weight + scales + zero-points); the relative error of each new arm against
``int4_linear_torch``. Last, one layer's four GEMMs summed, x 32 layers.
"""
from __future__ import annotations

import argparse
import itertools
import sys

import torch
import torch.nn.functional as F

from infergraft.core.tools.bench import copy_bandwidth
from infergraft.kernels.bench.gemms import LLAMA7B_GEMMS, graph_time
from infergraft.kernels.int4_linear import int4_linear_torch, int4_linear_triton, quantize_int4
from infergraft.kernels.int4_mma import int4_mma, mma_config

SHAPES = {name: LLAMA7B_GEMMS[name] for name in ("qkv", "o", "gate_up", "down")}
ROTATE_BYTES = 192 << 20  # past the H100's / H200's 50 MB L2
SWEEP_ROWS = (1, 32)  # row counts whose tiles are swept


def arms(m: int, n: int, k: int, quick: bool):
    base = mma_config(m, n, k)
    yield "mma", dict(base), True
    if quick or m not in SWEEP_ROWS:
        return
    yield "mma-noasm", dict(base), False
    for bn, warps, stages, f in itertools.product((64, 128), (4,), (2, 3, 4), (1, 2)):
        split = max(1, base["SPLIT"] * f)
        cfg = dict(base, BLOCK_N=bn, num_warps=warps, num_stages=stages, SPLIT=split)
        if cfg != base:
            yield f"mma {bn}x{warps}w{stages}s S{split}", cfg, True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,8,16,32,64")
    p.add_argument("--quick", action="store_true", help="the default tiles only")
    args = p.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    bw = copy_bandwidth("cuda")
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s", flush=True)
    layer = {}  # (m, arm) -> seconds summed over the four GEMMs
    for name, (n, k) in SHAPES.items():
        w16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        packed = quantize_int4(w16, 128)
        int4_bytes = sum(t.numel() * t.element_size()
                         for t in (packed.qweight, packed.scales, packed.zeros))
        copies = max(2, ROTATE_BYTES // int4_bytes)
        ps = [quantize_int4(torch.randn_like(w16) / k ** 0.5, 128) for _ in range(copies - 1)]
        ps.append(packed)
        ws = [w16] + [torch.randn_like(w16) for _ in range(max(1, ROTATE_BYTES // w16.nbytes))]
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = int4_linear_torch(x, packed.qweight, packed.scales, packed.zeros, 128, k).float()
            roof = int4_bytes / bw
            it = itertools.cycle(ws)
            t16 = graph_time(lambda: F.linear(x, next(it)))
            it = itertools.cycle(ps)
            tdef = graph_time(lambda: (lambda q: int4_linear_triton(
                x, q.qweight, q.scales, q.zeros, 128, k))(next(it)))
            line = [f"{name:8s} M={m:3d} roof {roof * 1e6:6.1f} us  bf16 {t16 * 1e6:6.1f}  "
                    f"shipped {tdef * 1e6:6.1f} ({roof / tdef:4.0%})"]
            for key, t in (("bf16", t16), ("shipped", tdef)):
                layer[(m, key)] = layer.get((m, key), 0.0) + t
            best = None
            for label, cfg, asm in arms(m, n, k, args.quick):
                try:
                    out = int4_mma(x, packed.qweight, packed.scales, packed.zeros, 128, k,
                                   config=cfg, asm=asm)
                    err = ((out.float() - ref).norm() / ref.norm()).item()
                    it = itertools.cycle(ps)
                    t = graph_time(lambda: (lambda q: int4_mma(
                        x, q.qweight, q.scales, q.zeros, 128, k, config=cfg, asm=asm))(next(it)))
                except Exception as e:  # out of resources, a compile error
                    print(f"    {label}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                    continue
                if label in ("mma", "mma-noasm"):
                    line.append(f"{label} {t * 1e6:6.1f} ({roof / t:4.0%}, err {err:.1e})")
                    layer[(m, label)] = layer.get((m, label), 0.0) + t
                if asm and (best is None or t < best[0]):
                    best = (t, label, err)
            if best:
                line.append(f"best {best[1]} {best[0] * 1e6:6.1f} ({roof / best[0]:4.0%}, "
                            f"err {best[2]:.1e})")
                layer[(m, "best")] = layer.get((m, "best"), 0.0) + best[0]
            print("  ".join(line), flush=True)
        del ps, ws
        torch.cuda.empty_cache()
    print("one layer's four GEMMs x 32 layers, ms:")
    for m in rows:
        cells = [f"{key} {layer[(m, key)] * 32e3:6.3f}" for key in
                 ("bf16", "shipped", "mma", "mma-noasm", "best") if (m, key) in layer]
        print(f"  M={m:3d}  " + "  ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
