"""Where a decode step's time goes: ``python -m infergraft.core.tools.bench_profile``.

First one prefill step alone: its wall time captured in a CUDA graph and run eagerly, and
the eager step's per-kernel GPU time. Then for each
batch size: the inter-token time (what TPOT measures), the CUDA-graph replay alone (GPU
time), the difference (host work the decode look-ahead did not hide), and the per-kernel
GPU time of one decode step from the torch profiler (run eagerly on the graph's static
buffers, so the kernels and shapes are the graph's). CUDA only.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict

import torch

from .bench import full_batch_steps, random_prompts
from .bench_cli import load_models
from ..request import SamplingParams


def replay_ms(runner, bs: int, repeats: int = 30) -> float:
    from infergraft.core.tools.kernel_bench.gemms import replay_times

    return statistics.median(replay_times(runner.graphs[bs], repeats)) * 1e3


def kernel_table(model, runner, cache, bs: int, top: int = 25) -> str:
    tokens, meta = runner.tokens[bs], runner.metas[bs]
    with torch.inference_mode():
        model(tokens, cache, meta)
        torch.cuda.synchronize()
        return profiled(lambda: model(tokens, cache, meta), top, layers=len(model.layers))


def profiled(fn, top: int = 25, layers: int = 0) -> str:
    """Per-kernel GPU time of one call of ``fn`` (synchronised). With ``layers``, a kernel
    launched k times per layer (the decode GEMMs: qkv, o, gate_up, down) is split into
    ``name #i``, its i-th launch in each layer, by launch order."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = sorted((ev for ev in prof.events() if ev.device_type.name == "CUDA"),
                    key=lambda ev: ev.time_range.start)
    launches = defaultdict(int)
    for ev in events:
        launches[ev.name[:60]] += 1
    total, count, seen = defaultdict(float), defaultdict(int), defaultdict(int)
    for ev in events:
        name = ev.name[:60]
        per_layer = launches[name] // layers if layers and launches[name] % layers == 0 else 1
        if per_layer > 1:
            name = f"{name} #{seen[ev.name[:60]] % per_layer}"
            seen[ev.name[:60]] += 1
        total[name] += ev.device_time
        count[name] += 1
    s = sum(total.values())
    lines = [f"    sum of kernel time {s / 1e3:.3f} ms over {sum(count.values())} kernels"]
    for name, t in sorted(total.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"    {t / 1e3:8.3f} ms {100 * t / s:5.1f}%  x{count[name]:4d}  {name}")
    return "\n".join(lines)


def prefill_wall_ms(engine, prompt, params, runs: int = 6) -> list[float]:
    """Wall time of one prefill step alone (synchronised), ``runs`` times."""
    times = []
    for _ in range(runs):
        seq = engine.add_request(prompt, params)
        torch.cuda.synchronize()
        t = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
        engine.scheduler.abort([seq])
    return times


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="llama2-7b")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=32)
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    _, engine = load_models(args.model, "cuda", torch.bfloat16, max(batches),
                            args.prompt_len + args.new_tokens)
    runner = engine.decode_graphs
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    prompt = random_prompts(1, args.prompt_len, engine.spec.vocab_size, seed=99)[0]
    graphs = engine.runner.step_graphs  # the paged cache's: a prompt is one mixed step
    for label, steps in (("captured", graphs), ("eager", None)):
        engine.runner.step_graphs = steps
        print(f"prefill of {args.prompt_len} tokens, {label}: "
              f"{', '.join(f'{t:.1f}' for t in prefill_wall_ms(engine, prompt, params))} ms "
              "(wall, one step; the first is a warm-up)", flush=True)
    seq = engine.add_request(prompt, params)  # the eager step's GPU time, kernel by kernel
    print(profiled(engine.step, top=12), flush=True)
    engine.scheduler.abort([seq])
    engine.runner.step_graphs = graphs
    for bs in batches:
        prompts = random_prompts(bs, args.prompt_len, engine.spec.vocab_size, seed=bs)
        seqs = [engine.add_request(q, params) for q in prompts]
        calls = []  # seconds of each step() call
        while engine.has_unfinished():  # no sync here: it would stall the decode look-ahead
            t = time.perf_counter()
            engine.step()
            calls.append(time.perf_counter() - t)
            if len(calls) == args.new_tokens // 2:  # mid-generation: K/V at the mean context
                bucket = runner.bucket(bs)
                g = replay_ms(runner, bucket)
                table = kernel_table(engine.model, runner, engine.cache, bucket)
        # the step period is the inter-token latency (with the decode look-ahead a step()
        # call returns while the next step already runs)
        itl = statistics.median(full_batch_steps([s.metrics for s in seqs])[2:]) * 1e3
        call = statistics.median(calls[3:]) * 1e3
        print(f"batch {bs}: inter-token {itl:.3f} ms (step() call {call:.3f}), graph replay "
              f"{g:.3f} ms, host gap {itl - g:.3f} ms\n{table}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
