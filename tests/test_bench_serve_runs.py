"""`infergraft bench serve` end to end: against a small real streaming server started in
the test (timings, failures, a cut-short stream, a wrong key) and against `infergraft
serve` itself with a tiny model."""
import asyncio
import contextlib
import importlib.util
import json
import socket
import threading
import time

import pytest

from infergraft.core.cli import main as cli_main
from infergraft.core.tools.serve_workload import FIRST_ID

HAS_MPL = importlib.util.find_spec("matplotlib") is not None


@contextlib.contextmanager
def stub_server(first_ms: float, gap_ms: float, fail_every: int = 0, api_key=None,
                cut_short: bool = False):
    """A real HTTP server on 127.0.0.1 (uvicorn in a thread): /v1/models names "stub";
    /v1/completions streams ``max_tokens`` chunks, the first after ``first_ms``, then one
    every ``gap_ms``, then usage when asked; request number k (the warm-up is 1) fails
    with 400 when ``fail_every`` divides k; ``cut_short``: no [DONE]. Yields (url, state):
    the requests it got and the most it streamed at once."""
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    app, state = FastAPI(), {"requests": 0, "now": 0, "peak": 0}

    def error(status: int, message: str):
        return JSONResponse({"error": {"message": message, "type": "invalid_request_error",
                                       "param": None, "code": None}}, status)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "stub", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        state["requests"] += 1
        if api_key and request.headers.get("authorization") != f"Bearer {api_key}":
            return error(401, "wrong API key")
        if fail_every and state["requests"] % fail_every == 0:
            return error(400, "planned failure")
        prompt = body["prompt"]
        if not (body["stream"] and body["ignore_eos"] is True and body["model"] == "stub"
                and all(isinstance(t, int) and t >= FIRST_ID for t in prompt)):
            return error(400, f"not what bench serve should send: {body}")

        async def events():
            state["now"] += 1
            state["peak"] = max(state["peak"], state["now"])
            try:
                await asyncio.sleep(first_ms / 1e3)
                for i in range(body["max_tokens"]):
                    if i:
                        await asyncio.sleep(gap_ms / 1e3)
                    chunk = {"object": "text_completion", "choices": [
                        {"index": 0, "text": f" t{i}", "finish_reason": None}]}
                    yield f"data: {json.dumps(chunk)}\n\n"
                if (body.get("stream_options") or {}).get("include_usage"):
                    usage = {"prompt_tokens": len(prompt),
                             "completion_tokens": body["max_tokens"]}
                    yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                if not cut_short:
                    yield "data: [DONE]\n\n"
            finally:
                state["now"] -= 1
        return StreamingResponse(events(), media_type="text/event-stream")

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    end = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < end, "the stub server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", state
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def test_a_run_against_a_streaming_server_measures_what_it_serves(tmp_path, capsys):
    with stub_server(first_ms=40, gap_ms=4, api_key="sk-test") as (url, state):
        rc = cli_main(["bench", "serve", "--base-url", url, "--num-prompts", "12",
                       "--prompt-len", "16", "--output-len", "6", "--vocab-size", "500",
                       "--sweep-rates", "inf,50", "--max-concurrency", "4",
                       "--goodput", "ttft:5000", "e2el:10", "--api-key", "sk-test",
                       "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0
    assert state["requests"] == 1 + 2 * 12 and state["peak"] == 4  # warm-up, two rates
    assert "Serving Benchmark Result" in out and "P90 TTFT (ms)" in out
    data = json.loads((tmp_path / "serve.json").read_text())
    assert data["model"] == "stub" and [r["request_rate"] for r in data["runs"]] == ["inf", 50]
    assert data["args"]["api_key"] == "(set)" and "sk-test" not in json.dumps(data)
    assert data["args"]["goodput"] == {"ttft": 5000, "e2el": 10} and data["commit"]
    for run in data["runs"]:
        assert run["completed"] == 12 and run["failed"] == 0
        assert run["total_output_tokens"] == 12 * 6 and run["total_input_tokens"] == 12 * 16
        assert run["peak_concurrency"] <= 4
        assert 40 <= run["ttft_ms"]["p50"] <= run["ttft_ms"]["p90"] <= run["ttft_ms"]["p99"]
        # 4 ms between chunks as sent (half of it as read, on a busy machine)
        assert 2 <= run["tpot_ms"]["p50"] < 40 and run["itl_ms"]["p50"] >= 2
        assert run["good_requests"] == 0  # no request ends within 10 ms of being sent
    assert data["runs"][0]["peak_concurrency"] == 4  # inf: the cap is what holds them back
    assert (tmp_path / "serve.png").exists() == HAS_MPL
    assert ("no serve.png: matplotlib is not installed" in out) != HAS_MPL


def test_failed_requests_are_counted_with_the_first_error(tmp_path, capsys):
    with stub_server(first_ms=1, gap_ms=1, fail_every=3) as (url, _):  # every third after the first
        assert cli_main(["bench", "serve", "--base-url", url, "--num-prompts", "9",
                         "--prompt-len", "4", "--output-len", "3", "--vocab-size", "50",
                         "--request-rate", "200", "--out", str(tmp_path)]) == 0
    capsys.readouterr()
    run = json.loads((tmp_path / "serve.json").read_text())["runs"][0]
    assert (run["completed"], run["failed"]) == (6, 3)
    assert run["first_error"].startswith("HTTP 400") and "planned failure" in run["first_error"]


def test_a_stream_cut_short_or_a_wrong_key_fails_the_warm_up_in_one_line(tmp_path, capsys):
    argv = ["bench", "serve", "--num-prompts", "2", "--output-len", "2", "--out", str(tmp_path)]
    with stub_server(first_ms=1, gap_ms=1, cut_short=True) as (url, _):
        assert cli_main(argv + ["--base-url", url]) == 2
    assert "warm-up request" in capsys.readouterr().err.splitlines()[-1]
    with stub_server(first_ms=1, gap_ms=1, api_key="sk-right") as (url, state):
        assert cli_main(argv + ["--base-url", url, "--api-key", "sk-wrong"]) == 2
        assert state["requests"] == 1  # the warm-up only
    assert "HTTP 401" in capsys.readouterr().err and not (tmp_path / "serve.json").exists()


# 6) Against `infergraft serve` itself
def test_bench_serve_against_infergraft_serve_with_a_tiny_model(tmp_path, capsys):
    import httpx
    from cli_support import tiny_chat_model
    from serve_support import serving

    model = tiny_chat_model(tmp_path / "model")
    with serving(model, "--max-batch-size", "8") as server:
        rc = cli_main(["bench", "serve", "--base-url", server.url, "--num-prompts", "8",
                       "--prompt-len", "16", "--output-len", "8", "--sweep-rates", "inf,4",
                       "--goodput", "ttft:60000", "--out", str(tmp_path / "o"),
                       "--offline-model", str(model), "--offline-max-batch-size", "8",
                       "--offline-hf"])
        out = capsys.readouterr().out
        assert rc == 0, out + server.output()
        served = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
        assert server.gauge("infergraft_requests_running") == 0  # every request left
    assert "Serving Benchmark Result" in out
    data = json.loads((tmp_path / "o" / "serve.json").read_text())
    assert data["model"] == served and [r["request_rate"] for r in data["runs"]] == ["inf", 4]
    for run in data["runs"]:
        assert run["completed"] == 8 and run["failed"] == 0, run["first_error"]
        # the server's usage: ignore_eos held every request to its max_tokens
        assert run["total_output_tokens"] == 8 * 8 and run["total_input_tokens"] == 8 * 16
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
            s = run[key]
            assert 0 < s["p50"] <= s["p90"] <= s["p99"], (key, s)
        assert run["good_requests"] == 8 and run["output_throughput"] > 0
    assert data["runs"][0]["peak_concurrency"] == 8  # inf: all at once
    steps = data["runs"][0]["engine"]  # the server's own counters over the run
    assert 8 <= steps["num_steps"] and 1 <= steps["num_prefill_steps"] < steps["num_steps"]
    # the rate-inf run again in-process: the same requests, the same token counts
    offline = data["offline"]
    assert offline["rate_compared"] == "inf" and offline["completed"] == 8
    assert offline["total_output_tokens"] == 8 * 8 and offline["total_input_tokens"] == 8 * 16
    assert offline["server_over_offline"] == pytest.approx(
        data["runs"][0]["output_throughput"] / offline["output_throughput"])
    assert 0 < offline["ttft_ms"]["p50"] <= offline["ttft_ms"]["p99"]
    # and through HF's continuous batching: every request to its length, timed per token
    hf = offline["hf"]
    assert hf["completed"] == 8 and hf["total_output_tokens"] == 8 * 8, hf
    assert 0 < hf["ttft_ms"]["p50"] <= hf["e2el_ms"]["p99"] <= hf["duration_s"] * 1e3
    assert hf["served_over_hf"] == pytest.approx(
        data["runs"][0]["output_throughput"] / hf["output_throughput"])


def test_a_model_without_tokenizer_streams_token_ids_and_bench_serve_times_them(tmp_path, capsys):
    import httpx
    import safetensors.torch
    from serve_support import serving

    from infergraft.core.testing.models import random_model, tiny_llama_config

    model = tmp_path / "no-tokenizer"
    hf = random_model(tiny_llama_config(), seed=4, scale=5.0)
    hf.config.save_pretrained(model)
    safetensors.torch.save_model(hf, str(model / "model.safetensors"))
    with serving(model, "--max-batch-size", "4") as server:
        body = {"model": str(model), "prompt": [11, 12, 13, 14], "max_tokens": 5,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as resp:
            events = [json.loads(line[6:]) for line in resp.iter_lines()
                      if line.startswith("data: {")]
        ids = [t for e in events for c in e["choices"] for t in c["token_ids"]]
        assert len(ids) == 5 and all(c["text"] == "" for e in events for c in e["choices"])
        rc = cli_main(["bench", "serve", "--base-url", server.url, "--num-prompts", "4",
                       "--prompt-len", "8", "--output-len", "6", "--vocab-size", "256",
                       "--out", str(tmp_path / "o")])
        out = capsys.readouterr().out
        assert rc == 0, out + server.output()
    run = json.loads((tmp_path / "o" / "serve.json").read_text())["runs"][0]
    assert run["completed"] == 4 and run["total_output_tokens"] == 24
    assert 0 < run["ttft_ms"]["p50"] <= run["e2el_ms"]["p50"] and run["tpot_ms"]["p50"] > 0
