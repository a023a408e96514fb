"""``infergraft bench`` (also ``python -m infergraft.core.tools.bench_cli``): table, JSON, plot."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import attrs
import torch

from ..errors import PlanError
from ..loading.hub import cached_snapshot, is_hub_id
from ..loading.source import ALIASES, model_directory
from ..selection import resolve_device, resolve_dtype
from . import bench_parallel as parallel
from .bench import (SHAPES, SYSTEMS, check_systems, describe_device, min_new_tokens,
                    run_benchmark, shape_config)
from .bench_fit import INTERLEAVED, SEQUENTIAL, fit_of, run_in_turn
from .bench_report import plot, unsteady_warning
from .bench_variants import (add_variants_argument, check_variants, engine_plugins,
                             run_variants, variants_table)
from .config_cli import add_config_argument, bench_config
from .provenance import provenance

def load_models(name: str, device, dtype, max_batch_size: int, max_seq_len: int,
                plugins=(), max_num_batched_tokens: int | None = None, config=None,
                options=None):
    """(hf_model, engine) on the same weights; ``plugins`` added to the engine's (the
    paged cache on CUDA), e.g. ("int8",); ``max_num_batched_tokens``: the engine's prompt
    tokens a step (None: its default); ``options``: more of build's keyword arguments."""
    hf = load_hf(name, device, dtype)
    return hf, build_engine(hf, device, dtype, max_batch_size, max_seq_len, plugins,
                            max_num_batched_tokens, config, options)


def load_hf(name: str, device, dtype, host: bool = False):
    """The HF model of ``name``: a random shape of SHAPES (seed 0), or a checkpoint (a
    directory, an alias or a hub id in the Hugging Face cache: never downloaded), on
    ``device``; ``host``: left in host memory (a shape is still made on ``device``, where
    its random initialisation is fast, then moved)."""
    from transformers import AutoModelForCausalLM

    if name in SHAPES:
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(shape_config(name), dtype=dtype).eval()
        return model.to("cpu") if host else model
    model = AutoModelForCausalLM.from_pretrained(model_directory(name), dtype=dtype,
                                                 local_files_only=True).eval()
    return model if host else model.to(device)


def build_engine(hf, device, dtype, max_batch_size: int, max_seq_len: int, plugins=(),
                 max_num_batched_tokens: int | None = None, config=None, options=None):
    """Our engine on ``hf``'s weights, as ``load_models`` builds it; ``config``: a resolved
    ``--config`` (``config_cli.bench_config``), the arguments here over it; ``options``
    (e.g. ``{"prefix_caching": False}``) over those."""
    from ..build import build

    kwargs = dict(plugins=engine_plugins(device, plugins) or None, dtype=dtype,
                  device=device, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                  max_num_batched_tokens=max_num_batched_tokens, config=config)
    return build(hf, **{**kwargs, **(options or {})})


def markdown_table(results, bw: float) -> str:
    by = {(r.system, r.batch): r for r in results}
    systems = sorted({r.system for r in results}, key=lambda s: (s != "infergraft", s))
    hf = [s for s in systems if s != "infergraft"]
    head = ["batch"] + [f"{s} TPOT ms" for s in systems] + [f"{s} TTFT ms" for s in systems] + \
        [f"speed-up vs {s}" for s in hf] + ["roofline TPOT ms", "ours / roofline"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for b in sorted({r.batch for r in results}):
        ours = by.get(("infergraft", b))
        row = [str(b)] + [f"{by[(s, b)].tpot_ms:.2f}" for s in systems] + \
            [f"{by[(s, b)].ttft_ms:.1f}" for s in systems]
        row += [f"{by[(s, b)].tpot_ms / ours.tpot_ms:.2f}x" if ours else "-" for s in hf]
        r0 = ours or by[(systems[0], b)]
        row += [f"{r0.roofline_ms:.2f}", f"{r0.roofline_fraction:.0%}" if ours else "-"]
        lines.append("| " + " | ".join(row) + " |")
    lines.append(f"\ncopy bandwidth (roofline): {bw / 1e9:.1f} GB/s")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="infergraft bench", description=__doc__)
    add_arguments(p)
    return measure(parse_resolved(p, argv, resolve))


