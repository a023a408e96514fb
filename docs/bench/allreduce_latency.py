"""What tp's all-reduce costs at decode sizes, before building a one-shot all-reduce:
``torchrun --nproc-per-node 2 docs/bench/allreduce_latency.py OUT.json`` (2 x H200,
NCCL; ``--device cpu``: gloo, how the script is tested).

Each rank all-reduces a bf16 [rows, hidden] tensor, rows the decode batch (1 ... 64) and
hidden 4096 (7B) / 8192 (70B): timed eagerly (a host launch per call), and on CUDA as a
graph of CALLS calls (what a decode graph holds: two a layer). Beside each, a copy of
the same bytes on one GPU: about what a one-shot all-reduce (every rank reads its peers'
buffers over NVLink, once) costs at least. Rank 0 writes the JSON and prints, per call,
the microseconds and the share of a step of CALLS such calls.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

from infergraft.core.distributed.failure import leave_group
from infergraft.core.tools.bench import timings

ROWS = (1, 8, 32, 64)
HIDDEN = (4096, 8192)
CALLS = 64  # all-reduces in a LLaMA-2-7B decode step at tp 2 (o and down, 32 layers)


def timed(fn, repeats: int, device) -> float:
    """Median seconds of ``fn`` over ``repeats`` (a latency: the median, not the best)."""
    return statistics.median(timings(device, fn, repeats))


def measure(device, rows=ROWS, hidden=HIDDEN, repeats: int = 20) -> list[dict]:
    """One row per (rows, hidden): microseconds per all-reduce, eager and (CUDA) graphed,
    and per same-size copy; every rank runs it, in step."""
    out = []
    for h in hidden:
        for r in rows:
            x = torch.randn(r, h, device=device, dtype=torch.bfloat16)
            y = torch.empty_like(x)
            row = {"rows": r, "hidden": h, "bytes": x.numel() * x.element_size()}
            dist.barrier()
            reduce_calls = lambda: [dist.all_reduce(x) for _ in range(CALLS)]  # noqa: E731
            reduce_calls()  # warm-up (NCCL sets up its channels on the first call)
            row["eager_us"] = timed(reduce_calls, repeats, device) / CALLS * 1e6
            row["copy_us"] = timed(lambda: [y.copy_(x) for _ in range(CALLS)], repeats,
                                   device) / CALLS * 1e6
            if device.type == "cuda":
                row["graph_us"] = _graphed(reduce_calls, repeats, device) / CALLS * 1e6
            out.append(row)
    return out


def _graphed(calls, repeats: int, device) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        calls()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    graph.replay()
    return timed(graph.replay, repeats, device)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="JSON written by rank 0")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))  # torchrun's
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    rows = measure(device, repeats=args.repeats)
    if dist.get_rank() == 0:
        report(rows, dist.get_world_size(), args.out, device)
    dist.barrier()
    leave_group()
    return 0


def report(rows: list[dict], world: int, out: str, device) -> None:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    json.dump({"world_size": world, "device": name, "calls_a_step": CALLS,
               "torch": torch.__version__, "rows": rows}, open(out, "w"), indent=1)
    print(f"all-reduce of bf16 [rows, hidden] across {world} ranks ({name}); per call, us; "
          f"'step' = {CALLS} calls")
    print("| rows | hidden | KiB | eager us | graph us | copy us | graphed step ms |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        graph = r.get("graph_us")
        step = "-" if graph is None else f"{graph * CALLS / 1e3:.3f}"
        print(f"| {r['rows']} | {r['hidden']} | {r['bytes'] / 1024:.0f} | {r['eager_us']:.1f} "
              f"| {'-' if graph is None else f'{graph:.1f}'} | {r['copy_us']:.1f} | {step} |")


if __name__ == "__main__":
    sys.exit(main())
