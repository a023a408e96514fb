"""``infergraft bench serve`` (also ``python -m infergraft.core.tools.bench_serve``): a
client-side serving benchmark of any OpenAI-compatible server, as ``vllm bench serve``.

Streams ``POST /v1/completions`` requests (token-id prompts, ``ignore_eos``, greedy, usage
asked for) at open-loop arrival times through httpx, measures TTFT, TPOT, ITL and E2E latency
on the client, prints a table per request rate and writes ``serve.json`` (every argument, the
commit and switches of this checkout, every rate's figures) and ``serve.png`` (latency
percentiles and throughput against the rate) to ``--out``. Here: the flags and the
files; serve_workload.py: the workloads, the arrival process and the figures;
serve_client.py: the requests; serve_report.py: the table and the plot.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

from ..errors import InfergraftError, PlanError
from .bench_cli import _out, _positive, parse_resolved
from .provenance import provenance
from .serve_client import benchmark
from .serve_hf import hf_offline_summary
from .serve_offline import offline_summary
from .serve_report import jsonable, plot
from .serve_workload import DATASETS, DEFAULT_LENS, FIRST_ID, SLO_METRICS, make_requests


# Flag types: argparse reports their ArgumentTypeError as "argument --flag: ..." and exits
# 2, so a bad flag is refused before any request is sent.
def _base_url(text: str) -> str:
    """The API root, ending in /v1: http://host:port and http://host:port/v1 both work."""
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an http(s) URL of a server, e.g. http://127.0.0.1:8000")
    root = text.rstrip("/")
    return root if root.endswith("/v1") else root + "/v1"


def _rate(text: str) -> float:
    try:
        rate = float(text)
    except ValueError:
        rate = 0.0
    if not rate > 0:  # also NaN
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a request rate: a positive number of requests a second, or inf")
    return rate


def _rates(text: str) -> list[float]:
    try:
        rates = [_rate(r) for r in text.split(",")]
    except argparse.ArgumentTypeError:
        rates = []
    if not rates or len(set(rates)) < len(rates):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma list of distinct request rates (positive, or inf), "
            f"e.g. 1,2,4,8,inf")
    return rates


def _positive_float(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        x = 0.0
    if not 0 < x < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
    return x


def _slo(text: str) -> tuple[str, float]:
    name, _, ms = text.partition(":")
    try:
        value = float(ms)
    except ValueError:
        value = 0.0
    if name not in SLO_METRICS or not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an SLO: METRIC:MS with METRIC one of {', '.join(SLO_METRICS)} "
            f"and MS a positive number of milliseconds, e.g. ttft:500 tpot:50")
    return name, value


def _vocab(text: str) -> int:
    n = _positive(text)
    if n <= FIRST_ID:
        raise argparse.ArgumentTypeError(
            f"{text!r}: the vocabulary must hold more than the {FIRST_ID} special ids "
            f"0..{FIRST_ID - 1} that prompts avoid")
    return n


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """The workload's flags, shared with ``bench throughput``: --dataset, --num-prompts,
    --prompt-len, --output-len (``resolve_workload`` fills in the lengths' defaults)."""
    p.add_argument("--dataset", choices=DATASETS, default="fixed")
    p.add_argument("--num-prompts", type=_positive, default=100)
    p.add_argument("--prompt-len", type=_positive, default=None,
                   help="prompt tokens (the mean for uniform and sharegpt-like; the shared "
                        "prefix for prefix); default " +
                        ", ".join(f"{d} {p}" for d, (p, _) in DEFAULT_LENS.items()))
    p.add_argument("--output-len", type=_positive, default=None,
                   help="output tokens (the mean for uniform and sharegpt-like); default " +
                        ", ".join(f"{d} {o}" for d, (_, o) in DEFAULT_LENS.items()))


def resolve_workload(args):
    """``args`` with the dataset's default prompt and output lengths where none was given."""
    lens = DEFAULT_LENS[args.dataset]
    args.prompt_len = args.prompt_len or lens[0]
    args.output_len = args.output_len or lens[1]
    return args


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", type=_base_url, required=True,
                   help="the server, e.g. http://127.0.0.1:8000 (a trailing /v1 is optional)")
    p.add_argument("--model", default=None,
                   help="the model name to ask for (default: the first that /v1/models lists)")
    add_workload_arguments(p)
    p.add_argument("--request-rate", type=_rate, default=None,
                   help="requests a second, or inf (default): all sent at once")
    p.add_argument("--burstiness", type=_positive_float, default=1.0,
                   help="shape of the gamma inter-arrival times: 1 Poisson, <1 burstier")
    p.add_argument("--max-concurrency", type=_positive, default=None,
                   help="at most this many requests in flight (default: no limit)")
    p.add_argument("--goodput", type=_slo, nargs="+", default=None, metavar="METRIC:MS",
                   help="SLOs a request must all meet to count, e.g. ttft:500 tpot:50 e2el:5000")
    p.add_argument("--sweep-rates", type=_rates, default=None,
                   help="comma list of rates, one run each, e.g. 1,2,4,8,inf")
    p.add_argument("--vocab-size", type=_vocab, default=32000,
                   help="prompt token ids are drawn below it: at most the served model's "
                        "vocabulary (default 32000, which LLaMA-2, Mistral, GPT-2, SmolLM2, "
                        "LLaMA-3 and Qwen all exceed)")
    p.add_argument("--seed", type=int, default=0, help="prompts and arrival times")
    p.add_argument("--out", type=_out, default=".bench", help="folder for serve.json, serve.png")
    p.add_argument("--api-key", default=None,
                   help="sent as a bearer token (default: $INFERGRAFT_API_KEY, $OPENAI_API_KEY)")
    p.add_argument("--offline-model", default=None, metavar="DIR|ALIAS",
                   help="then run the rate-inf (or first) run's requests through this model "
                        "in-process, and report the server's output throughput over its")
    p.add_argument("--offline-plugin", action="append", default=None, metavar="P",
                   help="plugins of the offline engine (repeatable; build it as the server's)")
    p.add_argument("--offline-max-batch-size", type=_positive, default=None, metavar="B")
    p.add_argument("--offline-dtype", default=None, metavar="D")
    p.add_argument("--offline-hf", action="store_true",
                   help="and through HF transformers' continuous batching (generate_batch) "
                        "on the same model: the baseline, in the same run")


