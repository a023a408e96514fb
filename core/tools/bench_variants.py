"""``--compare-plugins int8,int4`` of ``infergraft bench`` and ``infergraft bench
throughput``: our engine built again with each of those plugin sets added to ``--plugins``
(several in one set joined by ``+``, e.g. ``int8+kv-int8``), on the same HF weights in the
same run, one build alive at a time. In ``bench`` each row's roofline counts that build's
own bytes (packed weights, its K/V format); in ``bench throughput`` each set runs the base
run's requests and its output tok/s is set against the base run's.

``--compare-options prefix_caching=false,preemption=swap+num_blocks=512`` (``bench
throughput``): each variant is build options (``key=value``, plugin names beside them)
over the base run's; an option that no argument of ``core.build`` and no plugin it would
choose takes is refused before any model is built, as build would refuse it (its values
build checks)."""
from __future__ import annotations

import argparse
import gc
import inspect
import json
import sys

import torch

from ..errors import InfergraftError, PlanError
from ..plugin_manager import get_plugin_manager
from ..selection import DEFAULT_CACHE_BACKEND, DEFAULT_PLANNER, select_plugins
from .bench import run_benchmark

BASE = "infergraft"
# build()'s arguments the bench sets from its own flags (HF runs with them too)
SET_BY_FLAGS = {"model": "--model", "plugins": "--plugins", "config": "--config",
                "dtype": "--dtype", "device": "--device", "tokenizer": "--model",
                "checkpoint": "--model", "max_prefill_tokens": "--max-num-batched-tokens"}


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


def option_value(text: str):
    """A build option's value as typed: true / false, none / null, an int, a float, else
    the text itself ("80GiB", "swap")."""
    low = text.lower()
    if low in ("true", "false", "none", "null"):
        return {"true": True, "false": False}.get(low)
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_option_variants(text: str) -> list[dict]:
    """'prefix_caching=false,int8+num_blocks=512' -> [{plugins: [], options:
    {prefix_caching: False}}, {plugins: [int8], options: {num_blocks: 512}}] (argparse
    type): ``key=value`` items are build options, the others plugin names."""
    variants, seen = [], set()
    for part in text.split(","):
        items = [i.strip() for i in part.split("+") if i.strip()]
        pairs = [i.partition("=")[::2] for i in items if "=" in i]
        options = {k.strip(): option_value(v.strip()) for k, v in pairs}
        v = {"plugins": [i for i in items if "=" not in i], "options": options}
        key = (tuple(v["plugins"]), tuple(sorted(options.items(), key=str)))
        if not items or len(options) < len(pairs) or key in seen or \
                not all(k.isidentifier() for k in options):
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a comma list of distinct variants, each build options "
                "key=value (a key once) and plugin names joined by +, e.g. "
                "prefix_caching=false or preemption=swap,preemption=recompute+num_blocks=512")
        seen.add(key)
        variants.append(v)
    return variants


def add_options_argument(p: argparse.ArgumentParser, what: str) -> None:
    """``--compare-options VARIANTS``; ``what``: what each variant's run is measured against."""
    p.add_argument("--compare-options", type=parse_option_variants, default=[],
                   metavar="VARIANTS",
                   help="our engine again with build options changed over the base run's "
                        "(key=value; several, and plugin names to add, joined by +), one "
                        "variant after another (comma-separated), e.g. prefix_caching=false "
                        f"or preemption=swap,preemption=recompute; {what}")


def spell(plugins, options=None) -> str:
    """A variant as --compare-options spells it: 'int8+prefix_caching=false'."""
    return "+".join([*plugins, *(f"{k}={json.dumps(v) if not isinstance(v, str) else v}"
                                 for k, v in (options or {}).items())])


def check_options(device, plugins, options: dict, flags: str) -> None:
    """PlanError naming ``flags`` for a build option that the bench's own flags set, or
    that neither ``core.build`` nor any plugin it would choose for ``plugins`` takes (as
    build refuses it; its values build checks itself)."""
    for key in options:
        if key in SET_BY_FLAGS:
            raise PlanError(f"{flags}: {key} is set by {SET_BY_FLAGS[key]}, not a build "
                            "option of one run")
    from ..build import build

    pm, sel = select_plugins(get_plugin_manager(), engine_plugins(device, plugins))
    chosen = [pm.cache_backends().get(sel.cache_backend or DEFAULT_CACHE_BACKEND),
              pm.planners().get(sel.planner or DEFAULT_PLANNER),
              *(pm.quantizers().get(n) for n in sel.quantizers)]
    declared = {k for c in chosen for k in (getattr(c, "options", None) or {})}
    arguments = {name for name, a in inspect.signature(build).parameters.items()
                 if a.kind is a.KEYWORD_ONLY and name not in SET_BY_FLAGS}
    unknown = sorted(set(options) - declared - arguments)
    if unknown:
        raise PlanError(f"{flags}: unknown option(s) {unknown}; with plugins "
                        f"{', '.join(engine_plugins(device, plugins)) or '(defaults)'} "
                        f"build accepts: {', '.join(sorted(declared | arguments))}")


def check_option_variants(device, plugins, options: dict, variants, config=None) -> None:
    """``check_options`` for each of the base run's ``options`` (named by its flag) and
    each ``--compare-options`` variant (its plugins checked too), with ``plugins`` after
    a resolved ``--config``'s, before any model is built."""
    first = list((config or {}).get("plugins") or []) + list(plugins)
    for key, value in options.items():
        check_options(device, first, {key: value}, f"--{key.replace('_', '-')} {value}")
    for v in variants:
        flags = f"--compare-options {spell(v['plugins'], v['options'])}"
        check_plugins(device, list(plugins) + v["plugins"], flags)
        check_quantizers(list(plugins) + v["plugins"], flags)
        check_options(device, first + v["plugins"], v["options"], flags)


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


def variant_name(plugins, options=None) -> str:
    return "+".join([BASE, spell(plugins, options)]) if plugins or options else BASE


def free_device() -> None:
    """Drop what the last engine left (cycles, the CUDA cache) before the next is built."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def each_variant(variants, build_variant, measure, log, name=variant_name) -> list:
    """``measure(variant, engine)`` for each of ``variants`` (plugin sets; or what ``name``
    names), the engine built by ``build_variant(variant)``; one build alive at a time.
    ``measure``'s result must not hold the engine: it is freed as soon as it returns."""
    results = []
    for variant in variants:
        free_device()
        engine = build_variant(variant)
        log(f"{name(variant)}:\n{engine.plan}")
        results.append(measure(variant, engine))
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
