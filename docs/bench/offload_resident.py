"""Are the resident layers of an ``offload-weights`` build slowed by the copies streaming
beside them? Both builds alive in one process (LLaMA-2-13B shape, bf16): (a) every layer
on the GPU, eager, and (b) ``device_memory=16GiB``; their first k layers (b's resident
ones) timed by CUDA events, a round of (a) then a round of (b), several rounds, so that
drift of the host (eager decode is launch-bound) hits both alike.

    python3 docs/bench/offload_resident.py OUT [--rounds 4] [--batches 1,64]
    python3 docs/bench/offload_resident.py OUT --smoke    # a tiny model on the CPU
"""
import argparse
import contextlib
import json
import statistics
import sys
from pathlib import Path

import torch

from infergraft import core

sys.path.insert(0, str(Path(__file__).parent))
from layer_clock import layer_times  # noqa: E402
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--batches", default="1,64")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    cuda = not args.smoke
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    shape = TINY if args.smoke else LLAMA2_13B
    batches = [min(int(b), 4) if args.smoke else int(b) for b in args.batches.split(",")]
    kw = dict(dtype=dtype, device=device, max_batch_size=max(batches), max_seq_len=64,
              max_num_batched_tokens=2048)
    hf = hf_model(shape, device, dtype)
    a = eager(core.build(hf, plugins=["paged"], **kw))
    budget = "16GiB" if cuda else "6.6MiB"
    b = core.build(hf, plugins=["offload-weights", "paged"], device_memory=budget, **kw)
    k = len(b.plan.weight_placement.resident)
    g = torch.Generator().manual_seed(0)
    rows, result = [], {"resident_layers": k, "budget": budget, "shape": shape}
    for batch in batches:
        prompts = torch.randint(10, shape["vocab_size"] - 1, (batch, 32), generator=g).tolist()
        times = {"a": [], "b": [], "b_no_copies": []}
        for _ in range(args.rounds):
            for name, engine in (("a", a), ("b", b), ("b_no_copies", b)):
                with no_copies(b.model.streamer, name == "b_no_copies"):
                    times[name].append(layer_times(engine, prompts, args.new_tokens, cuda,
                                                   {"resident": (0, k)})["resident"])
        result[str(batch)] = times
        ma, mb, mc = (statistics.median(times[n]) for n in ("a", "b", "b_no_copies"))
        rows.append(f"| {batch} | {1e3 * ma:.2f} | {1e3 * mb:.2f} | {mb / ma:.2f} | "
                    f"{1e3 * mc:.2f} | "
                    f"{' '.join(f'{1e3 * t:.1f}' for t in times['a'])} | "
                    f"{' '.join(f'{1e3 * t:.1f}' for t in times['b'])} |")
    table = "\n".join([f"first {k} layers (b's resident ones), ms a decode step, median of "
                       f"{args.rounds} interleaved rounds",
                       "| batch | (a) all on the GPU | (b) offload-weights | (b) / (a) | "
                       "(b), its copies skipped (timing only) | (a) rounds | (b) rounds |",
                       "|---|---|---|---|---|---|---|", *rows])
    print(table, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "offload_resident.json").write_text(json.dumps(result, indent=2))
    (out / "offload_resident.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
