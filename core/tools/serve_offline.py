"""``infergraft bench serve --offline-model M``: the served requests again, through an
in-process engine, so that the server's cost (HTTP, streaming, the asynchronous engine's
thread) shows as one ratio measured in the same run on the same machine.

The offline run submits the same token-id prompts with the same output lengths, at most
``--max-concurrency`` in flight (all at once without it), and steps the engine until every
request has finished; its figures are summarised exactly as the served ones (TTFT from
submission, ITL between a request's tokens).
"""
from __future__ import annotations

import time

import attrs

from ..request import SamplingParams
from ..serving.engine_thread import StepCounts
from .serve_workload import Record, summarise


def offline_summary(engine, requests, max_concurrency: int | None, after_warm_up=None) -> dict:
    """The summary of ``requests`` (serve_workload.Request) run through ``engine``;
    ``after_warm_up()``, if given, is called once the warm-up is done."""
    _warm_up(engine, requests[0])
    if after_warm_up is not None:
        after_warm_up()
    pending, live, records = list(requests), {}, []
    cap = max_concurrency or len(requests)
    counts = StepCounts()
    start = time.perf_counter()
    while pending or live:
        while pending and len(live) < cap:
            r = pending.pop(0)
            params = SamplingParams(max_new_tokens=r.output_len, ignore_eos=True)
            live[engine.add_request(list(r.prompt), params)] = r
        counts.step(engine)
        for seq in [s for s in live if s.finished]:
            records.append(_record(seq, live.pop(seq)))
    # the step counts are the server's /metrics infergraft_engine_* counters' counterparts
    return dict(summarise(records, time.perf_counter() - start), engine=attrs.asdict(counts))


def _warm_up(engine, request) -> None:
    # the first steps of a shape allocate, compile and capture: not what a run measures
    # (at most the request's own output: its prompt + output fit max_seq_len)
    seq = engine.add_request(list(request.prompt), SamplingParams(
        max_new_tokens=min(4, request.output_len), ignore_eos=True))
    while not seq.finished:
        engine.step()


def _record(seq, request) -> Record:
    m = seq.metrics
    rec = Record(len(request.prompt), request.output_len, usage_tokens=len(seq.output_ids),
                 chunks=len(m.token_times))
    if seq.finish_reason not in ("length", "stop") or not m.token_times:
        rec.error = f"finished with {seq.finish_reason!r}: {seq.error}"
        return rec
    times = [t - m.arrival for t in m.token_times]
    rec.ttft, rec.e2el = times[0], times[-1]
    rec.itl = [b - a for a, b in zip(times, times[1:])]
    return rec
