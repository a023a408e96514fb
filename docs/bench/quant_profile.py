"""Where a quantised decode step's time goes, each weight format beside bf16 in one process.

    python3 docs/bench/quant_profile.py [--builds ,int8,int4,fp8] [--batches 1,32] [--ncu]

One random LLaMA-2-7B-shaped HF model (seed 0) is built once; for each build (plugin sets
separated by ',', plugins within a set by '+'; the empty set is bf16) our engine is built
on its weights and decodes each batch of 512-token prompts. Mid-generation it prints the
CUDA-graph replay of one decode step (GPU time), the inter-token time, and the per-kernel
GPU time of that step from the torch profiler (``core/tools/bench_profile.py``'s table,
kernels launched several times a layer split by launch order).

``--ncu``: no torch profiler; one eager decode step per build and batch is run inside an
NVTX range named ``<build>_b<batch>`` so that Nsight Compute can take exactly its kernels:

    ncu --clock-control none --nvtx --nvtx-include "int4_b1/" --launch-count 24 \
        --section SpeedOfLight --section WarpStateStats -o OUT/int4 \
        python3 docs/bench/quant_profile.py --ncu --batches 1 --builds int4

(docs/bench/gpu_quant_profile.sh runs both, with the metrics it reads).
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

import torch

from infergraft.core.request import SamplingParams
from infergraft.core.tools.bench import copy_bandwidth, full_batch_steps, random_prompts
from infergraft.core.tools.bench_cli import build_engine, load_hf
from infergraft.core.tools.bench_profile import kernel_table, replay_ms


def decode_profile(engine, label: str, bs: int, prompt_len: int, new_tokens: int,
                   ncu: bool) -> None:
    runner = engine.decode_graphs
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    prompts = random_prompts(bs, prompt_len, engine.spec.vocab_size, seed=bs)
    seqs = [engine.add_request(q, params) for q in prompts]
    steps = 0
    g, table = float("nan"), ""
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if steps == new_tokens // 2:  # K/V at about the mean context
            bucket = runner.bucket(bs)
            g = replay_ms(runner, bucket)
            if ncu:
                tokens, meta = runner.tokens[bucket], runner.metas[bucket]
                with torch.inference_mode(), torch.cuda.nvtx.range(f"{label}_b{bs}"):
                    engine.model(tokens, engine.cache, meta)
                    torch.cuda.synchronize()
            else:
                table = kernel_table(engine.model, runner, engine.cache, bucket, top=30)
    itl = statistics.median(full_batch_steps([s.metrics for s in seqs])[2:]) * 1e3
    print(f"[{label}] batch {bs}: inter-token {itl:.3f} ms, graph replay {g:.3f} ms\n{table}",
          flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama2-7b")
    p.add_argument("--builds", default=",int8,int4,fp8")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--ncu", action="store_true")
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    print(f"{torch.cuda.get_device_name()}: copy {copy_bandwidth('cuda') / 1e12:.2f} TB/s",
          flush=True)
    hf = load_hf(args.model, "cuda", torch.bfloat16)
    for build in args.builds.split(","):
        plugins = tuple(x for x in build.split("+") if x)
        label = "+".join(plugins) or "bf16"
        t = time.perf_counter()
        engine = build_engine(hf, "cuda", torch.bfloat16, max(batches),
                              args.prompt_len + args.new_tokens, plugins)
        print(f"[{label}] built in {time.perf_counter() - t:.1f} s; weight bytes on the "
              f"device {engine.plan.device_weight_bytes / 1e9:.3f} GB", flush=True)
        for bs in batches:
            decode_profile(engine, label, bs, args.prompt_len, args.new_tokens, args.ncu)
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
