"""``GET /metrics``: Prometheus text format, one ``CollectorRegistry`` per app (two apps
in one process do not share counts). Gauges and token totals are read from
``aengine.stats()`` at each scrape (the engine's K/V memory too: prefix-cache queries and
hits, blocks total and free, preemptions swapped out or recomputed); request outcomes and
latencies are recorded by the server as requests finish (names as vLLM's, ``vllm:`` ->
``infergraft_``, where vLLM has the figure)."""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# name -> (the key stats() gives it under, help); counters get Prometheus' _total suffix
# (infergraft_prefix_cache_queries_total, as vLLM's vllm:prefix_cache_queries_total)
GAUGES = {"requests_running": ("requests_running", "Requests in the running batch."),
          "requests_waiting": ("requests_waiting", "Requests queued for admission."),
          "kv_cache_usage_ratio": ("kv_cache_usage_ratio",
                                   "K/V cache in use, 0 to 1 (blocks or rows)."),
          "kv_blocks": ("kv_blocks_total", "K/V blocks in the pool (0: a row per sequence)."),
          "kv_blocks_free": ("kv_blocks_free", "K/V blocks of the pool free now."),
          "spec_decode_draft_acceptance_rate": (
              "spec_decode_draft_acceptance_rate",
              "Speculative decoding: proposed tokens kept, 0 to 1, since the start.")}
COUNTERS = {"prompt_tokens": ("prompt_tokens_total", "Prompt tokens prefilled."),
            "generation_tokens": ("generation_tokens_total", "Tokens generated."),
            "prefix_cache_queries": ("prefix_cache_queries",
                                     "Prompt tokens looked up in the prefix cache."),
            "prefix_cache_hits": ("prefix_cache_hits",
                                  "Prompt tokens found in the prefix cache (not computed)."),
            "num_preemptions": ("num_preemptions",
                                "Sequences preempted (swapped out or recomputed)."),
            "num_swapped_out": ("num_swapped_out",
                                "Preempted sequences whose K/V blocks went to host memory."),
            "num_recomputed": ("num_recomputed",
                               "Preempted sequences whose K/V was freed, to prefill again."),
            "engine_steps": ("num_steps", "Engine steps taken (prefill and decode)."),
            "engine_prefill_steps": ("num_prefill_steps",
                                     "Engine steps that prefilled (decode tokens may ride)."),
            "engine_step_seconds": ("step_seconds_total", "Seconds spent in engine steps."),
            "spec_decode_num_drafts": ("spec_decode_num_drafts",
                                       "Speculative decoding: drafts verified (a request's "
                                       "proposed tokens in one step)."),
            "spec_decode_num_draft_tokens": ("spec_decode_num_draft_tokens",
                                             "Speculative decoding: proposed tokens verified."),
            "spec_decode_num_accepted_tokens": ("spec_decode_num_accepted_tokens",
                                                "Speculative decoding: proposed tokens kept.")}
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,
                0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
               30.0, 40.0, 50.0, 60.0, 120.0, 240.0)


class _StatsCollector:
    """The engine's own counts, read when scraped (never stale, nothing to keep in sync)."""

    def __init__(self, aengine):
        self.aengine = aengine

    def collect(self):
        stats = self.aengine.stats()
        for name, (key, help) in GAUGES.items():
            yield GaugeMetricFamily(f"infergraft_{name}", help, value=float(stats.get(key, 0)))
        for name, (key, help) in COUNTERS.items():
            yield CounterMetricFamily(f"infergraft_{name}", help,
                                      value=float(stats.get(key, 0)))


class ServerMetrics:
    def __init__(self, aengine):
        self.registry = CollectorRegistry()
        self.registry.register(_StatsCollector(aengine))
        r = self.registry
        self.success = Counter("infergraft_request_success", "Requests finished, by reason "
                               "(stop, length, abort: the client left or the server shut "
                               "down, error).", ["finish_reason"], registry=r)
        self.ttft = Histogram("infergraft_time_to_first_token_seconds",
                              "Seconds from arrival to the first token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("infergraft_time_per_output_token_seconds",
                              "Mean seconds per output token after the first, per request.",
                              buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("infergraft_e2e_request_latency_seconds",
                             "Seconds from arrival to the last token.",
                             buckets=E2E_BUCKETS, registry=r)
        self.http_errors = Counter("infergraft_http_errors", "Requests answered with an "
                                   "error, by HTTP status.", ["status"], registry=r)
        for reason in ("stop", "length", "abort", "error"):  # listed from the first scrape
            self.success.labels(reason)

    def finished(self, reason: str | None, metrics=None) -> None:
        """One request (one choice) ended; ``metrics``: its RequestMetrics, if it has one."""
        self.success.labels(reason or "abort").inc()
        if metrics is None:
            return
        if metrics.ttft is not None:
            self.ttft.observe(metrics.ttft)
        if metrics.tpot is not None:
            self.tpot.observe(metrics.tpot)
        end = metrics.finished if metrics.finished is not None else time.perf_counter()
        self.e2e.observe(max(0.0, end - metrics.arrival))

    def error(self, status: int) -> None:
        self.http_errors.labels(str(status)).inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
