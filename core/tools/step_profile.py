"""Where a serving run's step time goes: ``python -m infergraft.core.tools.step_profile``.

A workload of ``bench throughput`` (its datasets, all requests at once) runs through our
engine; after ``--skip`` steps, ``--steps`` engine steps run under the torch profiler.
Each kernel of the window is put in a part (``PARTS``: GEMMs, attention, norms, rotary,
activations, sampling, copies, other) and each part's GPU time is set beside its floor
(step_floors.py), at the matmul rate and the copy rate measured in the same run
(``bench.matmul_rate``, ``bench.copy_bandwidth``):

- GEMMs: 2 FLOPs a weight for every token the window fed through the layers, plus the LM
  head's rows, at the matmul rate; a step that reads its weights for longer (a few rows),
  that read;
- attention: each sequence's span of a step, the longer of its QK^T and PV FLOPs (4
  q_size a key attended) at the matmul rate and the K/V bytes it reads at the copy rate:
  a decoding row reads its whole context for one query (what FlashAttention reaches on
  Hopper is a share of either);
- the rest: no floor (their bytes are small beside the weights').

The window's wall time less its kernels' time is the GPU's idle time (the host between
steps). The tokens come from the steps as the engine runs them (step_census.py records
each step's sequences, the first position and the tokens each feeds), so the floors are
those of the steps as the scheduler packed them. ``--census``: the whole run instead,
every step classed and timed without the profiler (step_census.py's table).
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict

import torch

from .step_census import StepCensus, table as census_table
from .step_floors import StepFloors, copy_rate
from .throughput_report import fed_flops

# (part, substrings of a kernel's name, lower case): the first part whose substring the
# name holds takes it; attention first, as FlashAttention-style kernels run GEMM tiles
PARTS = (
    ("attention", ("attention", "attn", "varlen", "paged", "flash", "fmha")),
    ("gemm", ("gemm", "gemv", "matmul", "linear", "cutlass", "xmma", "nvjet", "cublas",
              "aten::mm", "aten::addmm", "aten::bmm", "lm_head", "_mma")),
    ("norm", ("norm",)),
    ("rotary", ("rotary", "rope")),
    ("activation", ("silu", "gelu", "swiglu", "act_and_mul")),
    ("sampling", ("sample", "argmax", "softmax", "topk", "sort", "multinomial", "greedy",
                  "bitmask", "penalt", "logits")),
    ("copy", ("copy", "memcpy", "memset", "fill", "cat", "index", "gather", "scatter",
              "embedding", "kv_write", "reshape_and_cache")),
)


def part_of(kernel_name: str) -> str:
    name = kernel_name.lower()
    return next((part for part, keys in PARTS if any(k in name for k in keys)), "other")


def window_flops(spec, fed: list[tuple[int, int]], sampled: int) -> dict:
    """{gemm, attention}: FLOPs of feeding each (first position, tokens) span of ``fed``
    through the layers and sampling ``sampled`` rows from the LM head."""
    flops = fed_flops(spec, fed, sampled)
    return {"gemm": flops["matmul"] + flops["lm_head"], "attention": flops["attention"]}


def _kernel_events(prof, device_type: str):
    return [ev for ev in prof.events() if ev.device_type.name == device_type]


def profile_steps(engine, steps: int) -> dict:
    """Run ``steps`` engine steps under the torch profiler: wall seconds, each part's
    kernel seconds and kernel counts, the top kernels, and the window's steps
    (step_census.StepRecord), the spans they fed and the rows they sampled."""
    from torch.profiler import ProfilerActivity, profile

    cuda = engine.device.type == "cuda"
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with profile(activities=activities) as prof:
        sync()
        census = StepCensus(engine)
        while len(census.steps) < steps and engine.has_unfinished():
            engine.step()
        sync()
        census.stop()
    kernels = defaultdict(float)
    if cuda:
        for ev in _kernel_events(prof, "CUDA"):
            kernels[ev.name] += ev.device_time * 1e-6
    else:  # the CPU's leaf operators (self time): what runs the arithmetic there
        for ev in prof.key_averages():
            if "::" in ev.key and ev.self_cpu_time_total > 0:
                kernels[ev.key] += ev.self_cpu_time_total * 1e-6
    parts = defaultdict(float)
    for name, s in kernels.items():
        parts[part_of(name)] += s
    return {"wall_s": census.end - census.start, "steps": len(census.steps),
            "parts_s": dict(parts),
            "kernels_s": dict(sorted(kernels.items(), key=lambda kv: -kv[1])),
            "records": census.steps, "fed": [x for s in census.steps for x in s.spans],
            "sampled": sum(s.sampled for s in census.steps)}


def window_floors(profiled: dict, floors) -> dict:
    """{gemm, attention}: the window's floor seconds, step by step (step_floors.py)."""
    out = {"gemm": 0.0, "attention": 0.0}
    for step in profiled["records"]:
        for part, s in floors.parts_s(step).items():
            out[part] += s
    return out


