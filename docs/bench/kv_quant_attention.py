"""Decode attention over 16-bit, int8 and e4m3 K/V at long context, one layer, on CUDA:
    python3 docs/bench/kv_quant_attention.py [--batch 16] [--context 4032] [--heads 32/32]
Each K/V format with the shipped launch plan and with forced (splits, BLOCK_N, warps,
stages) plans; achieved bytes/s (K/V values + scales) against a measured copy, one table.
"""
from __future__ import annotations

import argparse
import os

import torch

from infergraft.kernels.kv_write import quantize_kv_torch
from infergraft.kernels.paged_attention import paged_attention_triton

PLANS = [None, "K_T", (1, 64, 4, 3), (1, 64, 4, 2), (1, 128, 8, 2), (1, 32, 2, 4), (2, 64, 4, 2),
         (1, 128, 4, 2), (1, 64, 8, 3)]


def timed(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps  # ms


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=4032)
    p.add_argument("--heads", default="32/32")
    a = p.parse_args()
    hq, hkv = map(int, a.heads.split("/"))
    d, bs, b, n = 128, 16, a.batch, a.context
    nb = b * -(-n // bs)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, hq, d, device="cuda", generator=g, dtype=torch.bfloat16)
    k = torch.randn(nb, bs, hkv, d, device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn(nb, bs, hkv, d, device="cuda", generator=g, dtype=torch.bfloat16)
    tables = torch.randperm(nb, device="cuda", dtype=torch.int32).view(b, -1)
    lens = torch.full((b,), n, dtype=torch.int32, device="cuda")
    buf = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    copy_bw = 2 * buf.numel() / timed(lambda: buf.clone()) / 1e6  # GB/s: read + write
    formats = {"bf16": (k, v, None, None)}
    for name, dt in (("int8", torch.int8), ("fp8", torch.float8_e4m3fn)):
        (kq, ks), (vq, vs) = quantize_kv_torch(k, dt), quantize_kv_torch(v, dt)
        formats[name] = (kq, vq, ks, vs)
    ref = None
    print(f"B={b} context={n} heads {hq}/{hkv} D={d}; copy {copy_bw:.0f} GB/s")
    print("| K/V | plan (S, BLOCK_N, warps, stages) | ms | GB/s | of copy |")
    print("|---|---|---|---|---|")
    for name, (kc, vc, ks, vs) in formats.items():
        nbytes = sum(t.numel() * t.element_size() for t in (kc, vc, ks, vs) if t is not None)
        nbytes *= b * n / (nb * bs)
        for plan in PLANS:
            if plan == "K_T" and kc.element_size() == 2:
                continue
            # "K_T": the shipped plan with INFERGRAFT_KV_LOAD_T=1 (8-bit K read as [D, N])
            os.environ["INFERGRAFT_KV_LOAD_T"] = "1" if plan == "K_T" else "0"
            kw = {} if plan in (None, "K_T") else dict(num_splits=plan[0], block_n=plan[1],
                                                       num_warps=plan[2], num_stages=plan[3])
            try:
                run = lambda: paged_attention_triton(q, kc, vc, tables, lens, d ** -0.5,  # noqa: E731
                                                     None, ks, vs, **kw)
                out = run()
                ms = timed(run)
            except Exception as e:  # a plan that does not fit: say so, go on
                print(f"| {name} | {plan or 'shipped'} | - | {type(e).__name__} | |")
                continue
            ref = out.float() if ref is None else ref
            err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
            gbs = nbytes / ms / 1e6
            print(f"| {name} | {plan or 'shipped'} | {ms:.3f} | {gbs:.0f} | "
                  f"{gbs / copy_bw:.0%} | (err vs bf16 {err:.3f})")


if __name__ == "__main__":
    main()
