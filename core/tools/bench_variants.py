"""``infergraft bench --compare-plugins int8,int4``: our engine built again with each of
those plugin sets added to ``--plugins`` (several in one set joined by ``+``, e.g.
``int8+kv-int8``), on the same HF weights in the same run, one build alive at a time; each
row's roofline counts that build's own bytes (packed weights, its K/V format)."""
from __future__ import annotations

import argparse
import gc
import sys

import torch

from ..errors import PlanError
from .bench import run_benchmark

BASE = "infergraft"


def parse_variants(text: str) -> list[list[str]]:
    """'int8,int4+kv-int8' -> [['int8'], ['int4', 'kv-int8']] (argparse type)."""
    sets = [[n for n in part.split("+") if n] for part in text.split(",") if part]
    if any(not s for s in sets) or len({tuple(s) for s in sets}) < len(sets):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma list of distinct plugin sets (plugins of one set "
            "joined by +), e.g. int8,int4 or int8+kv-int8")
    return sets


def check_quantizers(plugins) -> None:
    """PlanError naming --plugins where a set names two quantisers of one kind (weights,
    or K/V), as build would refuse it."""
    from ..plugin_manager import get_plugin_manager

    kinds = {q.name: q.applies_to for q in get_plugin_manager().quantizers()}
    for kind in ("weights", "kv"):
        named = [p for p in plugins if kinds.get(p) == kind]
        if len(named) > 1:
            raise PlanError(f"--plugins {','.join(plugins)}: two {kind} quantizers, "
                            f"{named[0]!r} and {named[1]!r}; choose one")


def variant_name(plugins) -> str:
    return "+".join([BASE, *plugins])


def run_variants(hf, build_variant, args, bandwidth: float) -> list:
    """Results of our engine for each of ``args.compare_plugins`` (``build_variant(plugins)``
    builds it), system named ``infergraft+<plugins>``, timed as bench's first build was."""
    def log(msg):
        print(msg, file=sys.stderr)
    batches, prompt_len, new_tokens = args.batches, args.prompt_len, args.new_tokens
    results = []
    for plugins in args.compare_plugins:
        engine = build_variant(plugins)
        log(f"{variant_name(plugins)}:\n{engine.plan}")
        rows, _ = run_benchmark(hf, engine, batches, prompt_len, new_tokens, (BASE,),
                                bandwidth=bandwidth, log=log)
        for r in rows:
            r.system = variant_name(plugins)
        results += rows
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return results


def variants_table(results) -> str:
    """Per batch and build of ours: TPOT, TTFT, its own roofline and the fraction reached,
    and TPOT against the first build's (``--plugins`` alone)."""
    ours = [r for r in results if r.system.startswith(BASE)]
    by = {(r.system, r.batch): r for r in ours}
    head = ["batch", "build", "TPOT ms", "TTFT ms", "its roofline ms", "roofline / TPOT",
            f"TPOT vs {BASE}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in sorted(ours, key=lambda r: (r.batch, r.system != BASE, r.system)):
        base = by.get((BASE, r.batch))
        lines.append("| " + " | ".join([
            str(r.batch), r.system, f"{r.tpot_ms:.3f}", f"{r.ttft_ms:.1f}",
            f"{r.roofline_ms:.3f}", f"{r.roofline_fraction:.0%}",
            f"{r.tpot_ms / base.tpot_ms:.2f}x" if base else "-"]) + " |")
    return "\n".join(lines)
