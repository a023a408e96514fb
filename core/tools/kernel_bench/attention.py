"""Paged decode attention on CUDA: ``python -m infergraft.core.tools.kernel_bench.attention``.

LLaMA-2-7B-shaped decode (bf16, D=128, block size 16, 32 query heads with 32 kv heads
and with 8), context 544 tokens in a block table wide enough for 576: achieved K/V
bandwidth inside a CUDA graph for fixed split counts and the automatic one, plus a
BLOCK_N x num_warps sweep at the automatic split count, against a measured copy.
Split partials are merged by the last split to finish (fused, the default) or, with
``--two-kernel``, by a second kernel: run both to compare, e.g. ``--batches 1 --heads
32/32 --context 576 --table 2048 --no-sweep`` with and without ``--two-kernel``.
``--grid --splits 1,2,3,4,6`` times each of those split counts with each of ``GRID_TILES``
(the sweep behind ``paged_plan.MID_PLANS``) against the shipped plan.
``TRITON_INTERPRET=1 ... --dry`` runs the same loop on the CPU (Triton interpreter, one
call each, no timing, float16: the 3.9 interpreter's bf16 tl.dot is wrong) to check the
plumbing without a GPU; use small --context with it.
"""
from __future__ import annotations

import argparse
import itertools
import math

import torch

D, BLOCK_SIZE, TABLE_TOKENS = 128, 16, 576
SWEEP = list(itertools.product((32, 64, 128), (4, 8)))  # (BLOCK_N, num_warps)
WIDE_SWEEP = list(itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4, 5)))  # + num_stages
# --grid: every fixed S of --splits with each of these (BLOCK_N, num_warps, num_stages): the
# sweep behind paged_plan.MID_PLANS
GRID_TILES = [(32, 4, 2), (32, 2, 4), (64, 4, 2), (64, 4, 3), (128, 8, 2)]
L2_BYTES = 256 << 20  # cycle through distinct caches worth this much so replays miss L2


