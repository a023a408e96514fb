"""``--compare-plugins int8,int4`` of ``infergraft bench`` and ``infergraft bench
throughput``: our engine built again with each of those plugin sets added to ``--plugins``
(several in one set joined by ``+``, e.g. ``int8+kv-int8``), on the same HF weights in the
same run, one build alive at a time. In ``bench`` each row's roofline counts that build's
own bytes (packed weights, its K/V format); in ``bench throughput`` each set runs the base
run's requests and its output tok/s is set against the base run's."""
from __future__ import annotations

import argparse
import gc
import sys

import torch

from ..errors import InfergraftError, PlanError
from ..plugin_manager import get_plugin_manager
from ..selection import select_plugins
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


def add_variants_argument(p: argparse.ArgumentParser, what: str) -> None:
    """``--compare-plugins SETS``; ``what``: what each set's run is measured against."""
    p.add_argument("--compare-plugins", type=parse_variants, default=[], metavar="SETS",
                   help="our engine again with each plugin set added to --plugins, in the "
                        "same run (sets comma-separated, plugins of one set joined by +), "
                        f"e.g. int8,int4 or int8+kv-int8; {what}")


def engine_plugins(device, plugins) -> list[str]:
    """Our engine's plugins: the paged cache on CUDA, then ``plugins``."""
    return (["paged"] if str(device).startswith("cuda") else []) + list(plugins)


def check_plugins(device, plugins, flags: str | None = None) -> None:
    """PlanError naming ``flags`` (default ``--plugins ...``) for a plugin list build would
    refuse, resolved as it resolves the names it will be given (``engine_plugins``)."""
    try:
        select_plugins(get_plugin_manager(), engine_plugins(device, plugins))
    except InfergraftError as e:
        raise PlanError(f"{flags or '--plugins ' + ','.join(plugins)}: {e}") from None


def check_quantizers(plugins, flags: str | None = None) -> None:
    """PlanError naming ``flags`` (default ``--plugins ...``) where a set names two
    quantisers of one kind (weights, or K/V), as build would refuse it."""
    kinds = {q.name: q.applies_to for q in get_plugin_manager().quantizers()}
    for kind in ("weights", "kv"):
        named = [p for p in plugins if kinds.get(p) == kind]
        if len(named) > 1:
            raise PlanError(f"{flags or '--plugins ' + ','.join(plugins)}: two {kind} "
                            f"quantizers, {named[0]!r} and {named[1]!r}; choose one")


def check_variants(device, plugins, variants) -> None:
    """``check_plugins`` and ``check_quantizers`` for ``--plugins`` and for it plus each
    ``--compare-plugins`` set, before any model is built."""
    check_plugins(device, plugins)
    check_quantizers(plugins)
    for v in variants:
        flags = (f"--plugins {','.join(plugins)} with " if plugins else "") + \
            f"--compare-plugins {'+'.join(v)}"
        check_plugins(device, plugins + v, flags)
        check_quantizers(plugins + v, flags)


def variant_name(plugins) -> str:
    return "+".join([BASE, *plugins])


def free_device() -> None:
    """Drop what the last engine left (cycles, the CUDA cache) before the next is built."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def each_variant(variants, build_variant, measure, log) -> list:
    """``measure(plugins, engine)`` for each plugin set of ``variants``, the engine built by
    ``build_variant(plugins)``; one build alive at a time. ``measure``'s result must not
    hold the engine: the engine is freed as soon as it returns."""
    results = []
    for plugins in variants:
        free_device()
        engine = build_variant(plugins)
        log(f"{variant_name(plugins)}:\n{engine.plan}")
        results.append(measure(plugins, engine))
        del engine
    free_device()
    return results


def run_variants(hf, build_variant, args, bandwidth: float) -> list:
    """Results of our engine for each of ``args.compare_plugins`` (``build_variant(plugins)``
    builds it), system named ``infergraft+<plugins>``, timed as bench's first build was."""
    def log(msg):
        print(msg, file=sys.stderr)

    def measure(plugins, engine):
        rows, _ = run_benchmark(hf, engine, args.batches, args.prompt_len, args.new_tokens,
                                (BASE,), bandwidth=bandwidth, log=log)
        for r in rows:
            r.system = variant_name(plugins)
        return rows
    return [r for rows in each_variant(args.compare_plugins, build_variant, measure, log)
            for r in rows]


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
