"""Quantised decode GEMMs on the tensor cores (``kernels/int4_mma.py``, ``fp8_mma.py``:
e4m3 and int8 rows) beside the shipped paths, on CUDA:

    python3 docs/bench/quant_mma_sweep.py [--formats int4,fp8,int8] [--rows 1,16,32] [--quick]
    python3 docs/bench/quant_mma_sweep.py --fused [--formats fp8,int8] [--rows 1,32]

For each format, LLaMA-2-7B decoder GEMM and row count: the time inside a CUDA graph
(weight copies rotated past L2) of bf16 cuBLAS, the shipped path (``int4_linear_triton`` /
``fp8_linear_triton`` / ``int8_linear_triton``: what ``INFERGRAFT_QUANT_MMA=0`` runs in the
plain layer), and the new kernel (what ``=1`` runs) with its widening by inline assembly
over a few tiles at 1 and 32 rows (and once by Triton's shifts and converts: what the
assembly saves); each against the format's bytes' copy roofline (int4: packed weight +
scales + zero-points; 8-bit: bytes + row scales); the relative error of each new arm
against the format's torch reference. Last, one layer's four GEMMs summed, x 32 layers.

These launchers are what the engine runs for int4 (which has no fused layer) and for 8-bit
rows above 32 rows. At <= 32 rows e4m3 and int8 rows run the fused decode layer's GEMMs
instead (``kernels/fused_linear.py``: norm, SwiGLU, residual, RoPE + K/V write in their
epilogues); ``--fused`` times those, each on its shipped tiles (``mma=False``: what
``INFERGRAFT_QUANT_MMA=0`` and ``auto`` run) and on WORDS (``mma=True``: ``=1``: the same
programs, W read as words and widened by bit tricks; one int8 row: both the word loop),
with LLaMA-2-7B's heads (docs/bench/quant-mma.md says why the two sweeps disagree).
"""
from __future__ import annotations

import argparse
import itertools
import sys

import torch
import torch.nn.functional as F

from infergraft.core.tools.bench import copy_bandwidth
from infergraft.core.tools.kernel_bench.gemms import LLAMA7B_GEMMS, graph_time
from infergraft.kernels.fp8_linear import fp8_linear_torch, fp8_linear_triton, quantize_fp8
from infergraft.kernels.fp8_mma import fp8_mma, fp8_mma_config, int8_mma
from infergraft.kernels.int4_linear import int4_linear_torch, int4_linear_triton, quantize_int4
from infergraft.kernels.int4_mma import int4_mma, mma_config
from infergraft.kernels.int8_linear import int8_linear_torch, int8_linear_triton, quantize_int8

SHAPES = {name: LLAMA7B_GEMMS[name] for name in ("qkv", "o", "gate_up", "down")}
ROTATE_BYTES = 192 << 20  # past the H100's / H200's 50 MB L2
SWEEP_ROWS = (1, 32)  # row counts whose tiles are swept


class Int4:
    name = "int4"
    config = staticmethod(mma_config)

    @staticmethod
    def pack(w):
        p = quantize_int4(w, 128)
        return (p.qweight, p.scales, p.zeros)

    @staticmethod
    def ref(x, t, k):
        return int4_linear_torch(x, *t, 128, k)

    @staticmethod
    def shipped(x, t, k):
        return int4_linear_triton(x, *t, 128, k)

    @staticmethod
    def new(x, t, k, cfg, asm):
        return int4_mma(x, *t, 128, k, config=cfg, asm=asm)


class Fp8:
    name = "fp8"
    config = staticmethod(fp8_mma_config)

    @staticmethod
    def pack(w):
        return quantize_fp8(w)

    @staticmethod
    def ref(x, t, k):
        return fp8_linear_torch(x, *t)

    @staticmethod
    def shipped(x, t, k):
        return fp8_linear_triton(x, *t)

    @staticmethod
    def new(x, t, k, cfg, asm):
        return fp8_mma(x, *t, config=cfg, asm=asm)


class Int8(Fp8):
    name = "int8"

    @staticmethod
    def pack(w):
        return quantize_int8(w)

    @staticmethod
    def ref(x, t, k):
        return int8_linear_torch(x.float(), *t).to(x.dtype)

    @staticmethod
    def shipped(x, t, k):
        return int8_linear_triton(x, *t)

    @staticmethod
    def new(x, t, k, cfg, asm):
        return int8_mma(x, *t, config=cfg, asm=asm)


FORMATS = {"int4": Int4, "fp8": Fp8, "int8": Int8}


def arms(fmt, m: int, n: int, k: int, quick: bool):
    base = fmt.config(m, n, k)
    yield "mma", dict(base), True
    if quick or m not in SWEEP_ROWS:
        return
    yield "mma-noasm", dict(base), False
    for bn, warps, stages, f in itertools.product((64, 128), (4,), (3, 4), (1, 2)):
        split = max(1, base["SPLIT"] * f)
        cfg = dict(base, BLOCK_N=bn, num_warps=warps, num_stages=stages, SPLIT=split)
        if cfg != base:
            yield f"mma {bn}x{warps}w{stages}s S{split}", cfg, True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--formats", default="int4,fp8,int8")
    p.add_argument("--rows", default="1,16,32")
    p.add_argument("--quick", action="store_true", help="the default tiles only")
    p.add_argument("--fused", action="store_true",
                   help="the fused decode layer's GEMMs on 8-bit rows (fp8, int8): byte "
                        "tiles vs the same tiles read as words (WORDS)")
    args = p.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    bw = copy_bandwidth("cuda")
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s", flush=True)
    if args.fused:
        for name in args.formats.split(","):
            assert name in ("fp8", "int8"), f"--fused takes fp8 and int8 (8-bit rows), not {name}"
            run_fused(FORMATS[name], rows, bw)
        return 0
    for fmt in (FORMATS[f] for f in args.formats.split(",")):
        layer = {}  # (m, arm) -> seconds summed over the four GEMMs
        for name, (n, k) in SHAPES.items():
            run_shape(fmt, name, n, k, rows, bw, args.quick, layer)
        print(f"{fmt.name}: one layer's four GEMMs x 32 layers, ms:")
        for m in rows:
            cells = [f"{key} {layer[(m, key)] * 32e3:6.3f}" for key in
                     ("bf16", "shipped", "mma", "mma-noasm", "best") if (m, key) in layer]
            print(f"  M={m:3d}  " + "  ".join(cells), flush=True)
    return 0


