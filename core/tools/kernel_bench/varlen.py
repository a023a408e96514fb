"""Varlen paged attention on CUDA: ``python -m infergraft.core.tools.kernel_bench.varlen``.

One mixed step of LLaMA-3-8B attention (32 query heads, 8 kv heads, D=128, bf16, block
size 16) in three settings: (a) 256 decode tokens at contexts 640-760 plus one
1792-token chunk on a 512-token prefix, (b) one fresh 512-token prompt, (c) 64 decode
tokens at context 4000. Each is timed inside a CUDA graph (``gemms.graph_time``) as one
``varlen_attention`` launch against the per-sequence path it replaces: the decode kernel
(``paged_attention``) for the decode tokens plus torch SDPA (flash, lower-right causal)
for each prompt or chunk, a chunk's K/V gathered from its blocks first (a fresh prompt
uses its own K/V). Both are checked against ``varlen_attention_torch`` before timing.
"K/V GB/s" counts each visible key and value read once. ``--sweep`` also times each
``SWEEP`` tile of the longer sequences (the steps that are not decode-heavy), fastest first.
"""
from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

HQ, HKV, D, BLOCK_SIZE = 32, 8, 128, 16
#: (block_m, block_n, num_warps, num_stages) of the longer sequences' tiles, tried by
#: --sweep on the steps that are not decode-heavy
SWEEP = list(itertools.product((32, 64, 128), (32, 64), (4, 8), (2, 3)))


