"""How ``infergraft bench throughput`` judges and shows a run: the workload's compute floor,
the table of our engine beside HF's continuous batching (each run of ours also against
the base run, and its K/V memory: bench_kv.py), and the plot.

The compute floor is the output throughput at which the workload's FLOPs would take the
device's matmul rate (``bench.matmul_rate``, measured in the same run at the run's
dtype). Counted, from the model's shapes (``ModelSpec``), per request of P prompt and O
output tokens:
- the layers' matmuls (qkv, o, gate_up or fc_in, down): 2 FLOPs a weight for each of the
  P + O - 1 tokens fed through the model (the last output token is sampled, never fed);
- the LM head: 2 H V FLOPs for each of the O rows sampled from (one a token, the prompt's
  last position giving the first);
- attention: QK^T and PV, 4 q_size FLOPs a layer for each key a fed token attends to (its
  position + 1, at most the sliding window): the causal triangle, no padding.
Not counted: norms, rotary, softmax, SiLU, the embedding lookup, biases. Every prompt
token is counted as computed, so a cache that reuses a shared prefix (the ``prefix``
dataset) can beat the floor. Decode steps of a small batch are bound by memory (every
weight read a step), not compute: there ours / floor is far below 1 by nature.
"""
from __future__ import annotations

import collections
import math
from pathlib import Path

from .serve_report import SECTIONS, fmt
from .step_census import table as census_table

LABEL, COLUMN = 34, 14
QUANTILES = ("p50", "p90", "p99")
# what a run is set against the base run on: (name, label, its value in a summary)
RATIOS = (("output_throughput", "Output tok/s", lambda s: s.get("output_throughput")),
          ("ttft_p50", "P50 TTFT", lambda s: (s.get("ttft_ms") or {}).get("p50")),
          ("ttft_p99", "P99 TTFT", lambda s: (s.get("ttft_ms") or {}).get("p99")),
          ("tpot_p50", "P50 TPOT", lambda s: (s.get("tpot_ms") or {}).get("p50")))


def vs_base(summary: dict, base: dict) -> dict:
    """Each of RATIOS of ``summary`` over ``base``'s (None where either has none)."""
    return {name: _ratio(get(summary), get(base)) for name, _, get in RATIOS}


def _ratio(x, ref):
    return x / ref if x is not None and ref else None


def workload_flops(spec, requests) -> dict:
    """{matmul, lm_head, attention, total}: the FLOPs of ``requests``
    (serve_workload.Request) on a model of ``spec``, counted as the module says."""
    return fed_flops(spec, [(0, len(r.prompt) + r.output_len - 1) for r in requests],
                     sum(r.output_len for r in requests))


def fed_flops(spec, fed, sampled: int) -> dict:
    """{matmul, lm_head, attention, total}: the FLOPs of feeding each (first position,
    tokens) span of ``fed`` through the layers and sampling ``sampled`` rows."""
    h, q, kv, i = spec.hidden_size, spec.q_size, spec.kv_size, spec.intermediate_size
    layer_weights = h * (q + 2 * kv) + q * h + h * i * (3 if spec.gated_mlp else 2)
    tokens = sum(n for _, n in fed)
    windows = layer_windows(spec)
    keys = sum(span_keys(windows, start, n) for start, n in fed)
    out = {"matmul": 2 * spec.num_layers * layer_weights * tokens,
           "lm_head": 2 * h * spec.vocab_size * sampled,
           "attention": 4 * q * keys}
    return dict(out, total=sum(out.values()))


def layer_windows(spec) -> dict:
    """{attention window (None: the whole context): the layers that have it}."""
    return collections.Counter(spec.layer_attention(i).window for i in range(spec.num_layers))


def span_keys(windows: dict, start: int, n: int) -> int:
    """The keys positions [start, start + n) attend to, summed over the layers (each its
    own window: ``layer_windows``): the QK^T and PV products of the span."""
    return sum(layers * (_keys_attended(start + n, w) - _keys_attended(start, w))
               for w, layers in windows.items())


def span_keys_read(windows: dict, start: int, n: int) -> int:
    """The keys positions [start, start + n) read at least once, summed over the layers:
    a layer reads every key any of them attends to, once (the first position's window
    and the span's own), the K/V bytes of the span."""
    return sum(layers * (start + n if w is None else min(start + n, w + n - 1))
               for w, layers in windows.items())


