"""Where a serving run's step time goes: ``python -m infergraft.core.tools.step_profile``.

A workload of ``bench throughput`` (its datasets, all requests at once) runs through our
engine; after ``--skip`` steps, ``--steps`` engine steps run under the torch profiler.
Each kernel of the window is put in a part (``PARTS``: GEMMs, attention, norms, rotary,
activations, sampling, copies, other) and each part's GPU time is set beside its floor:

- GEMMs: 2 FLOPs a weight for every token the window fed through the layers, plus the LM
  head's rows, at the matmul rate measured in the same run (``bench.matmul_rate``);
- attention: QK^T and PV, 4 q_size FLOPs for each key a fed token attends to, at the
  same rate (what FlashAttention reaches on Hopper is a share of it);
- the rest: no floor (their bytes are small beside the weights').

The window's wall time less its kernels' time is the GPU's idle time (the host between
steps). The tokens come from the sequences themselves (``num_computed_tokens`` before and
after each step), so the FLOPs are those of the steps as the scheduler packed them.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict

import torch

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


class StepRecorder:
    """What each profiled engine step fed: (first position, tokens) per sequence, and the
    rows it sampled (sequences whose output grew)."""

    def __init__(self, engine):
        self.engine, self.fed, self.sampled, self.steps = engine, [], 0, 0

    def step(self) -> None:
        seqs = self.engine.scheduler.running + list(self.engine.scheduler.waiting)
        before = {s.id: (s.num_computed_tokens, len(s.output_ids)) for s in seqs}
        self.engine.step()
        self.steps += 1
        for s in seqs:
            c0, o0 = before[s.id]
            # a preempted sequence recomputes from 0: count what it fed this step only
            c1 = s.num_computed_tokens
            if c1 > c0:
                self.fed.append((c0, c1 - c0))
            self.sampled += len(s.output_ids) > o0


def _kernel_events(prof, device_type: str):
    return [ev for ev in prof.events() if ev.device_type.name == device_type]


def profile_steps(engine, steps: int) -> dict:
    """Run ``steps`` engine steps under the torch profiler: wall seconds, each part's
    kernel seconds and kernel counts, the top kernels, and the window's fed tokens."""
    from torch.profiler import ProfilerActivity, profile

    cuda = engine.device.type == "cuda"
    record = StepRecorder(engine)
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with profile(activities=activities) as prof:
        sync()
        t = time.perf_counter()
        while record.steps < steps and engine.has_unfinished():
            record.step()
        sync()
        wall = time.perf_counter() - t
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
    return {"wall_s": wall, "steps": record.steps, "parts_s": dict(parts),
            "kernels_s": dict(sorted(kernels.items(), key=lambda kv: -kv[1])),
            "fed": record.fed, "sampled": record.sampled}


def report(profiled: dict, spec, rate: float, top: int = 12) -> str:
    """The window's parts against their floors at ``rate`` FLOP/s, then the top kernels."""
    flops = window_flops(spec, profiled["fed"], profiled["sampled"])
    wall, parts = profiled["wall_s"], profiled["parts_s"]
    busy = sum(parts.values())
    tokens = sum(n for _, n in profiled["fed"])
    lines = [f"{profiled['steps']} steps, {tokens} tokens fed, {profiled['sampled']} sampled: "
             f"wall {wall * 1e3:.1f} ms, kernels {busy * 1e3:.1f} ms "
             f"(idle {max(wall - busy, 0) / wall:.1%} of the wall)",
             f"{'part':<12}{'ms':>10}{'of wall':>9}{'floor ms':>10}{'floor/ms':>9}"]
    for part, s in sorted(parts.items(), key=lambda kv: -kv[1]):
        floor = flops[part] / rate if part in flops else None
        lines.append(f"{part:<12}{s * 1e3:>10.2f}{s / wall:>9.1%}"
                     + (f"{floor * 1e3:>10.2f}{floor / s:>9.1%}" if floor and s else ""))
    lines.append("top kernels:")
    for name, s in list(profiled["kernels_s"].items())[:top]:
        lines.append(f"  {s * 1e3:9.2f} ms  {part_of(name):<10} {name[:90]}")
    return "\n".join(lines)


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
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    from .bench_throughput import vocab_size

    requests = make_requests(args.dataset, args.num_prompts, args.prompt_len,
                             args.output_len, vocab_size(args.model))
    longest = max(len(r.prompt) + r.output_len for r in requests)
    _, engine = load_models(args.model, device, dtype, min(len(requests), 256), longest,
                            max_num_batched_tokens=args.max_num_batched_tokens)
    for r in requests:
        engine.add_request(list(r.prompt), SamplingParams(max_new_tokens=r.output_len,
                                                          ignore_eos=True))
    for _ in range(args.skip):
        engine.step()
    profiled = profile_steps(engine, args.steps)
    rate = matmul_rate(device, dtype, 8192 if device.type == "cuda" else 1024)
    print(f"{args.model} {args.dataset} ({args.num_prompts} requests, "
          f"{engine.scheduler.max_num_batched_tokens}-token steps) on {device}, matmul rate "
          f"{rate / 1e12:.1f} TFLOP/s:\n" + report(profiled, engine.spec, rate))
    return 0


if __name__ == "__main__":
    sys.exit(main())