def resolve(args):
    """``args`` with defaults filled in; PlanError for flags that do not go together."""
    if args.sweep_rates and args.request_rate is not None:
        raise PlanError("--sweep-rates and --request-rate: give one (a sweep runs each of "
                        "its rates; --request-rate runs one)")
    slos = dict(args.goodput or ())
    if len(slos) < len(args.goodput or ()):
        raise PlanError(f"--goodput {' '.join(f'{k}:{v:g}' for k, v in args.goodput)}: "
                        f"each of {', '.join(SLO_METRICS)} at most once")
    args.goodput = slos or None
    args.rates = args.sweep_rates or [args.request_rate or math.inf]
    resolve_workload(args)
    args.api_key = args.api_key or os.environ.get("INFERGRAFT_API_KEY") or \
        os.environ.get("OPENAI_API_KEY")
    return args


def _arguments(args) -> dict:
    """Every flag of ``bench serve`` as resolved (the key hidden), for the JSON."""
    p = argparse.ArgumentParser(add_help=False)
    add_arguments(p)
    names = vars(p.parse_args(["--base-url", "http://x"]))
    own = {k: getattr(args, k) for k in (*names, "rates")}
    return dict(own, api_key="(set)" if own["api_key"] else None)


def run(args) -> int:
    """``infergraft bench serve``: a bad flag raises PlanError before any request."""
    return measure(resolve(args))


def measure(args) -> int:
    model, runs = asyncio.run(benchmark(args))
    offline = None if args.offline_model is None else _offline(args, runs)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve.json").write_text(json.dumps(jsonable({
        "benchmark": "serve", "base_url": args.base_url, "model": model,
        "dataset": args.dataset, "args": _arguments(args),
        "when": time.strftime("%Y-%m-%d %H:%M"), **provenance(), "runs": runs,
        **({} if offline is None else {"offline": offline}),
    }), indent=2))
    plotted = plot(runs, out / "serve.png", f"{model}, {args.dataset} at {args.base_url}")
    print(f"\nwrote {out / 'serve.json'}" + (f" and {out / 'serve.png'}" if plotted else
          " (no serve.png: matplotlib is not installed; pip install 'infergraft[bench]')"))
    return 0 if any(r["completed"] for r in runs) else 1


def _offline(args, runs) -> dict:
    """The rate-inf run's requests (the first run's without one) through an in-process
    engine of ``--offline-model``, and the server's output throughput over its."""
    import torch

    from ..build import build

    i = next((k for k, rate in enumerate(args.rates) if math.isinf(rate)), 0)
    requests = make_requests(args.dataset, args.num_prompts, args.prompt_len,
                             args.output_len, args.vocab_size, seed=f"{args.seed}:{i}")
    longest = max(len(r.prompt) + r.output_len for r in requests)
    print(f"offline: {len(requests)} requests through {args.offline_model} ...",
          file=sys.stderr)
    engine = build(args.offline_model, plugins=args.offline_plugin, dtype=args.offline_dtype,
                   max_batch_size=args.offline_max_batch_size, max_seq_len=longest)
    summary = offline_summary(engine, requests, args.max_concurrency)
    ratio = runs[i]["output_throughput"] / summary["output_throughput"]
    print(f"offline output throughput {summary['output_throughput']:.1f} tok/s; served "
          f"{runs[i]['output_throughput']:.1f} tok/s = {ratio:.1%} of it")
    out = dict(summary, rate_compared=args.rates[i], server_over_offline=ratio)
    if args.offline_hf:
        device, dtype = engine.device, getattr(torch, engine.plan.dtype)
        del engine  # its weights and cache, before HF's
        gc.collect()
        try:
            hf = hf_offline_summary(args.offline_model, requests, device, dtype)
        except Exception as e:  # HF's side: the served and offline figures stand
            out["hf"] = {"error": f"{type(e).__name__}: {e}"}
            print(f"HF continuous batching failed: {out['hf']['error']}", file=sys.stderr)
            return out
        if not hf["completed"]:
            print(f"HF continuous batching failed: {hf['first_error']}", file=sys.stderr)
            out["hf"] = hf
            return out
        hf["served_over_hf"] = runs[i]["output_throughput"] / hf["output_throughput"]
        print(f"HF continuous batching (offline) {hf['output_throughput']:.1f} tok/s; "
              f"served = {hf['served_over_hf']:.2f}x it")
        out["hf"] = hf
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="infergraft bench serve", description=__doc__)
    add_arguments(p)
    args = parse_resolved(p, argv, resolve)
    try:
        return measure(args)
    except InfergraftError as e:
        print(f"infergraft bench serve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