def _keys_attended(tokens: int, window: int | None) -> int:
    """Sum over positions 0..tokens-1 of the keys each attends to: min(pos + 1, window)."""
    w = min(tokens, window or tokens)
    return w * (w + 1) // 2 + (tokens - w) * w


def compute_floor(spec, requests, rate: float, measured: str) -> dict:
    """The floor of ``requests`` at ``rate`` FLOP/s (``measured``: how the rate was
    measured): its FLOPs, seconds and throughputs."""
    flops = workload_flops(spec, requests)
    seconds = flops["total"] / rate
    out_tokens = sum(r.output_len for r in requests)
    in_tokens = sum(len(r.prompt) for r in requests)
    return {"matmul_flops_per_s": rate, "rate_measured": measured, "flops": flops,
            "duration_s": seconds,
            "output_throughput": out_tokens / seconds,
            "total_token_throughput": (in_tokens + out_tokens) / seconds,
            "request_throughput": len(requests) / seconds}


def gpu_busy_share(summary: dict):
    """The share of a run's wall time its GPU spent in engine steps (``--step-gaps``'
    timed replays); None where they were not timed."""
    busy = (summary.get("step_gaps") or {}).get("busy_ms_total")
    return busy / (1e3 * summary["duration_s"]) if busy and summary.get("duration_s") else None


def table(rows: dict[str, dict], floor: dict, base: str | None = None) -> str:
    """Each system's summary (serve_workload.summarise, ``over_floor`` added) in a column,
    the floor's throughputs beside them, engine.stats() of ours, then how the floor was
    reached; ``base``: a column (``--compare-plugins`` / ``--compare-options``' base run)
    each column's out tok/s, TTFT and TPOT are set against."""
    names = [*rows, "compute floor"]
    col = max(COLUMN, 2 + max(map(len, names)))  # a sweep's labels name their budget
    width = LABEL + col * len(names)
    lines = [" Throughput Benchmark Result ".center(width, "="),
             " " * LABEL + "".join(f"{n:>{col}}" for n in names)]

    def line(label: str, key, floor_value=None) -> None:
        values = [s.get(key) if isinstance(key, str) else key(s) for s in rows.values()]
        lines.append(f"{label:<{LABEL}}" + "".join(f"{fmt(v):>{col}}" for v in values) +
                     f"{fmt(floor_value):>{col}}")

    line("Successful requests", "completed")
    line("Failed requests", "failed")
    line("Benchmark duration (s)", "duration_s", floor["duration_s"])
    line("Total input tokens", "total_input_tokens")
    line("Total generated tokens", "total_output_tokens")
    line("Request throughput (req/s)", "request_throughput", floor["request_throughput"])
    line("Output token throughput (tok/s)", "output_throughput", floor["output_throughput"])
    line("Total token throughput (tok/s)", "total_token_throughput",
         floor["total_token_throughput"])
    line("Output tok/s / compute floor", lambda s: _percent(s.get("over_floor")))
    line("GPU busy / duration", lambda s: _percent(gpu_busy_share(s)))
    for _, label, get in RATIOS if base else ():
        line(f"{label} / {base}", lambda s, g=get: _times(_ratio(g(s), g(rows[base]))))
    for key, short, title in SECTIONS[:3]:  # TTFT, TPOT, ITL
        lines.append(f" {title} ".center(width, "-"))
        for q in QUANTILES:
            line(f"{q.upper()} {short} (ms)", lambda s, k=key, q=q: (s.get(k) or {}).get(q))
    if any(s.get("kv") for s in rows.values()):
        _kv_lines(lines, line, width, rows)
    lines.append("=" * width)
    steps = next((s["engine"] for s in rows.values() if s.get("engine")), None)
    if steps:
        lines.append(f"engine steps: {steps['num_steps']} ({steps['num_prefill_steps']} with "
                     f"prompt tokens), {steps['step_seconds_total']:.2f} s in them")
    f = floor["flops"]
    lines.append(f"compute floor: {f['total'] / 1e9:.2f} GFLOP (matmuls "
                 f"{f['matmul'] / 1e9:.2f}, LM head {f['lm_head'] / 1e9:.2f}, attention "
                 f"{f['attention'] / 1e9:.2f}) at {floor['matmul_flops_per_s'] / 1e12:.3f} "
                 f"TFLOP/s ({floor['rate_measured']})")
    for name, s in rows.items():
        g = s.get("step_gaps") or {}
        if "gap_ms" in g:
            lines.append(f"{name}: GPU idle between steps {100 * g['idle_share']:.1f}% of "
                         f"{g['span_ms'] / 1e3:.2f} s ({g['steps']} steps; gap P50/P99 "
                         f"{g['gap_ms']['p50']:.2f}/{g['gap_ms']['p99']:.2f} ms, step "
                         f"P50/P99 {g['busy_ms']['p50']:.2f}/{g['busy_ms']['p99']:.2f} ms)")
    for name, s in rows.items():
        if s.get("step_census"):
            lines.append(f"{name}: where the run's wall time goes, step by step "
                         f"(--step-census):\n{census_table(s['step_census'])}")
    for name, s in rows.items():
        if s.get("first_error"):
            lines.append(f"{name} first error: {s['first_error']}")
    return "\n".join(lines)


