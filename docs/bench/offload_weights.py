"""CPU+GPU weight placement on one GPU (issue 26): a LLaMA-2-13B-shaped bf16 model
(26 GB) under a 16 GiB device budget (``plugins=["offload-weights"]``), against the same
weights all on the GPU, in one process:

    python3 docs/bench/offload_weights.py OUT [--budget 16GiB] [--new-tokens 16]
    python3 docs/bench/offload_weights.py OUT --smoke   # a tiny model on the CPU, same path

1) random weights built on the GPU (HF ``from_config`` under ``torch.device``: no 13B CPU
   init); 2) the pinned host->device bandwidth, best of several 256 MiB copies timed by
   CUDA events; 3) (a) every layer on the GPU: greedy tokens of a few batch-1 prompts and
   one batch of 64, TPOT at batch 1 and 64 under CUDA graphs and eagerly, every layer's
   time (CUDA events, eager); (a) freed; 4) (b) the same in-memory weights with
   ``device_memory=16GiB``: the same tokens, TPOT, the time of its resident layers against
   the same layers of (a), the device memory it holds; the bound = bytes copied a step /
   the measured bandwidth, and bound / TPOT. Prints a markdown table and writes
   OUT/offload_weights.json (rewritten after each phase, so a crash keeps what was done).
"""
import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))  # offload_hf.py, layer_clock.py beside it
from layer_clock import greedy, layer_times  # noqa: E402

from infergraft import core
from infergraft.core.tools.bench import bench_ours
from infergraft.core.tools.plan_offload import host_to_device_bandwidth
from infergraft.core.tools.provenance import provenance
from infergraft.core.units import fmt_bytes, parse_bytes
from infergraft.plugins.offload_weights import layer_sizes

LLAMA2_13B = dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                  num_attention_heads=40, num_key_value_heads=40, vocab_size=32000,
                  max_position_embeddings=4096)
TINY = dict(hidden_size=64, intermediate_size=112, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=512)
BATCH_PROMPTS = 3  # batch-1 prompts compared token by token


def hf_model(shape: dict, device, dtype):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(**shape, rms_norm_eps=1e-5, tie_word_embeddings=False)
    cfg.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()


def eager(engine):
    """The engine without its CUDA graphs (decode, prefill, mixed steps)."""
    engine.decode_graphs = engine.prefill_graphs = None
    engine.runner.step_graphs = None
    return engine


def kv_device_bytes(engine) -> int:
    backend = core.get_plugin_manager().cache_backends().get(engine.plan.cache_backend)
    return getattr(backend, "device_bytes", lambda p: p.kv_bytes_total)(engine.plan)


