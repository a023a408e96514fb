"""The client side of ``infergraft bench serve``: streamed ``POST /v1/completions``
requests sent at their arrival times through one httpx client, each read into a Record as
its server-sent events arrive, one summary per request rate."""
from __future__ import annotations

import asyncio
import contextlib
import sys
import time

from ..errors import InfergraftError
from .serve_report import table
from .serve_workload import Record, make_requests, parse_sse_line, send_times, summarise


async def stream_request(client, url: str, body: dict, headers: dict, rec: Record) -> None:
    """POST one streamed request, filling ``rec`` as its chunks arrive."""
    start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                rec.error = f"HTTP {resp.status_code}: {text[:300]}"
                return
            async for line in resp.aiter_lines():
                event = parse_sse_line(line)
                if event == "[DONE]":
                    rec.finish(time.perf_counter() - start)
                    return
                if event is not None:
                    rec.on_event(event, time.perf_counter() - start)
                    if rec.error:
                        return
        rec.error = "the stream ended before its data: [DONE] (the server cut it short)"
    # anything the transport or the server does wrong is the request's failure, counted
    # and reported, not the benchmark's
    except Exception as e:
        rec.error = f"{type(e).__name__}: {e}"


async def run_rate(client, args, model: str, requests, rate: float) -> dict:
    """One run of ``requests`` at ``rate``: its summary (serve_workload.summarise)."""
    url, headers = f"{args.base_url}/completions", _headers(args)
    times = send_times(len(requests), rate, args.burstiness, args.seed)
    gate = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    records = [Record(len(r.prompt), r.output_len) for r in requests]
    flight = {"now": 0, "peak": 0}
    start = time.perf_counter()

    async def one(i: int) -> None:
        await asyncio.sleep(max(0.0, start + times[i] - time.perf_counter()))
        async with gate or contextlib.nullcontext():
            flight["now"] += 1
            flight["peak"] = max(flight["peak"], flight["now"])
            await stream_request(client, url, _body(model, requests[i]), headers, records[i])
            flight["now"] -= 1

    await asyncio.gather(*(one(i) for i in range(len(requests))))
    summary = summarise(records, time.perf_counter() - start, args.goodput)
    return {"request_rate": rate, "burstiness": args.burstiness,
            "max_concurrency": args.max_concurrency, "peak_concurrency": flight["peak"],
            **summary}


def _body(model: str, request) -> dict:
    return {"model": model, "prompt": list(request.prompt), "max_tokens": request.output_len,
            "ignore_eos": True, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}


def _headers(args) -> dict:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


async def _served_model(client, args) -> str:
    try:
        resp = await client.get(f"{args.base_url}/models", headers=_headers(args))
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except Exception as e:
        raise InfergraftError(f"cannot list the models at {args.base_url}/models "
                              f"({type(e).__name__}: {e}); give --model") from None


async def benchmark(args) -> tuple[str, list[dict]]:
    """(model, one summary per rate): a warm-up request first, then each rate in turn.

    Each rate's run draws prompts of its own (seeded by --seed and the run's place), and
    the warm-up one of its own, so that a server's prefix cache serves no run from an
    earlier one; within a run, the prefix workload's prompts still share their prefix."""
    import httpx

    def draw(n: int, tag) -> list:
        return make_requests(args.dataset, n, args.prompt_len, args.output_len,
                             args.vocab_size, seed=f"{args.seed}:{tag}")

    url = f"{args.base_url}/completions"
    # httpx pools 100 connections by default: a hidden cap on the requests in flight
    limits = httpx.Limits(max_connections=args.max_concurrency, max_keepalive_connections=None)
    timeout = httpx.Timeout(None, connect=30.0)  # a loaded server may take long to answer
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        model = args.model or await _served_model(client, args)
        warm_up = draw(1, "warm-up")[0]
        warm = Record(len(warm_up.prompt), warm_up.output_len)
        await stream_request(client, url, _body(model, warm_up), _headers(args), warm)
        if not warm.ok:
            raise InfergraftError(f"the warm-up request to {url} failed: {warm.error}")
        runs = []
        for i, rate in enumerate(args.rates):
            print(f"rate {rate:g} req/s: {args.num_prompts} requests ...", file=sys.stderr)
            before = await engine_counters(client, args)
            runs.append(await run_rate(client, args, model, draw(args.num_prompts, i), rate))
            after = await engine_counters(client, args)
            if before and after:  # the server's own step counts over the run
                runs[-1]["engine"] = {k: after[k] - before.get(k, 0) for k in after}
            print(table(runs[-1]))
    return model, runs


ENGINE_COUNTERS = {"infergraft_engine_steps_total": "num_steps",
                   "infergraft_engine_prefill_steps_total": "num_prefill_steps",
                   "infergraft_engine_step_seconds_total": "step_seconds_total"}


async def engine_counters(client, args) -> dict | None:
    """An infergraft server's step counters from its /metrics (None from other servers)."""
    root = args.base_url[:-3] if args.base_url.endswith("/v1") else args.base_url
    try:
        resp = await client.get(f"{root}/metrics", headers=_headers(args))
        resp.raise_for_status()
    except Exception:  # noqa: BLE001 -- not every server has them
        return None
    found = {}
    for line in resp.text.splitlines():
        name, _, value = line.partition(" ")
        if name in ENGINE_COUNTERS:
            found[ENGINE_COUNTERS[name]] = float(value)
    return found or None
