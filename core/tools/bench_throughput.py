"""``infergraft bench throughput`` (also ``python -m infergraft.core.tools.bench_throughput``):
offline throughput of our engine beside HF transformers' continuous batching on the same
weights, and the workload's compute floor, in one run (as ``vllm bench throughput``).

``--num-prompts`` requests of a ``bench serve`` dataset (token-id prompts below the model's
vocabulary, ``ignore_eos``, exact output lengths) are submitted to the engine all at once
(``add_request``) and stepped until every one has finished, after a short warm-up
(serve_offline.py); then the same requests through HF's continuous batching (serve_hf.py),
unless ``--no-hf``. ``--compare-plugins int8,int4+kv-int8`` and ``--compare-options
prefix_caching=false``: after the base run (its ``--plugins`` and build options) our engine
runs the same requests again with each set added or each option changed, one build alive
at a time (bench_variants.py), each set against the base run; HF and the floor are
measured once. Each run of ours records ``engine.stats()`` and, with ``--check-alone``,
whether requests get the tokens they get alone (bench_kv.py). The matmul rate
the floor is taken at is measured first, in the same run (throughput_report.py says what
the floor counts). Prints a table of every run and the floor; writes ``throughput.json``
(every argument, the commit and switches, the device, the summaries, each variant's
under ``variants``, the floor) and ``throughput.png`` to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from ..errors import InfergraftError, PlanError
from .bench import matmul_rate
from . import bench_kv, bench_parallel as parallel
from .bench_cli import (SHAPES, _batches, _device, _dtype, _model, _names, _out, _positive,
                        build_engine, describe_device, load_models, parse_resolved)
from .bench_serve import add_workload_arguments, resolve_workload
from .bench_variants import (BASE, add_options_argument, add_variants_argument,
                             check_option_variants, check_variants, each_variant,
                             free_device, spell, variant_name)
from .config_cli import add_config_argument, bench_config
from .provenance import provenance
from .serve_hf import hf_summary
from .serve_report import jsonable
from .serve_workload import make_requests
from .step_census import StepTimers
from .step_floors import StepFloors, copy_rate
from .throughput_report import compute_floor, plot, table, vs_base

MAX_BATCH = 256  # the default batch's cap, as vLLM's max_num_seqs
MATMUL_N = {"cuda": 8192, "cpu": 1024}  # the floor's matmul: n x n x n, by device type


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=_model, default="smollm2-135m",
                   help=f"alias, local dir, or a random shape: {', '.join(SHAPES)}")
    add_workload_arguments(p)
    p.add_argument("--max-batch-size", type=_positive, default=None,
                   help=f"sequences our engine decodes together at most (default: "
                        f"--num-prompts, at most {MAX_BATCH}: every request in one batch)")
    p.add_argument("--max-num-batched-tokens", type=_batches, default=None,
                   help="tokens one engine step carries at most (default: the engine's); "
                        "a comma list runs our engine once per budget (a sweep)")
    p.add_argument("--hf-num-prompts", type=_positive, default=None,
                   help="HF runs the first K requests only (default: all; HF is ~10x "
                        "slower, so a 1000-request run takes it minutes per workload)")
    p.add_argument("--step-gaps", action=argparse.BooleanOptionalAction, default=None,
                   help="time the GPU's busy steps and idle gaps between them "
                        "(step_gaps.py; default: on with --device cuda)")
    p.add_argument("--step-census", action="store_true", help="every step of each run of "
                   "ours classed, timed, set against its floor at the matmul and copy rates "
                   "measured first: where the run's wall time goes (step_census.py)")
    p.add_argument("--max-seq-len", type=_positive, default=None,
                   help="our engine's context length (default: the longest request's "
                        "prompt + output)")
    p.add_argument("--dtype", type=_dtype, default=None,
                   help="float32, bfloat16 or float16 (default: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--device", type=_device,
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--plugins", type=_names, default="",
                   help="comma list of plugins for our engine, e.g. int8 (the paged cache "
                        "is added on CUDA)")
    add_variants_argument(p, "each runs the same requests, its output tok/s set against "
                             "the base run's (one --max-num-batched-tokens only)")
    add_options_argument(p, "each runs the same requests, its out tok/s, TTFT and TPOT set "
                            "against the base run's (one --max-num-batched-tokens only)")
    bench_kv.add_arguments(p)
    add_config_argument(p)
    p.add_argument("--no-hf", action="store_true",
                   help="skip HF transformers' continuous batching (the baseline)")
    p.add_argument("--seed", type=int, default=0, help="the prompts")
    p.add_argument("--out", type=_out, default=".bench",
                   help="folder for throughput.json, throughput.png")
    parallel.add_arguments(p, _positive)  # under torchrun: one device, then the ranks


def vocab_size(model: str) -> int:
    """The vocabulary prompts are drawn below: a random shape's, else its config.json's."""
    if model in SHAPES:
        return SHAPES[model]["vocab_size"]
    from ..loading.source import spec_of

    return spec_of(model)[1].vocab_size


def resolve(args):
    """``args`` with defaults filled in and ``args.requests`` drawn; PlanError for flags
    that do not go together (the types check each flag alone)."""
    args.config_options = bench_config(args)
    args.dtype = args.dtype or (torch.bfloat16 if args.device.startswith("cuda")
                                else torch.float32)
    check_variants(args.device, args.plugins, args.compare_plugins)
    args.build_options = bench_kv.base_options(args)
    check_option_variants(args.device, args.plugins, args.build_options,
                          args.compare_options, args.config_options)
    budgets = args.max_num_batched_tokens or []
    parallel.resolve(args, refused=[("--compare-plugins", args.compare_plugins), (
        "--compare-options", args.compare_options), ("a budget sweep", len(budgets) > 1),
        ("--step-census", args.step_census)])
    for flag in ("--compare-plugins", "--compare-options"):
        if getattr(args, flag[2:].replace("-", "_")) and len(budgets) > 1:
            raise PlanError(f"{flag} with the --max-num-batched-tokens sweep "
                            f"{','.join(map(str, budgets))}: each variant runs at the base "
                            f"run's one budget; give one budget, or sweep without {flag}")
    resolve_workload(args)
    args.requests = make_requests(args.dataset, args.num_prompts, args.prompt_len,
                                  args.output_len, vocab_size(args.model), seed=args.seed)
    longest = max(len(r.prompt) + r.output_len for r in args.requests)
    for flag, n in [("--max-seq-len", args.max_seq_len)] + [
            (f"--compare-options {spell(v['plugins'], v['options'])}: max_seq_len",
             v["options"].get("max_seq_len")) for v in args.compare_options]:
        if isinstance(n, int) and n < longest:
            raise PlanError(f"{flag} {n} is shorter than the longest request of --dataset "
                            f"{args.dataset} ({longest} tokens, prompt + output): give at "
                            f"least {longest}, or leave it out")
    args.max_seq_len = args.max_seq_len or longest
    args.max_batch_size = args.max_batch_size or min(args.num_prompts, MAX_BATCH)
    args.rates = None  # (matmul, copy): measure() takes both for --step-census's floors
    if args.step_gaps is None:
        args.step_gaps = args.device.startswith("cuda")
    if args.step_gaps and not args.device.startswith("cuda"):
        raise PlanError("--step-gaps times CUDA-graph replays: it needs --device cuda")
    return args


def _arguments(args) -> dict:
    """Every flag of ``bench throughput`` as resolved, for the JSON."""
    p = argparse.ArgumentParser(add_help=False)
    add_arguments(p)
    return {k: str(v) if isinstance(v, torch.dtype) else v
            for k, v in vars(args).items() if k in vars(p.parse_args([]))}


def run(args) -> int:
    """``infergraft bench throughput``: a bad flag raises PlanError before any model is
    built."""
    return measure(resolve(args))


def measure(args) -> int:
    if parallel.ranks(args) > 1:  # under torchrun: these runs, one device's and the ranks'
        return parallel.measure_throughput(args, _ours, _variant, _write, MATMUL_N)
    device, requests = torch.device(args.device), args.requests
    # 1) The floor's matmul rate, before the models take the device's memory
    n = MATMUL_N.get(device.type, MATMUL_N["cpu"])
    rate = matmul_rate(device, args.dtype, n)
    measured = f"{str(args.dtype)[6:]} {n}^3 torch.matmul on {device}, best of 5"
    print(f"matmul rate {rate / 1e12:.3f} TFLOP/s ({measured})", file=sys.stderr)
    args.rates = (rate, copy_rate(device)) if args.step_census else None
    # 2) Both models on the same weights: HF's random shape or checkpoint, ours built from
    # it, once per token budget of a sweep
    budgets = args.max_num_batched_tokens or [None]
    hf, engine = load_models(args.model, device, args.dtype, args.max_batch_size,
                             args.max_seq_len, args.plugins, budgets[0], args.config_options,
                             options=args.build_options)
    rows, config = {}, None
    for i, budget in enumerate(budgets):
        if i:
            engine = build_engine(hf, device, args.dtype, args.max_batch_size,
                                  args.max_seq_len, args.plugins, budget, args.config_options,
                                  args.build_options)
        print(engine.plan, file=sys.stderr)
        summary, config = _ours(args, engine)
        steps = config["max_num_batched_tokens"]
        rows[f"{BASE} ({steps} tok)" if len(budgets) > 1 else BASE] = summary
        spec = engine.spec
        del engine  # before the next is built: one engine's cache on the device at a time
        free_device()
    # 3) Each --compare-plugins set, then each --compare-options variant, on the same
    # requests (no sweep: one budget)
    def build_variant(v):
        return build_engine(hf, device, args.dtype, args.max_batch_size, args.max_seq_len,
                            args.plugins + v["plugins"], budgets[0], args.config_options,
                            {**args.build_options, **v["options"]})
    variants = each_variant(
        [{"plugins": p, "options": {}} for p in args.compare_plugins] + args.compare_options,
        build_variant, lambda v, engine: _variant(args, v, engine, rows[BASE]),
        lambda msg: print(msg, file=sys.stderr), name=_name)
    # 4) HF after ours, on the first --hf-num-prompts requests
    hf_requests = requests[:args.hf_num_prompts or len(requests)]
    hf_row = None if args.no_hf else _hf(hf, hf_requests)
    if hf_row is not None and "completed" in hf_row:
        hf_row["num_prompts"] = len(hf_requests)
        rows["HF CB" if len(hf_requests) == len(requests) else
             f"HF CB (first {len(hf_requests)})"] = hf_row
    floor = compute_floor(spec, requests, rate, measured)
    for s in [*rows.values(), *variants]:
        s["over_floor"] = s["output_throughput"] / floor["output_throughput"]
    _write(args, config, rows, variants, hf_row, floor)
    ours = [s for k, s in rows.items() if not k.startswith("HF")] + variants
    return 0 if all(s["completed"] == len(requests) and s["full_length"] for s in ours) else 1


def _ours(args, engine, name: str = BASE):
    """(summary, engine config) of one run of our engine (``name``: the log's for it)."""
    budget = engine.scheduler.max_num_batched_tokens
    print(f"{name} ({budget}-token steps): {len(args.requests)} requests at once ...",
          file=sys.stderr)
    floors = args.rates and StepFloors.of(engine, *args.rates)  # --step-census's
    timers = StepTimers(engine, args.step_gaps, floors)
    ours = bench_kv.measured_run(engine, args.requests, after_warm_up=timers.start,
                                 check_alone=args.check_alone, after_run=timers.stop)
    ours.update(timers.results())
    config = {"max_batch_size": engine.plan.max_batch_size,
              "max_seq_len": engine.plan.max_seq_len, "max_num_batched_tokens": budget,
              "cache_backend": engine.plan.cache_backend,
              "plugin_options": dict(engine.plan.options)}
    ours["engine_config"] = config
    return ours, config


def _name(v) -> str:
    return variant_name(v["plugins"], v["options"])


def _variant(args, v, engine, base: dict) -> dict:
    """One variant's summary: named, its plugins and options (the variant's, and all of the
    build's), its out tok/s, TTFT and TPOT over the base run's."""
    summary, _ = _ours(args, engine, _name(v))
    ratios = vs_base(summary, base)
    return {"name": _name(v), "plugins": v["plugins"], "options": v["options"],
            "build_plugins": args.plugins + v["plugins"],
            "build_options": {**args.build_options, **v["options"]}, **summary,
            "output_throughput_vs_base": ratios["output_throughput"], "vs_base": ratios}


def _hf(hf, requests) -> dict:
    """HF's summary, or {"error": ...} when its side failed (ours stands)."""
    print(f"HF continuous batching: {len(requests)} requests at once ...", file=sys.stderr)
    try:
        return hf_summary(hf, requests)
    except Exception as e:  # HF's side: our figures and the floor stand
        print(f"HF continuous batching failed: {type(e).__name__}: {e}", file=sys.stderr)
        return {"error": f"{type(e).__name__}: {e}"}


def _write(args, config, rows, variants, hf_row, floor) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = describe_device(args.device)
    (out / "throughput.json").write_text(json.dumps(jsonable({
        "benchmark": "throughput", "model": args.model, "dataset": args.dataset,
        "args": _arguments(args), "device": device, "engine_config": config,
        "when": time.strftime("%Y-%m-%d %H:%M"), **provenance(),
        "infergraft": next(iter(rows.values())), "runs": rows, "hf": hf_row, "floor": floor,
        "variants": variants,
    }), indent=2))
    # the table and plot: ours, each plugin set, then HF
    shown = {**{k: s for k, s in rows.items() if not k.startswith("HF")},
             **{v["name"]: v for v in variants},
             **{k: s for k, s in rows.items() if k.startswith("HF")}}
    print(table(shown, floor, base=BASE if variants else None))
    if hf_row is not None and "error" in hf_row:
        print(f"HF continuous batching failed: {hf_row['error']}")
    title = (f"{args.model} {str(args.dtype)[6:]} on {device}, {args.num_prompts} x "
             f"{args.dataset} ({args.prompt_len} + {args.output_len})")
    plotted = plot(shown, floor, out / "throughput.png", title)
    print(f"\nwrote {out / 'throughput.json'}" + (f" and {out / 'throughput.png'}" if plotted
          else " (no throughput.png: matplotlib is not installed; "
               "pip install 'infergraft[bench]')"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="infergraft bench throughput", description=__doc__)
    add_arguments(p)
    try:
        args = parse_resolved(p, argv, resolve)
    except InfergraftError as e:  # the model's config.json refused (vocab_size)
        return _failed(e)
    try:
        return measure(args)
    except InfergraftError as e:
        return _failed(e)


def _failed(e: InfergraftError) -> int:
    print(f"infergraft bench throughput: error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