def run_shape(fmt, name, n, k, rows, bw, quick, layer) -> None:
    w16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    packed = fmt.pack(w16)
    nbytes = sum(t.numel() * t.element_size() for t in packed)
    ps = [packed] + [fmt.pack(torch.randn_like(w16) / k ** 0.5)
                     for _ in range(max(1, ROTATE_BYTES // nbytes))]
    ws = [w16] + [torch.randn_like(w16) for _ in range(max(1, ROTATE_BYTES // w16.nbytes))]
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = fmt.ref(x, packed, k).float()
        roof = nbytes / bw
        it = itertools.cycle(ws)
        t16 = graph_time(lambda: F.linear(x, next(it)))
        it = itertools.cycle(ps)
        tdef = graph_time(lambda: fmt.shipped(x, next(it), k))
        line = [f"{fmt.name} {name:8s} M={m:3d} roof {roof * 1e6:6.1f} us  bf16 "
                f"{t16 * 1e6:6.1f}  shipped {tdef * 1e6:6.1f} ({roof / tdef:4.0%})"]
        for key, t in (("bf16", t16), ("shipped", tdef)):
            layer[(m, key)] = layer.get((m, key), 0.0) + t
        best = None
        for label, cfg, asm in arms(fmt, m, n, k, quick):
            try:
                out = fmt.new(x, packed, k, cfg, asm)
                err = ((out.float() - ref).norm() / ref.norm()).item()
                it = itertools.cycle(ps)
                t = graph_time(lambda: fmt.new(x, next(it), k, cfg, asm))
            except Exception as e:  # out of resources, a compile error
                print(f"    {label}: {type(e).__name__}: {str(e)[:300]}", flush=True)
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


def fused_cases(m: int):
    """(name, weight rows N, K, call(w, scale, mma)) for the fused layer's four GEMMs at M
    rows (bf16 x; the norm's statistic as 128 partial sums, as the o / down GEMMs leave it)."""
    from infergraft.kernels import fused_linear as FL

    heads, d, hidden, inter = 32, 128, 4096, 11008
    x = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)
    xi = torch.randn(m, inter, device="cuda", dtype=torch.bfloat16)
    ss = x.float().square().sum(-1)[None].repeat(128, 1) / 128                  # [P, M]
    freqs = torch.outer(torch.arange(4096.0), 1e4 ** (-torch.arange(0, d, 2) / d)).cuda()
    cos, sin = freqs.cos(), freqs.sin()                                         # [4096, D/2]
    caches = [torch.zeros((-(-m // 16), 16, heads, d), device="cuda", dtype=torch.bfloat16)
              for _ in range(2)]
    slots = torch.arange(m, device="cuda")
    pos = slots + 512
    return [
        ("qkv+rope", 3 * hidden, hidden, lambda w, s, mma: FL.normed_qkv_rope_triton(
            x, w, None, ss, 1e-5, cos, sin, pos, heads, *caches, slots // 16, slots % 16, s,
            mma=mma)),
        ("o+res", hidden, hidden, lambda w, s, mma: FL.linear_residual_triton(
            x, w, None, x, True, scale=s, mma=mma)),
        ("gate_up+silu", 2 * inter, hidden, lambda w, s, mma: FL.normed_swiglu_triton(
            x, w, None, ss, 1e-5, scale=s, mma=mma)),
        ("down+res", hidden, inter, lambda w, s, mma: FL.linear_residual_triton(
            xi, w, None, x, True, scale=s, mma=mma)),
    ]


def run_fused(fmt, rows, bw) -> None:
    """``--fused``: each fused GEMM on the shipped tiles, bytes and words, against the
    8-bit bytes' roofline; then one layer's four summed, x 32 layers."""
    layer = {}  # (m, arm) -> seconds summed over the four GEMMs
    for m in rows:
        for name, n, k, call in fused_cases(m):
            packed = [fmt.pack(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5)
                      for _ in range(max(2, ROTATE_BYTES // (n * k)))]
            roof = (n * k + 4 * n) / bw
            line = [f"{fmt.name} fused {name:12s} M={m:3d} roof {roof * 1e6:6.1f} us"]
            for arm, mma in (("shipped", False), ("words", True)):
                it = itertools.cycle(packed)
                t = graph_time(lambda: call(*next(it), mma))
                layer[(m, arm)] = layer.get((m, arm), 0.0) + t
                line.append(f"{arm} {t * 1e6:6.1f} ({roof / t:4.0%})")
            print("  ".join(line), flush=True)
            del packed
            torch.cuda.empty_cache()
    print(f"{fmt.name}: the fused layer's four GEMMs x 32 layers, ms:")
    for m in rows:
        print(f"  M={m:3d}  shipped {layer[(m, 'shipped')] * 32e3:6.3f}  "
              f"words {layer[(m, 'words')] * 32e3:6.3f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