def parse_resolved(p: argparse.ArgumentParser, argv, resolve):
    """``argv`` parsed by ``p``, then ``resolve``d: a PlanError there is a usage error."""
    args = p.parse_args(argv)
    try:
        resolve(args)
    except PlanError as e:
        p.error(str(e))
    return args


# Flag types: argparse reports their ArgumentTypeError as "argument --flag: ..." and exits
# 2, so a bad flag is refused before any model is built or anything measured.
def _model(text: str) -> str:
    if text in SHAPES or text in ALIASES or (Path(text).expanduser() / "config.json").is_file():
        return text
    if is_hub_id(text) and cached_snapshot(text)[0] is not None:
        return text
    raise argparse.ArgumentTypeError(
        f"unknown model {text!r}: not a local directory with config.json, a hub id in the "
        f"Hugging Face cache, nor one of {', '.join((*ALIASES, *SHAPES))}")


def _device(text: str) -> str:
    try:  # the device names build accepts, checked against this machine
        return str(resolve_device(text))
    except PlanError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _dtype(text: str) -> torch.dtype:
    try:
        return resolve_dtype(text, None)
    except PlanError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return n


def _batches(text: str) -> list[int]:
    try:
        sizes = [int(b) for b in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1 or len(set(sizes)) < len(sizes):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma list of distinct positive integers, e.g. 1,8,32")
    return sizes


def _systems(text: str) -> list[str]:
    names = text.split(",")
    if not set(names) <= set(SYSTEMS) or len(set(names)) < len(names):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma list of distinct systems from {', '.join(SYSTEMS)}")
    return names


def _names(text: str) -> list[str]:
    return [n for n in text.split(",") if n]


def _out(text: str) -> str:
    path = Path(text).expanduser()
    near = next(d for d in (path, *path.parents) if d.exists())  # what mkdir would start from
    if not near.is_dir() or not os.access(near, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(
            f"cannot write {text}: {near} is not a writable directory")
    return text


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=_model, default="smollm2-135m",
                   help=f"alias, local dir, or a random shape: {', '.join(SHAPES)}")
    p.add_argument("--device", type=_device,
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", type=_dtype, default=None,
                   help="float32, bfloat16 or float16 (default: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--batches", type=_batches, default=None,
                   help="comma list (default 1,8,32,64 GPU; 1,8 CPU)")
    p.add_argument("--prompt-len", type=_positive, default=None, help="default 512 GPU, 64 CPU")
    p.add_argument("--new-tokens", type=_positive, default=None,
                   help=f"default 64 GPU, 32 CPU; at least {min_new_tokens('hf-eager')} with an "
                        f"HF system, {min_new_tokens('infergraft')} without")
    p.add_argument("--systems", type=_systems, default=None,
                   help=f"comma list of {','.join(SYSTEMS)} (static on CUDA only)")
    p.add_argument("--max-num-batched-tokens", type=_positive, default=None,
                   help="prompt tokens our engine admits a step (default: the engine's, "
                        "max(prompt + new tokens, 2048)); a batch is timed only once all of "
                        "it decodes, so a large batch needs its prompts admitted in time")
    p.add_argument("--out", type=_out, default=".bench",
                   help="folder for results.json and tpot.png")
    p.add_argument("--plugins", type=_names, default="",
                   help="comma list of plugins for our engine, e.g. int8 (weights; the "
                        "roofline then counts the packed bytes)")
    add_variants_argument(p, "each row against its own roofline")
    add_config_argument(p)
    parallel.add_arguments(p, _positive)


def resolve(args):
    """``args`` with the device's defaults; PlanError for flags that do not go together."""
    gpu = args.device.startswith("cuda")
    args.config_options = bench_config(args)
    args.dtype = args.dtype or (torch.bfloat16 if gpu else torch.float32)
    args.batches = args.batches or ([1, 8, 32, 64] if gpu else [1, 8])
    args.prompt_len = args.prompt_len or (512 if gpu else 64)
    args.new_tokens = args.new_tokens or (64 if gpu else 32)
    parallel.resolve(args, refused=[("--compare-plugins", args.compare_plugins), (
        "an HF system in --systems", set(args.systems or ()) - {"infergraft"})])
    args.systems = args.systems or (["infergraft"] if parallel.ranks(args) > 1 else
                                    list(SYSTEMS) if gpu else ["infergraft", "hf-eager"])
    check_systems(args.systems, args.new_tokens, args.device)
    check_variants(args.device, args.plugins, args.compare_plugins)
    return args


def run(args) -> int:
    """``infergraft bench``: a bad flag raises PlanError before any model is built."""
    return measure(resolve(args))


def measure(args) -> int:
    if parallel.ranks(args) > 1:  # under torchrun: every rank, beside one device's run
        return parallel.measure(args)
    dtype, prompt_len, new_tokens = args.dtype, args.prompt_len, args.new_tokens
    fit = fit_of(args)  # PlanError where a copy does not fit the device even alone
    fit.check()
    print(fit.describe(), file=sys.stderr)
    results, bw = measure_systems(args, fit.order)
    device_name = describe_device(args.device)
    title = f"{args.model} {str(dtype)[6:]} on {device_name}"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = markdown_table(results, bw)
    warning = unsteady_warning(results)  # a busy host: said under the table and in the JSON
    (out / "results.json").write_text(json.dumps({
        "model": args.model, "dtype": str(dtype), "device": device_name,
        "prompt_len": prompt_len, "new_tokens": new_tokens, "copy_bandwidth_Bps": bw,
        "plugins": args.plugins, "config": args.config, "torch": torch.__version__,
        "when": time.strftime("%Y-%m-%d %H:%M"), **provenance(),
        "results": [dict(attrs.asdict(r), tokens_per_s=r.tokens_per_s,
                         roofline_fraction=r.roofline_fraction,
                         runs_disagree=r.runs_disagree) for r in results],
        "warnings": [warning] if warning else [],
    }, indent=2))
    plotted = plot(results, out / "tpot.png", title)
    table += f"\n{fit.order} order: " + (
        "each batch on every system in turn" if fit.order == INTERLEAVED else
        "our engine at every batch, freed, then HF's model on the device" if fit.hf else
        "our engine alone")
    if args.compare_plugins:
        table += "\n\n" + variants_table(results)
    if warning:
        table += "\n\n" + warning
    print(f"## {title}, prompt {prompt_len}, {new_tokens} new tokens\n\n{table}")
    print(f"\nwrote {out / 'results.json'}" + (f" and {out / 'tpot.png'}" if plotted else
          " (no tpot.png: matplotlib is not installed; pip install 'infergraft[bench]')"))
    return 0


def measure_systems(args, order: str) -> tuple[list, float]:
    """(results, copy bandwidth) of every system and ``--compare-plugins`` build, in
    ``order`` (``bench_fit``): interleaved, HF's model on the device beside our engine;
    sequential, HF's in host memory until our builds are measured and freed."""
    def log(msg):
        print(msg, file=sys.stderr)

    def build(hf, plugins=()):
        return build_engine(hf, args.device, args.dtype, max(args.batches),
                            args.prompt_len + args.new_tokens, args.plugins + list(plugins),
                            args.max_num_batched_tokens, args.config_options)
    if order == SEQUENTIAL:
        return run_in_turn(load_hf(args.model, args.device, args.dtype, host=True), build,
                           args, log)
    hf, engine = load_models(args.model, args.device, args.dtype, max(args.batches),
                             args.prompt_len + args.new_tokens, args.plugins,
                             args.max_num_batched_tokens, args.config_options)
    log(engine.plan)
    results, bw = run_benchmark(hf, engine, args.batches, args.prompt_len, args.new_tokens,
                                args.systems, log=log)
    del engine  # one build on the device at a time
    return results + run_variants(hf, lambda plugins: build(hf, plugins), args, bw), bw


if __name__ == "__main__":
    sys.exit(main())
