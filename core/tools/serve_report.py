"""How ``infergraft bench serve`` shows a run: the table ``vllm bench serve`` users know
(with P90 beside P50 and P99), and a plot of latency percentiles and throughput against the
request rate."""
from __future__ import annotations

import math
from pathlib import Path

WIDTH = 50
SECTIONS = (("ttft_ms", "TTFT", "Time to First Token"),
            ("tpot_ms", "TPOT", "Time per Output Token (excl. 1st token)"),
            ("itl_ms", "ITL", "Inter-token Latency"),
            ("e2el_ms", "E2EL", "End-to-end Latency"))


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def fmt(value) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def table(run: dict) -> str:
    """One rate's summary (bench_serve.run_rate) as a fixed-width table."""
    rows = [" Serving Benchmark Result ".center(WIDTH, "=")]

    def line(label: str, value) -> None:
        rows.append(f"{label + ':':<40}{fmt(value):<10}")

    line("Request rate (req/s)", rate_label(run["request_rate"]))
    line("Burstiness", run["burstiness"])
    line("Max concurrency", run["max_concurrency"])
    line("Peak concurrent requests", run["peak_concurrency"])
    line("Successful requests", run["completed"])
    line("Failed requests", run["failed"])
    line("Benchmark duration (s)", run["duration_s"])
    line("Total input tokens", run["total_input_tokens"])
    line("Total generated tokens", run["total_output_tokens"])
    line("Request throughput (req/s)", run["request_throughput"])
    if run["goodput"] is not None:
        line("Request goodput (req/s)", run["goodput"])
    line("Output token throughput (tok/s)", run["output_throughput"])
    line("Total token throughput (tok/s)", run["total_token_throughput"])
    for key, short, title in SECTIONS:
        rows.append(title.center(WIDTH, "-"))
        stats = run[key]
        line(f"Mean {short} (ms)", stats["mean"])
        for q in ("p50", "p90", "p99"):
            line(f"{q.upper()} {short} (ms)", stats[q])
    rows.append("=" * WIDTH)
    if run["first_error"]:
        rows.append(f"first error: {run['first_error']}")
    return "\n".join(rows)


def jsonable(obj):
    """``obj`` with infinite rates as "inf" (JSON has no infinity) and NaN as null."""
    if isinstance(obj, dict):
        return {k: jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return "inf" if obj > 0 else None
    return obj


def plot(runs: list[dict], path: Path, title: str) -> bool:
    """Latency P50/P99 of TTFT, TPOT, ITL, E2EL (log scale) and token throughput against
    the rate, one point per run; False (nothing written) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    runs = sorted(runs, key=lambda r: r["request_rate"])
    x = range(len(runs))  # evenly spaced, so that inf has a place
    fig, (lat, thr) = plt.subplots(1, 2, figsize=(11, 4))
    for color, (key, short, _) in enumerate(SECTIONS):
        for q, style in (("p50", "-"), ("p99", "--")):  # one colour a metric
            ys = [r[key][q] for r in runs]
            lat.plot(x, [math.nan if y is None else y for y in ys], style, marker="o",
                     color=f"C{color}", label=f"{short} {q.upper()}")
    lat.set(yscale="log", ylabel="latency (ms)", title="latency")
    lat.legend(fontsize=8)
    thr.plot(x, [r["output_throughput"] for r in runs], marker="o", label="output tok/s")
    thr.plot(x, [r["total_token_throughput"] for r in runs], marker="o", label="total tok/s")
    thr.set(ylabel="tokens / s", title="throughput")
    thr.legend(fontsize=8)
    for ax in (lat, thr):
        ax.set_xticks(list(x), [rate_label(r["request_rate"]) for r in runs])
        ax.set_xlabel("request rate (req/s)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
