"""``infergraft bench throughput``'s K/V memory side: the base run's cache and preemption
flags (passed to ``core.build`` only when given), and what each run of our engine records
besides its timings.

- ``kv``: ``engine.stats()`` over the measured requests: its counters (prefix-cache
  queries and hits, prompt tokens looked up and found; preemptions, swapped out and
  recomputed) as counted after the warm-up, so the warm-up's own request is not in them;
  the pool's blocks (total, free) and the requests running and waiting at the end; the
  hit rate, hits / queries.
- ``device``: steps replayed from CUDA graphs by kind, and the CUDA caching allocator's
  retries and OOMs, over the measured requests; its peak reserved bytes.
- ``full_length``: every request finished with all the tokens it asked for (EOS ignored).
- ``alone`` (``--check-alone K``): K requests, spread over the run, generated again one at
  a time on the same engine after it: whether each got the same tokens in the batch as
  alone (greedy), the target of a run whose pool is short (preempted requests resume).
"""
from __future__ import annotations

import argparse

import torch

from ..preemption import MODES
from ..request import SamplingParams
from .bench_cli import _positive
from .serve_offline import offline_summary

COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions",
            "num_swapped_out", "num_recomputed")
GAUGES = ("kv_blocks_total", "kv_blocks_free", "num_running", "num_waiting")
PEAKS = ("reserved_bytes_peak",)  # device_counts' gauges (the others are counted over a run)
BUILD_FLAGS = ("num_blocks", "block_size", "gpu_memory_utilization", "preemption")


def _fraction(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        x = 0.0
    if not 0 < x <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction in (0, 1], e.g. 0.9")
    return x


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-blocks", type=_positive, default=None,
                   help="paged cache: K/V blocks in the pool (default: sized to the device)")
    p.add_argument("--block-size", type=_positive, default=None,
                   help="paged cache: tokens a K/V block (default: the cache's)")
    p.add_argument("--gpu-memory-utilization", type=_fraction, default=None,
                   help="paged cache: the share of the device the pool is sized within")
    p.add_argument("--preemption", choices=MODES, default=None,
                   help="how a request is preempted where the pool is short: swap its "
                        "blocks to host memory, recompute them, or auto (the cheaper)")
    p.add_argument("--check-alone", type=_positive, default=None, metavar="K",
                   help="after each run of ours, K of its requests again one at a time on "
                        "the same engine: whether each gets the tokens it got in the batch")


def base_options(args) -> dict:
    """The build options of the base run that were given: {num_blocks: 512, ...}."""
    return {k: getattr(args, k) for k in BUILD_FLAGS if getattr(args, k) is not None}


def measured_run(engine, requests, after_warm_up=None, check_alone: int | None = None,
                 after_run=None) -> dict:
    """``offline_summary`` of ``requests`` on ``engine``, with ``kv``, ``full_length``
    and (``check_alone`` K) ``alone`` as the module says; ``after_run()``, if given, is
    called once the requests have finished, before anything else runs on the engine."""
    seen = Recording(engine)
    before, device_before = {}, {}

    def warmed_up():
        before.update(engine.stats())
        device_before.update(device_counts(engine))
        seen.seqs = []  # from here on: the measured requests, in order
        if after_warm_up is not None:
            after_warm_up()
    summary = offline_summary(seen, requests, None, after_warm_up=warmed_up)
    if after_run is not None:
        after_run()
    summary["kv"] = run_stats(before, engine.stats())
    after = device_counts(engine)
    summary["device"] = {k: v if k in PEAKS else v - device_before.get(k, 0)
                         for k, v in after.items()}
    summary["full_length"] = len(seen.seqs) == len(requests) and all(
        len(s.output_ids) == r.output_len for s, r in zip(seen.seqs, requests))
    if check_alone:
        summary["alone"] = alone(engine, requests, seen.seqs, check_alone)
    return summary


def device_counts(engine) -> dict:
    """Steps replayed from CUDA graphs, by kind, and on CUDA the caching allocator's
    retries (each frees its cached blocks and synchronises: what a pool that leaves the
    allocator too little costs every step), OOMs and peak reserved bytes."""
    runner = engine.runner
    out = {f"{kind}_graph_replays": getattr(getattr(runner, f"{kind}_graphs"), "replays", 0)
           for kind in ("decode", "step", "prefill")}
    if engine.device.type == "cuda":
        stats = torch.cuda.memory_stats(engine.device)
        out.update(alloc_retries=stats.get("num_alloc_retries", 0),
                   ooms=stats.get("num_ooms", 0),
                   reserved_bytes_peak=stats.get("reserved_bytes.all.peak", 0))
    return out


class Recording:
    """``engine`` as offline_summary uses it, keeping each sequence it is given."""

    def __init__(self, engine):
        self.engine, self.seqs = engine, []

    def add_request(self, *args, **kwargs):
        seq = self.engine.add_request(*args, **kwargs)
        self.seqs.append(seq)
        return seq

    def __getattr__(self, name):
        return getattr(self.engine, name)


def run_stats(before: dict, after: dict) -> dict:
    """``engine.stats()``'s counters from ``before`` to ``after``, its gauges at ``after``,
    and the prefix cache's hit rate (None where nothing was looked up)."""
    out = {k: after.get(k, 0) - before.get(k, 0) for k in COUNTERS}
    out.update({k: after.get(k, 0) for k in GAUGES})
    queries = out["prefix_cache_queries"]
    out["prefix_cache_hit_rate"] = out["prefix_cache_hits"] / queries if queries else None
    return out


def alone(engine, requests, seqs, k: int) -> dict:
    """``k`` of ``requests`` (evenly spread, the first and the last among them) generated
    again one at a time on ``engine``; ``seqs``: their sequences in the batch. {checked,
    equal, requests: the indices, mismatches: [{request, position}]} (position: the first
    token that differs, or the shorter one's length)."""
    n = len(requests)
    k = min(k, n)
    picked = sorted({round(i * (n - 1) / max(1, k - 1)) for i in range(k)})
    mismatches = []
    for i in picked:
        r = requests[i]
        seq = engine.add_request(list(r.prompt), SamplingParams(
            max_new_tokens=r.output_len, ignore_eos=True))
        while not seq.finished:
            engine.step()
        got, want = list(seq.output_ids), list(seqs[i].output_ids)
        if got != want:
            at = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b),
                      min(len(got), len(want)))
            mismatches.append({"request": i, "position": at})
    return {"checked": len(picked), "equal": len(picked) - len(mismatches),
            "requests": picked, "mismatches": mismatches}