def report(profiled: dict, floors, top: int = 12) -> str:
    """The window's parts against their floors (``floors``: step_floors.StepFloors), then
    the top kernels."""
    floor = window_floors(profiled, floors)
    wall, parts = profiled["wall_s"], profiled["parts_s"]
    busy = sum(parts.values())
    tokens = sum(n for _, n in profiled["fed"])
    lines = [f"{profiled['steps']} steps, {tokens} tokens fed, {profiled['sampled']} sampled: "
             f"wall {wall * 1e3:.1f} ms, kernels {busy * 1e3:.1f} ms "
             f"(idle {max(wall - busy, 0) / wall:.1%} of the wall)",
             f"{'part':<12}{'ms':>10}{'of wall':>9}{'floor ms':>10}{'floor/ms':>9}"]
    for part, s in sorted(parts.items(), key=lambda kv: -kv[1]):
        f = floor.get(part)
        lines.append(f"{part:<12}{s * 1e3:>10.2f}{s / wall:>9.1%}"
                     + (f"{f * 1e3:>10.2f}{f / s:>9.1%}" if f and s else ""))
    flop_s, byte_s = floors.attention_bounds_s(profiled["fed"])
    lines.append(f"attention floor {floor['attention'] * 1e3:.2f} ms, span by span the "
                 f"longer of FLOPs ({flop_s * 1e3:.2f} ms in all) and K/V bytes read "
                 f"({byte_s * 1e3:.2f} ms in all)")
    lines.append("top kernels:")
    for name, s in list(profiled["kernels_s"].items())[:top]:
        lines.append(f"  {s * 1e3:9.2f} ms  {part_of(name):<10} {name[:90]}")
    return "\n".join(lines)


def census_run(engine, floors) -> str:
    """Every remaining step of ``engine``'s requests under the step census: its table."""
    census = StepCensus(engine)
    while engine.has_unfinished():
        engine.step()
    census.stop()
    return census_table(census.summary(floors))


def main(argv=None) -> int:
    from .bench import matmul_rate
    from .bench_cli import SHAPES, load_models
    from .serve_workload import DATASETS, make_requests
    from ..request import SamplingParams

    p = argparse.ArgumentParser(prog="python -m infergraft.core.tools.step_profile",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama3-8b", help=f"one of {', '.join(SHAPES)}, or a "
                   "checkpoint")
    p.add_argument("--dataset", choices=DATASETS, default="fixed")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--skip", type=int, default=20, help="steps run before the window")
    p.add_argument("--steps", type=int, default=20, help="steps profiled")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--census", action="store_true",
                   help="every step of the whole run classed and timed, no profiler "
                        "(step_census.py), instead of the window")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    from .bench_throughput import vocab_size

    # the rates first, before the model and its K/V pool take the device's memory
    rate = matmul_rate(device, dtype, 8192 if device.type == "cuda" else 1024)
    copy = copy_rate(device)
    requests = make_requests(args.dataset, args.num_prompts, args.prompt_len,
                             args.output_len, vocab_size(args.model))
    longest = max(len(r.prompt) + r.output_len for r in requests)
    _, engine = load_models(args.model, device, dtype, min(len(requests), 256), longest,
                            max_num_batched_tokens=args.max_num_batched_tokens)
    floors = StepFloors.of(engine, rate, copy)
    print(f"{args.model} {args.dataset} ({args.num_prompts} requests, "
          f"{engine.scheduler.max_num_batched_tokens}-token steps) on {device}, matmul rate "
          f"{rate / 1e12:.1f} TFLOP/s, copy rate {copy / 1e9:.0f} GB/s:")
    if args.census:  # a short request first: the first steps of a shape compile
        engine.generate(list(requests[0].prompt), max_new_tokens=min(4, args.output_len))
    for r in requests:
        engine.add_request(list(r.prompt), SamplingParams(max_new_tokens=r.output_len,
                                                          ignore_eos=True))
    if args.census:
        print(census_run(engine, floors))
        return 0
    for _ in range(args.skip):
        engine.step()
    print(report(profile_steps(engine, args.steps), floors))
    return 0


if __name__ == "__main__":
    sys.exit(main())
