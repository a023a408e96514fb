"""What structured output costs: N concurrent requests, each with a JSON schema of its
own (never seen before: every one is compiled), against the same N requests
unconstrained, in the same run; and each new schema's compile time.

``python docs/bench/structured_overhead.py [--model smollm2-135m | llama3-8b] [--requests 32]
[--new-tokens 64] [--rounds 2] [--device cpu] [--async-steps auto|on|off] [--out FILE.json]
[--tokenizer DIR]``

``--tokenizer``: a shape's tokenizer (a Hugging Face tokenizer directory; default the demo
model's, converted on first use: a machine without a package index takes its files alone).

``--async-steps``: ``build(async_steps=)`` for every run of the process (auto: build's
default); ``on`` launches each constrained step before the one before is read, its masks
filled while its forward pass runs (core/runner/constrained_steps.py), ``off`` measures the
synchronous engine, whose constrained steps wait for the host's masks and accepted tokens.

Both runs generate exactly ``--new-tokens`` per request, so they run the same batches:
the unconstrained one with ``ignore_eos``, the constrained one under schemas that cannot
finish sooner (an object holding one array of at least 200 strings, its property name and
its strings' bounds unique to the request). Rounds alternate unconstrained, constrained
(jump-forward off), constrained (jump-forward on); the figures are each kind's median
round, and the median over rounds of each round's ratio to its unconstrained run.

Out tok/s: generated tokens / wall time from the first request added to the last
finished. CPU ms / token: this process's CPU time (every thread) over the same span.
Compile: each schema's compilation against the tokenizer (xgrammar,
core/structured/grammar.py), P50 / P99 over every schema of every round. Constraints'
host time (``RowConstraints.host_seconds``): bitmasks filled and applied (on the CPU the
op runs there), tokens accepted, forced tokens found, per step, and its share of the step;
then the same by part (``host_parts``: mask, advance, forced, wait_ready).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from infergraft import core
from infergraft.core.metrics import percentiles

TOPICS = ["a trip to the mountains", "the history of bread", "how tides work",
          "a cat that learns to code", "the best way to learn chess", "volcanoes"]


def schema(request: int, round_: int) -> dict:
    """An object of one array of >= 200 strings, named and bounded for this request."""
    return {"type": "object", "required": [f"notes_{round_}_{request}"], "properties": {
        f"notes_{round_}_{request}": {"type": "array", "minItems": 200, "items": {
            "type": "string", "minLength": 1, "maxLength": 20 + request % 40}}}}


def run(engine, prompts, params) -> dict:
    steps, host0 = 0, engine.constraints.host_seconds
    parts0 = dict(engine.constraints.host_parts)
    t0, cpu0 = time.perf_counter(), time.process_time()
    seqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    while engine.has_unfinished():
        engine.step()
        steps += 1
    seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    tokens = sum(len(s.output_ids) for s in seqs)
    assert all(s.finish_reason == "length" for s in seqs), [s.finish_reason for s in seqs]
    return {"seconds": seconds, "tokens": tokens, "tok_s": tokens / seconds, "steps": steps,
            "cpu_ms_per_token": cpu / tokens * 1e3,
            "host_ms_per_step": (engine.constraints.host_seconds - host0) / steps * 1e3,
            "host_parts_ms_per_step": {  # by RowConstraints method: mask, advance, forced, ...
                k: (v - parts0.get(k, 0.0)) / steps * 1e3
                for k, v in engine.constraints.host_parts.items() if v > parts0.get(k, 0.0)}}


def build(args, n: int):
    """The engine of ``--model``: a checkpoint or alias with its own tokenizer, or a random
    shape (``infergraft bench``'s, e.g. llama3-8b) speaking the demo model's tokenizer (its
    ids fit every shape's vocabulary; the ids past it are masked like any other)."""
    from infergraft.core.tools.bench_cli import SHAPES, load_hf

    options = dict(plugins=["paged"], device=args.device, max_batch_size=n, max_seq_len=256,
                   async_steps={"auto": None, "on": True, "off": False}[args.async_steps])
    if args.model not in SHAPES:
        return core.build(args.model, dtype=args.dtype, **options)
    import torch
    from transformers import AutoTokenizer

    from infergraft.core.loading.demo import ensure_demo_model

    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    tok = AutoTokenizer.from_pretrained(args.tokenizer or
                                        ensure_demo_model("smollm2-135m", quiet=True))
    hf = load_hf(args.model, torch.device(args.device), dtype)
    if hf.config.vocab_size < len(tok):
        raise SystemExit(f"--model {args.model}: its vocabulary ({hf.config.vocab_size}) is "
                         f"smaller than the demo tokenizer's ({len(tok)}); take a shape of "
                         f"{len(tok)} tokens or more, e.g. llama3-8b")
    return core.build(hf, tokenizer=tok, **options)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--async-steps", choices=["auto", "on", "off"], default="auto")
    p.add_argument("--out")
    p.add_argument("--tokenizer", help="a shape's tokenizer directory (default: the demo's)")
    args = p.parse_args(argv)
    n, m = args.requests, args.new_tokens
    engine = build(args, n)
    tok = engine.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"Write notes on "
                                         f"{TOPICS[i % len(TOPICS)]} as JSON."}],
                                       add_generation_prompt=True, tokenize=False)
               for i in range(n)]
    plain = [core.SamplingParams(max_new_tokens=m, ignore_eos=True)] * n
    run(engine, prompts[:2], plain[:2])  # warm-up: first-step allocations, the vocabulary
    run(engine, prompts[:1], [core.SamplingParams(max_new_tokens=4, json_schema=schema(0, -1))])
    compiler = engine.constraints.processors.get("grammar").compiler(engine.constraints.vocab)
    compiled_before = len(compiler.compile_seconds)
    results = {"unconstrained": [], "schema": [], "schema+jump": []}
    for r in range(args.rounds):
        results["unconstrained"].append(run(engine, prompts, plain))
        for kind, jump in (("schema", False), ("schema+jump", True)):
            params = [core.SamplingParams(max_new_tokens=m, json_schema=schema(i, 2 * r + jump),
                                          jump_forward=jump) for i in range(n)]
            results[kind].append(run(engine, prompts, params))
    compile_ms = [s * 1e3 for s in compiler.compile_seconds[compiled_before:]]
    summary = {k: sorted(v, key=lambda x: x["tok_s"])[len(v) // 2] for k, v in results.items()}
    # each round's constrained tok/s over the same round's unconstrained (a load that
    # changes between rounds moves both), their median
    ratios = {k: statistics.median(x["tok_s"] / u["tok_s"] for x, u in
                                   zip(v, results["unconstrained"])) for k, v in results.items()}
    print(f"{args.model} on {engine.plan.device} ({engine.plan.dtype}), {n} requests x {m} "
          f"new tokens, median of {args.rounds} rounds, async steps "
          f"{'on' if engine.async_steps.enabled else 'off'}")
    for kind, s in summary.items():
        step_ms = s["seconds"] / s["steps"] * 1e3
        print(f"  {kind:<14} {s['tok_s']:8.1f} out tok/s  ({ratios[kind]:6.1%} of the round's "
              f"unconstrained)  {s['steps']:4d} steps  constraints' host time "
              f"{s['host_ms_per_step']:.2f} ms/step ({s['host_ms_per_step'] / step_ms:.1%})  "
              f"{s['cpu_ms_per_token']:.1f} CPU ms/token" + "".join(
                  f"\n  {'':<14} {name} {ms:.2f} ms/step"
                  for name, ms in s["host_parts_ms_per_step"].items()))
    q = percentiles(compile_ms, (50, 99))
    print(f"  compile per new schema: P50 {q['p50']:.1f} ms, P99 {q['p99']:.1f} ms "
          f"({len(compile_ms)} schemas)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "device": engine.plan.device, "requests": n,
                       "async_steps": engine.async_steps.enabled,
                       "new_tokens": m, "rounds": results, "compile_ms": compile_ms,
                       "compile_p50_ms": q["p50"], "compile_p99_ms": q["p99"],
                       "mean_compile_ms": statistics.mean(compile_ms)}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