def hf_baseline(result, b_eng, shape, device, dtype, k, prompts, log) -> None:
    """HF + accelerate with the same layers on the GPU (docs/bench/offload_hf.py)."""
    from offload_hf import dispatch, hf_offloaded_tpot

    hf = dispatch(hf_model(shape, device, dtype), k)  # the same seed: the same weights
    for b, batch in prompts.items():
        tpot = hf_offloaded_tpot(hf, batch)
        result.setdefault("hf", {})[f"tpot_ms_{b}"] = 1e3 * tpot
        log(f"HF + accelerate offload, batch {b}: TPOT {1e3 * tpot:.1f} ms")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--budget", default="16GiB", help="device_memory of the offloaded build")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--batches", default="1,64")
    p.add_argument("--repeats", type=int, default=2, help="timed runs for each TPOT")
    p.add_argument("--smoke", action="store_true", help="a tiny model on the CPU")
    args = p.parse_args(argv)
    cuda = not args.smoke
    if cuda and not torch.cuda.is_available():
        raise SystemExit("needs CUDA (or --smoke for the CPU path)")
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    shape = TINY if args.smoke else LLAMA2_13B
    batches = [int(b) for b in args.batches.split(",")]
    if args.smoke:
        batches = [min(b, 4) for b in batches]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    kw = dict(dtype=dtype, device=device, max_batch_size=max(batches),
              max_seq_len=args.prompt_len + args.new_tokens + 16,
              max_num_batched_tokens=max(2048, max(batches) * args.prompt_len))
    g = torch.Generator().manual_seed(0)
    vocab = shape["vocab_size"]
    prompts = {b: torch.randint(10, vocab - 1, (b, args.prompt_len), generator=g).tolist()
               for b in batches}
    solo = [torch.randint(10, vocab - 1, (args.prompt_len,), generator=g).tolist()
            for _ in range(BATCH_PROMPTS)]
    result = {"shape": shape, "dtype": str(dtype), "device": device, "budget": args.budget,
              "new_tokens": args.new_tokens, "prompt_len": args.prompt_len, "batches": batches,
              "provenance": provenance(), "a": {}, "b": {}}

    def save():
        (out / "offload_weights.json").write_text(json.dumps(result, indent=2, default=str))

    def log(msg):
        print(f"[{time.perf_counter() - t0:6.1f} s] {msg}", flush=True)

    t0 = time.perf_counter()
    # 1) weights, 2) the bandwidth the bound is set by
    hf = hf_model(shape, device, dtype)
    log(f"HF model on {device}: {sum(x.numel() for x in hf.parameters()) / 1e9:.2f} B params")
    reps = []
    for _ in range(3):
        bw, how = host_to_device_bandwidth(device, 256 << 20, repeats=5)
        reps.append(bw)
    result["h2d_bandwidth"] = max(reps)
    result["h2d_bandwidth_reps"] = reps
    result["h2d_measured"] = how
    log(f"host->device {max(reps) / 1e9:.1f} GB/s ({how}; reps {[f'{r / 1e9:.1f}' for r in reps]})")

    # 3) (a): every layer on the GPU
    a = core.build(hf, plugins=["paged"], **kw)
    log(f"(a) built in {a.build_seconds:.1f} s; weights {fmt_bytes(a.plan.weight_bytes)}")
    tokens_a = {"solo": [greedy(a, [s], args.new_tokens)[0] for s in solo]}
    for b in batches:
        tokens_a[b] = greedy(a, prompts[b], args.new_tokens)
        _, tpot, _, _ = bench_ours(a, prompts[b], args.new_tokens, warmup=1, repeats=args.repeats)
        result["a"][f"tpot_ms_{b}"] = 1e3 * tpot
        log(f"(a) batch {b}: TPOT {1e3 * tpot:.2f} ms (CUDA graphs where on)")
    eager(a)
    tokens_a_eager = {"solo": [greedy(a, [s], args.new_tokens)[0] for s in solo]}
    layers_a = {}
    n = shape["num_hidden_layers"]
    for b in batches:
        tokens_a_eager[b] = greedy(a, prompts[b], args.new_tokens)
        _, tpot, _, _ = bench_ours(a, prompts[b], args.new_tokens, warmup=1, repeats=args.repeats)
        result["a"][f"tpot_eager_ms_{b}"] = 1e3 * tpot
        layers_a[b] = layer_times(a, prompts[b], args.new_tokens, cuda,
                                  {k: (0, k) for k in range(1, n + 1)})  # first k layers
        log(f"(a) eager batch {b}: TPOT {1e3 * tpot:.2f} ms; all layers "
            f"{1e3 * layers_a[b][n]:.2f} ms")
    need_all = a.plan.weight_bytes + kv_device_bytes(a) + a.plan.activation_bytes
    layer_bytes = sum(layer_sizes(a.spec, dtype.itemsize)[0])
    result["a"]["device_bytes_planned"] = need_all
    save()
    del a
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    # what (a) left on the device besides the HF weights (b) is built from: not (b)'s
    left = max(0, torch.cuda.memory_allocated() - sum(
        t.untyped_storage().nbytes() for t in [*hf.parameters(), *hf.buffers()])) if cuda else 0

    # 4) (b): the layers beyond the budget in host memory
    # (the smoke model's budget: short of a third of its layers, so that some stream)
    budget = parse_bytes(args.budget) if not args.smoke else need_all - layer_bytes // 3
    b_eng = core.build(hf, plugins=["offload-weights", "paged"], device_memory=budget, **kw)
    placement = b_eng.plan.weight_placement
    st = b_eng.model.streamer
    k = len(placement.resident)
    del hf  # (b) keeps the resident tensors it adopted; the rest goes
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    held = torch.cuda.memory_allocated() - left if cuda else None
    log(f"(b) built in {b_eng.build_seconds:.1f} s: {k} layers resident, "
        f"{len(placement.streamed)} streamed, {fmt_bytes(placement.copied_bytes)} copied a step; "
        f"device holds {fmt_bytes(held) if held is not None else '-'} of {fmt_bytes(budget)}")
    print(b_eng.plan, flush=True)
    layer_bw = None
    if cuda and st is not None:  # the streamer's own copy: a layer's host buffer into a slot
        src, dst = st.host[0], st.slots[0][:st.host[0].numel()]
        times = []
        for _ in range(5):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            dst.copy_(src, non_blocking=True)
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1) / 1e3)
        st.holds = [None] * st.ring_size  # slot 0 overwritten: refilled before its next use
        layer_bw = src.numel() / min(times)
        log(f"a layer's copy from its pinned host buffer: {layer_bw / 1e9:.1f} GB/s "
            f"(pinned: {st.pinned})")
    result["b"].update(resident=list(placement.resident), streamed=list(placement.streamed),
                       copied_bytes=placement.copied_bytes, ring_bytes=placement.ring_bytes,
                       device_weight_bytes=b_eng.plan.device_weight_bytes, budget=budget,
                       device_allocated_after_build=held, left_by_a=left,
                       layer_copy_bandwidth=layer_bw,
                       pinned=st.pinned if st is not None else None)
    save()
    bound = placement.copied_bytes / result["h2d_bandwidth"]
    rows = []
    same_solo = [greedy(b_eng, [s], args.new_tokens)[0] for s in solo]
    result["b"]["tokens_equal_solo"] = same_solo == tokens_a["solo"]
    result["b"]["tokens_equal_solo_eager"] = same_solo == tokens_a_eager["solo"]
    for b in batches:
        toks = greedy(b_eng, prompts[b], args.new_tokens)
        equal, equal_eager = toks == tokens_a[b], toks == tokens_a_eager[b]
        differ = sum(x != y for r, q in zip(toks, tokens_a[b]) for x, y in zip(r, q))
        _, tpot, pct, _ = bench_ours(b_eng, prompts[b], args.new_tokens, warmup=1,
                                  repeats=args.repeats)
        # eager (b) only: under graphs the resident layers are timed inside the replays by
        # offload_resident.py, both builds alive
        spans = layer_times(b_eng, prompts[b], args.new_tokens, cuda, {"resident": (0, k)}) \
            if k and b_eng.decode_graphs is None else {}
        resident_b, resident_a = (spans["resident"], layers_a[b][k]) if spans else (0.0, 0.0)
        r = dict(tpot_ms=1e3 * tpot, tpot_p90_ms=1e3 * pct["p90"], bound_ms=1e3 * bound,
                 bound_over_tpot=bound / tpot, tokens_equal=equal, tokens_equal_eager=equal_eager,
                 tokens_differing=differ, resident_ms=1e3 * resident_b,
                 resident_a_ms=1e3 * resident_a,
                 resident_ratio=resident_b / resident_a if resident_a else None)
        result["b"][str(b)] = r
        rows.append((b, r))
        log(f"(b) batch {b}: TPOT {r['tpot_ms']:.1f} ms, bound {r['bound_ms']:.1f} ms "
            f"({r['bound_over_tpot']:.0%}); tokens equal {equal} (eager (a): {equal_eager}); "
            f"resident layers {r['resident_ms']:.2f} ms vs {r['resident_a_ms']:.2f} ms in (a)")
        save()
    if cuda:
        result["b"]["device_peak_allocated"] = torch.cuda.max_memory_allocated() - left
        hf_baseline(result, b_eng, shape, device, dtype, k, prompts, log)
    save()
    head = ["batch", "(a) TPOT ms", "(a) eager TPOT ms", "(b) TPOT ms", "bound ms", "bound / TPOT",
            "HF + accelerate offload TPOT ms", "tokens = (a)", f"resident {k} layers (b) / (a) ms"]
    hf_ms = result.get("hf", {})
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for b, r in rows:
        lines.append("| " + " | ".join([
            str(b), f"{result['a'][f'tpot_ms_{b}']:.2f}", f"{result['a'][f'tpot_eager_ms_{b}']:.2f}",
            f"{r['tpot_ms']:.1f}", f"{r['bound_ms']:.1f}", f"{r['bound_over_tpot']:.0%}",
            f"{hf_ms[f'tpot_ms_{b}']:.1f}" if f"tpot_ms_{b}" in hf_ms else "-",
            "yes" if r["tokens_equal"] else f"NO ({r['tokens_differing']} differ)",
            f"{r['resident_ms']:.2f} / {r['resident_a_ms']:.2f}" if r["resident_ratio"]
            else "offload_resident.py"]) + " |")
    peak = result["b"].get("device_peak_allocated")
    lines.append(f"\nbatch-1 prompts equal: {result['b']['tokens_equal_solo']} "
                 f"({BATCH_PROMPTS} prompts); host->device {result['h2d_bandwidth'] / 1e9:.1f} GB/s "
                 f"({how}); {len(placement.streamed)} of {n} layers streamed, "
                 f"{fmt_bytes(placement.copied_bytes)} a step; device peak "
                 f"{fmt_bytes(peak) if peak else '-'} (budget {fmt_bytes(budget)})")
    print("\n".join(lines), flush=True)
    (out / "offload_weights.md").write_text("\n".join(lines) + "\n")
    log(f"wrote {out / 'offload_weights.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