def make_inputs(bsz, hq, hkv, context, device, dtype=torch.bfloat16, table_tokens=TABLE_TOKENS,
                layout="token"):
    """q, one K/V pool, ``copies`` block tables over disjoint random blocks, lengths.
    ``layout`` "token": storage [NB, BS, Hkv, D] (the paged cache's); "head": storage
    [NB, Hkv, BS, D] passed as the same [NB, BS, Hkv, D] view (one head's block contiguous)."""
    mb = -(-max(table_tokens, context) // BLOCK_SIZE)
    kv_bytes = 2 * bsz * context * hkv * D * torch.finfo(dtype).bits // 8
    copies = max(1, min(128, math.ceil(L2_BYTES / kv_bytes))) if device == "cuda" else 1
    nb = copies * bsz * mb
    shape = (nb, BLOCK_SIZE, hkv, D) if layout == "token" else (nb, hkv, BLOCK_SIZE, D)
    k = torch.randn(shape, device=device, dtype=dtype)
    v = torch.randn(shape, device=device, dtype=dtype)
    if layout == "head":
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    perm = torch.randperm(nb, device=device).to(torch.int32)
    tables = list(perm.view(copies, bsz, mb))
    q = torch.randn(bsz, hq, D, device=device, dtype=dtype)
    lens = torch.full((bsz,), context, dtype=torch.int32, device=device)
    return q, k, v, tables, lens, kv_bytes


def bench_shape(timer, bsz, hq, hkv, context, device, dtype, splits, sweep, layout="token",
                table_tokens=TABLE_TOKENS, fused=True):
    from infergraft.kernels.paged_attention import (_sm_count, launch_plan,
                                                    paged_attention_torch,
                                                    paged_attention_triton, split_len)

    q, k, v, tables, lens, kv_bytes = make_inputs(bsz, hq, hkv, context, device, dtype,
                                                  table_tokens=table_tokens, layout=layout)
    scale = D ** -0.5

    def tbs(**kw):  # TB/s, or None where the config does not compile (shared memory...)
        it = itertools.cycle(tables)
        try:
            t = timer(lambda: paged_attention_triton(q, k, v, next(it), lens, scale,
                                                     fused_combine=fused, **kw), len(tables))
        except Exception as e:  # noqa: BLE001 - report and go on with the sweep
            if "OutOfResources" not in type(e).__name__ and "out of resource" not in str(e):
                print(f"  ({hq}/{hkv} B={bsz} {kw}: {type(e).__name__}: {e})")
            return None, None
        return kv_bytes / t / 1e12, t

    auto_s, auto_n, _ = launch_plan(bsz, hkv, tables[0].shape[1] * BLOCK_SIZE, None,
                                    _sm_count(q.device), group=hq // hkv,
                                    wide_tiles=dtype != torch.float32)
    auto_p = split_len(context, auto_s, auto_n)  # the kernel splits the actual length
    row = {f"S={s}": tbs(num_splits=s)[0] for s in splits}
    row["auto"], t_auto = tbs()
    best = (None, None)
    for cfg in (sweep or []):
        knobs = dict(zip(("block_n", "num_warps", "num_stages"), cfg))
        bw = tbs(**knobs)[0]
        if bw is not None and (best[0] is None or bw > best[0]):
            best = (bw, "".join(f"{tag}{x}" for tag, x in zip(("N", "w", "s"), cfg)))
    ref = paged_attention_torch(q, k, v, tables[0], lens, scale).float()
    out = paged_attention_triton(q, k, v, tables[0], lens, scale, fused_combine=fused)
    err = (out.float() - ref).abs().max().item()
    return row, auto_s, auto_p, t_auto, best, kv_bytes, err


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--heads", default="32/32,32/8", help="Hq/Hkv pairs")
    p.add_argument("--context", type=int, default=544)
    p.add_argument("--table", type=int, default=TABLE_TOKENS, help="block table width in tokens")
    p.add_argument("--two-kernel", action="store_true",
                   help="merge split partials in a second kernel (default: the last split, fused)")
    p.add_argument("--splits", default="1,2,4,8", help="fixed num_splits (auto is always run)")
    p.add_argument("--no-sweep", action="store_true", help="skip the BLOCK_N x num_warps sweep")
    p.add_argument("--wide", action="store_true", help="sweep num_warps 2-8 and num_stages 2-5 too")
    p.add_argument("--layout", default="token", choices=("token", "head"),
                   help="K/V storage: [NB, BS, Hkv, D] (token) or [NB, Hkv, BS, D] (head)")
    p.add_argument("--grid", action="store_true",
                   help="time every --splits S with each GRID_TILES tile; print the 4 best per shape")
    p.add_argument("--dry", action="store_true", help="CPU interpreter, one call per config, no timing")
    a = p.parse_args(argv)
    if a.dry:
        from infergraft.kernels._triton import interpreting

        if not interpreting():  # must be set before triton is first imported
            raise SystemExit("--dry needs TRITON_INTERPRET=1 in the environment")
        device, dtype = "cpu", torch.float16

        def timer(fn, inner):
            fn()
            return 1.0
        bw = None
    else:
        if not torch.cuda.is_available():
            raise SystemExit("kernel_bench.attention needs CUDA (or --dry)")
        from infergraft.core.tools.bench import copy_bandwidth

        from .gemms import graph_time

        device, dtype = "cuda", torch.bfloat16

        def timer(fn, inner):  # one graph replays every cache copy once
            return graph_time(fn, replays=10, inner=inner)
        bw = copy_bandwidth("cuda")  # the same roofline as `infergraft bench`
        print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    splits = [int(s) for s in a.splits.split(",") if s]
    if a.grid:
        return grid(timer, a, splits, device, dtype)
    sweep = None if a.no_sweep else (WIDE_SWEEP if a.wide else SWEEP)
    cols = [f"S={s}" for s in splits] + ["auto"]
    print(f"{str(dtype)[6:]} D={D} block={BLOCK_SIZE} context={a.context} table={a.table} "
          f"layout={a.layout} combine={'two-kernel' if a.two_kernel else 'fused'}; TB/s of K/V read")
    print(f"{'Hq/Hkv':>6} {'B':>3} {'KV MB':>6} " + " ".join(f"{c:>6}" for c in cols)
          + f" {'auto S x P':>10} {'auto us':>8} {'%copy':>5} {'best tile':>16} {'max err':>8}")
    for heads, bsz in itertools.product(a.heads.split(","), (int(b) for b in a.batches.split(","))):
        hq, hkv = (int(x) for x in heads.split("/"))
        row, s, plen, t, best, nbytes, err = bench_shape(timer, bsz, hq, hkv, a.context, device,
                                                         dtype, splits, sweep, a.layout, a.table,
                                                         not a.two_kernel)
        fmt = lambda x: f"{x:6.2f}" if x is not None else f"{'-':>6}"  # noqa: E731
        pct = f"{100 * nbytes / t / bw:5.0f}" if bw and t else f"{'-':>5}"
        tile = f"{fmt(best[0]).strip()} {best[1]}" if best[0] is not None else "-"
        print(f"{heads:>6} {bsz:3d} {nbytes / 1e6:6.1f} " + " ".join(fmt(row[c]) for c in cols)
              + f" {f'{s}x{plen}':>10} {(t or 0) * 1e6:8.1f} {pct} {tile:>16} {err:8.1e}", flush=True)
    return 0


def grid(timer, a, splits, device, dtype) -> int:
    """us per call of the shipped plan and of each (S, tile) of the grid, best four first."""
    from infergraft.kernels.paged_attention import paged_attention_triton

    for heads, bsz in itertools.product(a.heads.split(","), (int(b) for b in a.batches.split(","))):
        hq, hkv = (int(x) for x in heads.split("/"))
        q, k, v, tables, lens, _ = make_inputs(bsz, hq, hkv, a.context, device, dtype,
                                               table_tokens=a.table, layout=a.layout)

        def us(**kw):
            it = itertools.cycle(tables)
            try:
                return timer(lambda: paged_attention_triton(q, k, v, next(it), lens, D ** -0.5,
                                                            **kw), len(tables)) * 1e6
            except Exception as e:  # noqa: BLE001 - shared memory: that tile does not fit
                if "OutOfResources" not in type(e).__name__ and "out of resource" not in str(e):
                    raise
                return None
        times = {f"S{s} {n}x{w}x{st}": us(num_splits=s, block_n=n, num_warps=w, num_stages=st)
                 for s in splits for n, w, st in GRID_TILES}
        best = sorted((t, c) for c, t in times.items() if t is not None)[:4]
        print(f"{heads:>6} B={bsz:<3d} pairs={bsz * hkv:<4d} shipped {us():7.2f} us; best: "
              + ", ".join(f"{c} {t:.2f}" for t, c in best), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