def make_step(seqs, device, dtype=torch.bfloat16, seed=0):
    """A step of ``seqs`` = (cached prefix, q_len): q, a K/V pool with each sequence's
    blocks at random places, tables, cu_seqlens_q, context_lens, K/V bytes visible."""
    g = torch.Generator(device=device).manual_seed(seed)
    lens = [p + n for p, n in seqs]
    need = [-(-n // BLOCK_SIZE) for n in lens]
    nb = sum(need) + 1
    k = torch.randn(nb, BLOCK_SIZE, HKV, D, device=device, dtype=dtype, generator=g)
    v = torch.randn(nb, BLOCK_SIZE, HKV, D, device=device, dtype=dtype, generator=g)
    perm = torch.randperm(nb, device=device, generator=g).to(torch.int32)
    tables = torch.zeros(len(seqs), max(need), dtype=torch.int32, device=device)
    used = 0
    for b, m in enumerate(need):
        tables[b, :m] = perm[used:used + m]
        used += m
    cu = torch.tensor([0] + list(itertools.accumulate(n for _, n in seqs)), dtype=torch.int32,
                      device=device)
    ctx = torch.tensor(lens, dtype=torch.int32, device=device)
    q = torch.randn(int(cu[-1]), HQ, D, device=device, dtype=dtype, generator=g)
    kv_bytes = 2 * sum(lens) * HKV * D * k.element_size()
    return q, k, v, tables, cu, ctx, kv_bytes


def per_sequence(q, k, v, tables, cu, ctx, scale, seqs):
    """The path varlen replaces: the decode kernel for the one-token sequences (which lead
    the step), then SDPA per prompt or chunk; returns [T, Hq, D]."""
    from torch.nn.attention.bias import causal_lower_right

    from infergraft.kernels.paged_attention import paged_attention_triton

    ndec = sum(1 for p, n in seqs if n == 1)
    width = max((-(-(p + n) // BLOCK_SIZE) for p, n in seqs[:ndec]), default=0)  # their table
    outs = [paged_attention_triton(q[:ndec], k, v, tables[:ndec, :width], ctx[:ndec], scale)] \
        if ndec else []
    row = ndec
    for b, (prefix, n) in enumerate(seqs[ndec:], ndec):
        qb = q[row:row + n].transpose(0, 1)[None]                      # [1, Hq, Q, D]
        blocks = tables[b, :-(-(prefix + n) // BLOCK_SIZE)]
        kb = k[blocks].flatten(0, 1)[:prefix + n].transpose(0, 1)      # [Hkv, L, D]
        vb = v[blocks].flatten(0, 1)[:prefix + n].transpose(0, 1)
        # flash takes no GQA: kv heads repeated, [1, Hq, L, D]
        kb, vb = (x.repeat_interleave(HQ // HKV, 0)[None] for x in (kb, vb))
        mask = causal_lower_right(n, prefix + n) if prefix else None
        o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, is_causal=not prefix,
                                           scale=scale)
        outs.append(o[0].transpose(0, 1))
        row += n
    return torch.cat(outs)


def settings():
    g = torch.Generator().manual_seed(0)
    decodes = [(int(n) - 1, 1) for n in torch.randint(640, 761, (256,), generator=g)]
    return {"a: 256 decode + 1792 chunk on 512": decodes + [(512, 1792)],
            "b: fresh 512 prompt": [(0, 512)],
            "c: 64 decode at 4000": [(3999, 1)] * 64,
            "d: 128 decode + 4 chunks of 512 on 256": decodes[:128] + [(256, 512)] * 4}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sweep", action="store_true", help="time each SWEEP tile on the varlen kernel")
    p.add_argument("--replays", type=int, default=20)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("kernel_bench.varlen needs CUDA")
    from infergraft.kernels.varlen_attention import varlen_attention_torch, varlen_attention_triton
    from infergraft.kernels.varlen_plan import varlen_plan
    from .gemms import graph_time

    scale = D ** -0.5
    print(f"bf16 Hq={HQ} Hkv={HKV} D={D} block={BLOCK_SIZE}; us per call inside a CUDA graph")
    print("| step | varlen plan | varlen us | K/V GB/s | per-sequence us | K/V GB/s | "
          "max err varlen / per-seq |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, seqs in settings().items():
        q, k, v, tables, cu, ctx, nbytes = make_step(seqs, "cuda")
        ref = varlen_attention_torch(q, k, v, tables, cu, ctx, scale).float()
        err = [(fn().float() - ref).abs().max().item() for fn in (
            lambda: varlen_attention_triton(q, k, v, tables, cu, ctx, scale),
            lambda: per_sequence(q, k, v, tables, cu, ctx, scale, seqs))]
        assert max(err) < 0.05, f"{name}: max error {err} against the reference"
        t_var = graph_time(lambda: varlen_attention_triton(q, k, v, tables, cu, ctx, scale),
                           replays=a.replays)
        t_seq = graph_time(lambda: per_sequence(q, k, v, tables, cu, ctx, scale, seqs),
                           replays=a.replays)
        plan = varlen_plan(q.shape[0], len(seqs), HKV, HQ // HKV, tables.shape[1] * BLOCK_SIZE,
                           None, torch.cuda.get_device_properties(0).multi_processor_count,
                           head_dim=D, elem_bytes=2, quant=False)
        shown = (f"M{plan['block_m']} N{plan['block_n']} w{plan['tune']['num_warps']} "
                 f"s{plan['tune']['num_stages']} S{plan['nsplit']}"
                 + (f" + short M{plan['short_m']} N{plan['short_n']}" if plan["short_m"] else ""))
        print(f"| {name} | {shown} | {t_var * 1e6:.1f} | {nbytes / t_var / 1e9:.0f} | "
              f"{t_seq * 1e6:.1f} | {nbytes / t_seq / 1e9:.0f} | {err[0]:.1e} / {err[1]:.1e} |",
              flush=True)
        if a.sweep and plan["short_m"]:
            sweep(q, k, v, tables, cu, ctx, scale, a.replays)
    return 0


def sweep(q, k, v, tables, cu, ctx, scale, replays):
    from infergraft.kernels.varlen_attention import varlen_attention_triton
    from .gemms import graph_time

    times = []
    for bm, bn, w, st in SWEEP:
        try:
            t = graph_time(lambda: varlen_attention_triton(
                q, k, v, tables, cu, ctx, scale, block_m=bm, block_n=bn, num_warps=w,
                num_stages=st), replays=replays)
        except Exception as e:  # noqa: BLE001 - shared memory: that tile does not fit
            if "OutOfResources" not in type(e).__name__ and "out of resource" not in str(e):
                raise
            continue
        times.append((t, f"M{bm} N{bn} w{w} s{st}"))
    print("  by time: " + ", ".join(f"{c} {t * 1e6:.1f}" for t, c in sorted(times)), flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
