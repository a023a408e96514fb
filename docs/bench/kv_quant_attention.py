"""Decode attention over 16-bit, int8 and e4m3 K/V at long context, one layer, on CUDA:
    python3 docs/bench/kv_quant_attention.py [--batch 16] [--context 4032] [--heads 32/32]
        [--modes cvt,f16,words,words16] [--plans shipped,1x64x4x3,...] [--reps 50]
Each 8-bit format under each way of widening it (``INFERGRAFT_KV8_WIDEN``, kernels/kv8.py;
cvt also with K read transposed, ``INFERGRAFT_KV_LOAD_T``) with the shipped launch plan and
forced (splits x BLOCK_N x warps x stages) plans, beside bf16; achieved bytes/s (K/V values
+ scales) against a measured copy, each format's time at the copy rate (its roofline), and
the ratio to bf16's shipped time, in one table. Then each format's best, and the mode whose
shipped-plan int8 + e4m3 times sum least (``--best-mode-out``: written to a file).
"""
from __future__ import annotations

import argparse
import os

import torch

from infergraft.kernels.kv_write import quantize_kv_torch
from infergraft.kernels.paged_attention import paged_attention_triton

PLANS_16 = "shipped,1x64x4x3,2x64x4x2"
PLANS_8 = "shipped,1x64x4x3,1x128x4x2,1x128x4x3,2x128x4x2,1x128x8x3"


def timed(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps  # ms


def _knobs(plan: str) -> dict:
    if plan == "shipped":
        return {}
    s, bn, warps, stages = (int(x) for x in plan.split("x"))
    return dict(num_splits=s, block_n=bn, num_warps=warps, num_stages=stages)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=4032)
    p.add_argument("--heads", default="32/32")
    p.add_argument("--modes", default="cvt,f16,words,words16")
    p.add_argument("--plans", default=PLANS_8, help="8-bit plans: shipped and SxNxWxST")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--best-mode-out", default=None,
                   help="write here the widen mode whose int8 + e4m3 times (shipped plans) "
                        "sum least")
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
    copy_bw = 2 * buf.numel() / timed(lambda: buf.clone(), 20) / 1e6  # GB/s: read + write
    del buf
    formats = {"bf16": (k, v, None, None)}
    for name, dt in (("int8", torch.int8), ("fp8", torch.float8_e4m3fn)):
        (kq, ks), (vq, vs) = quantize_kv_torch(k, dt), quantize_kv_torch(v, dt)
        formats[name] = (kq, vq, ks, vs)
    # (format, widen, plan) runs: bf16 once per plan (no widening); cvt also with K^T
    runs = [("bf16", "-", plan) for plan in PLANS_16.split(",")]
    for name in ("int8", "fp8"):
        for mode in a.modes.split(","):
            runs += [(name, mode, plan) for plan in a.plans.split(",")]
            if mode == "cvt":
                runs.append((name, "cvt+K_T", "shipped"))
    print(f"B={b} context={n} heads {hq}/{hkv} D={d}; copy {copy_bw:.0f} GB/s; "
          f"{torch.cuda.get_device_name()}")
    print("| K/V | widen | plan (S x BLOCK_N x warps x stages) | ms | GB/s | of copy | "
          "roofline ms | vs bf16 | err vs bf16 |")
    print("|---|---|---|---|---|---|---|---|---|")
    ref, bf16_ms, best, by_mode = None, None, {}, {}
    for name, mode, plan in runs:
        kc, vc, ks, vs = formats[name]
        nbytes = sum(t.numel() * t.element_size() for t in (kc, vc, ks, vs) if t is not None)
        nbytes *= b * n / (nb * bs)
        roof = nbytes / copy_bw / 1e6  # ms at the copy rate
        os.environ["INFERGRAFT_KV8_WIDEN"] = mode.split("+")[0] if mode != "-" else "cvt"
        os.environ["INFERGRAFT_KV_LOAD_T"] = "1" if mode.endswith("K_T") else "0"
        kw = _knobs(plan)
        try:
            run = lambda: paged_attention_triton(q, kc, vc, tables, lens, d ** -0.5,  # noqa: E731
                                                 None, ks, vs, **kw)
            out = run()
            ms = timed(run, a.reps)
        except Exception as e:  # a plan that does not fit: say so, go on
            print(f"| {name} | {mode} | {plan} | - | {type(e).__name__} | | {roof:.3f} | | |")
            continue
        ref = out.float() if ref is None else ref
        bf16_ms = ms if bf16_ms is None else bf16_ms  # the first run: bf16, shipped
        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        gbs = nbytes / ms / 1e6
        print(f"| {name} | {mode} | {plan} | {ms:.3f} | {gbs:.0f} | {gbs / copy_bw:.0%} | "
              f"{roof:.3f} | {ms / bf16_ms:.2f}x | {err:.3f} |", flush=True)
        if name not in best or ms < best[name][0]:
            best[name] = (ms, mode, plan, roof)
        if name != "bf16" and "+" not in mode and plan == "shipped":  # what the engine runs
            by_mode.setdefault(mode, {})[name] = ms
    os.environ.pop("INFERGRAFT_KV8_WIDEN", None)
    os.environ.pop("INFERGRAFT_KV_LOAD_T", None)
    print("\n| K/V | best ms | widen | plan | roofline ms | vs bf16 shipped |")
    print("|---|---|---|---|---|---|")
    for name, (ms, mode, plan, roof) in best.items():
        print(f"| {name} | {ms:.3f} | {mode} | {plan} | {roof:.3f} | {ms / bf16_ms:.2f}x |")
    full = {mode: sum(t.values()) for mode, t in by_mode.items() if len(t) == 2}
    if full:
        pick = min(full, key=full.get)
        print(f"\nbest widen mode over int8 + e4m3, shipped plans: {pick} "
              f"({full[pick]:.3f} ms the pair)")
        if a.best_mode_out:
            with open(a.best_mode_out, "w") as f:
                f.write(pick + "\n")


if __name__ == "__main__":
    main()