def _kv_lines(lines, line, width, rows) -> None:
    """engine.stats() over each run of ours (bench_kv.py), and how its outputs came out."""
    lines.append(" K/V memory (engine.stats(), the run's) ".center(width, "-"))

    def kv(key):
        return lambda s: (s.get("kv") or {}).get(key)
    line("Prefix cache hit rate", lambda s: _percent(kv("prefix_cache_hit_rate")(s)))
    line("Prefix cache hits / queries (tok)", lambda s: s.get("kv") and
         f"{s['kv']['prefix_cache_hits']}/{s['kv']['prefix_cache_queries']}")
    line("Preemptions (swapped, recomputed)", lambda s: s.get("kv") and
         f"{s['kv']['num_preemptions']} ({s['kv']['num_swapped_out']}, "
         f"{s['kv']['num_recomputed']})")
    line("K/V blocks total", kv("kv_blocks_total"))
    line("Every output its full length", lambda s: {True: "yes", False: "NO"}.get(
        s.get("full_length")))
    if any(s.get("alone") for s in rows.values()):
        line("Tokens as alone (greedy)", lambda s: s.get("alone") and
             f"{s['alone']['equal']}/{s['alone']['checked']}")


def _times(x) -> str | None:
    return None if x is None else f"{x:.2f}x"


def _percent(x) -> str | None:
    return None if x is None else f"{x:.1%}"


def plot(rows: dict[str, dict], floor: dict, path: Path, title: str) -> bool:
    """Output and total token throughput of each system and the floor (bars), and TTFT,
    TPOT, ITL P50/P90/P99 of each system (log scale); False (nothing written) when
    matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (thr, lat) = plt.subplots(1, 2, figsize=(11, 4))
    bars = {**rows, "compute floor": floor}
    for k, key in enumerate(("output_throughput", "total_token_throughput")):
        xs = [j + 0.4 * k for j in range(len(bars))]
        thr.bar(xs, [s.get(key) or 0 for s in bars.values()], width=0.4,
                label=key.replace("_throughput", " tok/s").replace("_token", ""))
    thr.set_xticks([j + 0.2 for j in range(len(bars))], list(bars))
    thr.set(yscale="log", ylabel="tokens / s", title="throughput")
    thr.legend(fontsize=8)
    labels = [f"{short} {q.upper()}" for _, short, _ in SECTIONS[:3] for q in QUANTILES]
    step = 0.8 / max(1, len(rows))
    for k, (name, s) in enumerate(rows.items()):  # one colour a system
        ys = [(s.get(key) or {}).get(q) for key, _, _ in SECTIONS[:3] for q in QUANTILES]
        lat.bar([j + step * k for j in range(len(labels))],
                [math.nan if y is None else y for y in ys], width=step, label=name)
    lat.set_xticks([j + 0.4 - step / 2 for j in range(len(labels))], labels, rotation=45,
                   fontsize=8)
    lat.set(yscale="log", ylabel="latency (ms)", title="latency percentiles")
    lat.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
