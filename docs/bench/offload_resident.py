"""Are the resident layers of an ``offload-weights`` build slowed by the copies streaming
beside them? Both builds alive in one process (LLaMA-2-13B shape, bf16): (a) every layer
on the GPU and (b) ``device_memory=16GiB``, both under their CUDA graphs (b's graphs hold
its copies); the first k layers (b's resident ones) timed inside the replays (timing events
captured into the graphs, ``layer_clock.GraphSpanClock``), a round of (a) then a round of
(b), several rounds. In the same run: TPOT of both, the bound of (b) (bytes copied a step
over the pinned host-to-device bandwidth measured here) and whether their greedy tokens
are equal. ``--eager``: also the eager arms (CUDA events around the layers), with a third
in which (b)'s copies are skipped (timing only).

    python3 docs/bench/offload_resident.py OUT [--rounds 4] [--batches 1,64] [--eager]
    python3 docs/bench/offload_resident.py OUT --smoke    # a tiny model on the CPU (eager)
"""
import argparse
import contextlib
import json
import statistics
import sys
from pathlib import Path

import torch

from infergraft import core
from infergraft.core.tools.bench import bench_ours
from infergraft.core.tools.plan_offload import host_to_device_bandwidth
from infergraft.core.tools.provenance import provenance

sys.path.insert(0, str(Path(__file__).parent))
from layer_clock import GraphSpanClock, greedy, layer_times  # noqa: E402
from offload_weights import LLAMA2_13B, TINY, eager, hf_model  # noqa: E402


@contextlib.contextmanager
def no_copies(streamer, skip: bool):
    """With ``skip``: no copy is issued (the streamed layers compute on stale slots: for
    timing only, to tell the copies' cost to the resident layers from the rest)."""
    if not skip:
        yield
        return
    streamer._fill = lambda s, j: None
    try:
        yield
    finally:
        del streamer._fill  # the class's method again; holds still says what each slot has


def ms(xs) -> str:
    return " ".join(f"{1e3 * t:.2f}" for t in xs)


def graph_arms(a, b, k, batches, prompts, args, result) -> list[str]:
    clocks = {"a": GraphSpanClock(a, 0, k), "b": GraphSpanClock(b, 0, k)}
    bw, how = host_to_device_bandwidth("cuda", 256 << 20, repeats=5)
    bound = b.plan.weight_placement.copied_bytes / bw
    result.update(h2d_bandwidth=bw, h2d_measured=how, bound_ms=1e3 * bound)
    rows = []
    for batch in batches:
        times = {"a": [], "b": []}
        for _ in range(args.rounds):  # the median replay of each round
            for name in ("a", "b"):
                times[name].append(statistics.median(
                    clocks[name].times(prompts[batch], args.new_tokens)))
        toks = {n: greedy(e, prompts[batch], args.new_tokens) for n, e in (("a", a), ("b", b))}
        tpot = {n: bench_ours(e, prompts[batch], args.new_tokens, warmup=1, repeats=2)[1]
                for n, e in (("a", a), ("b", b))}
        ma, mb = statistics.median(times["a"]), statistics.median(times["b"])
        result[f"graphs_{batch}"] = dict(resident_a=times["a"], resident_b=times["b"],
                                         tpot_a=tpot["a"], tpot_b=tpot["b"],
                                         tokens_equal=toks["a"] == toks["b"])
        rows.append(f"| {batch} | {1e3 * ma:.2f} | {1e3 * mb:.2f} | {mb / ma:.3f} | "
                    f"{ms(times['a'])} | {ms(times['b'])} | {1e3 * tpot['a']:.2f} | "
                    f"{1e3 * tpot['b']:.1f} | {1e3 * bound:.1f} | {bound / tpot['b']:.0%} | "
                    f"{'yes' if toks['a'] == toks['b'] else 'NO'} |")
    return [f"under CUDA graphs: first {k} layers (b's resident ones), ms a decode step, "
            f"median of {args.rounds} interleaved rounds; host->device {bw / 1e9:.1f} GB/s",
            "| batch | (a) all on the GPU | (b) offload-weights | (b) / (a) | (a) rounds | "
            "(b) rounds | (a) TPOT ms | (b) TPOT ms | bound ms | bound / (b) TPOT | "
            "tokens (b) = (a) |", "|---|---|---|---|---|---|---|---|---|---|---|", *rows]


def eager_arms(a, b, k, batches, prompts, args, result, cuda) -> list[str]:
    eager(a), eager(b)
    rows = []
    for batch in batches:
        times = {"a": [], "b": [], "b_no_copies": []}
        for _ in range(args.rounds):
            for name, engine in (("a", a), ("b", b), ("b_no_copies", b)):
                with no_copies(b.model.streamer, name == "b_no_copies"):
                    times[name].append(layer_times(engine, prompts[batch], args.new_tokens,
                                                   cuda, {"resident": (0, k)})["resident"])
        result[f"eager_{batch}"] = times
        ma, mb, mc = (statistics.median(times[n]) for n in ("a", "b", "b_no_copies"))
        rows.append(f"| {batch} | {1e3 * ma:.2f} | {1e3 * mb:.2f} | {mb / ma:.2f} | "
                    f"{1e3 * mc:.2f} | {ms(times['a'])} | {ms(times['b'])} |")
    return [f"eager: first {k} layers (b's resident ones), ms a decode step, median of "
            f"{args.rounds} interleaved rounds",
            "| batch | (a) all on the GPU | (b) offload-weights | (b) / (a) | "
            "(b), its copies skipped (timing only) | (a) rounds | (b) rounds |",
            "|---|---|---|---|---|---|---|", *rows]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--batches", default="1,64")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--eager", action="store_true", help="also the eager arms")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    cuda = not args.smoke
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    shape = TINY if args.smoke else LLAMA2_13B
    batches = [min(int(x), 4) if args.smoke else int(x) for x in args.batches.split(",")]
    kw = dict(dtype=dtype, device=device, max_batch_size=max(batches), max_seq_len=64,
              max_num_batched_tokens=2048)
    hf = hf_model(shape, device, dtype)
    a = core.build(hf, plugins=["paged"], **kw)
    budget = "16GiB" if cuda else "6.6MiB"
    b = core.build(hf, plugins=["offload-weights", "paged"], device_memory=budget, **kw)
    k = len(b.plan.weight_placement.resident)
    g = torch.Generator().manual_seed(0)
    prompts = {x: torch.randint(10, shape["vocab_size"] - 1, (x, 32), generator=g).tolist()
               for x in batches}
    result = {"resident_layers": k, "budget": budget, "shape": shape,
              "provenance": provenance()}
    tables = graph_arms(a, b, k, batches, prompts, args, result) if cuda else []
    if args.eager or not cuda:
        tables += ["", *eager_arms(a, b, k, batches, prompts, args, result, cuda)]
    table = "\n".join(tables)
    print(table, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "offload_resident.json").write_text(json.dumps(result, indent=2, default=str))
    (out / "offload_resident.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
