"""What one big request can do to ``infergraft serve`` (a real process): a body over
--max-request-bytes is a 413 in OpenAI's shape, however it is sent; a long prompt is
tokenised off the event loop, /health and other requests answered meanwhile."""
import json
import threading
import time

import httpx
import openai
import pytest
from serve_support import serving, tiny_model

LIMIT = 2 * 1024 * 1024
# SmolLM2's bound (81 bytes a token at most) proves nothing below 81 * 32767 bytes: the
# long prompt below is tokenised whole, then refused by its count
MAX_SEQ = 32768
LONG_PROMPT = "hello world. " * 120_000  # 1.56 MB, 360k tokens: seconds of tokenising


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(tiny_model(tmp_path_factory), "--max-request-bytes", "2MiB",
                 "--max-seq-len", str(MAX_SEQ), "--max-batch-size", "2") as s:
        yield s


def assert_too_large(status: int, body: dict) -> None:
    assert status == 413, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"]) == ("invalid_request_error", "request_too_large")
    assert str(LIMIT) in error["message"] and "--max-request-bytes" in error["message"]


def test_a_body_over_the_limit_is_413_however_it_is_sent(server):
    big = "x" * (LIMIT + 1)
    with pytest.raises(openai.APIStatusError) as e:
        server.client().completions.create(model=server.model, prompt=big, max_tokens=1)
    assert type(e.value) is openai.APIStatusError  # no subclass of its own for a 413
    assert_too_large(e.value.status_code, e.value.response.json())
    assert e.value.code == "request_too_large"
    url = f"{server.url}/v1/chat/completions"
    body = json.dumps({"messages": [{"role": "user", "content": big}]}).encode()
    declared = httpx.post(url, content=body)  # Content-Length: refused before it is read
    assert declared.request.headers["content-length"] == str(len(body))
    assert_too_large(declared.status_code, declared.json())

    def chunks():  # no Content-Length: counted as it comes
        for i in range(0, len(body), 64 * 1024):
            yield body[i:i + 64 * 1024]

    streamed = httpx.post(url, content=chunks())
    assert streamed.request.headers["transfer-encoding"] == "chunked"
    assert "content-length" not in streamed.request.headers
    assert_too_large(streamed.status_code, streamed.json())
    ok = server.client().completions.create(model=server.model, prompt="Hi", max_tokens=2)
    assert ok.usage.completion_tokens == 2


def test_health_answers_while_a_long_prompt_is_tokenised(server):
    body = json.dumps({"model": server.model, "prompt": LONG_PROMPT, "max_tokens": 1}).encode()
    sent, finished, got = threading.Event(), threading.Event(), {}

    def chunks():
        yield body[:-1]
        sent.set()
        yield body[-1:]  # the server has it all now, and begins

    def long_request():
        got["long"] = httpx.post(f"{server.url}/v1/completions", content=chunks(), timeout=120)
        finished.set()

    worker = threading.Thread(target=long_request)
    worker.start()
    assert sent.wait(30)
    time.sleep(0.3)  # decoded and being tokenised (seconds) by now
    answered = []
    for _ in range(3):  # each while the long one is still being tokenised
        answered.append(httpx.get(f"{server.url}/health", timeout=60).status_code)
        assert not finished.is_set(), "/health waited for the long prompt's tokenising"
    worker.join(120)
    assert answered == [200] * 3
    error = got["long"].json()["error"]  # and the long one gets its answer: too long
    assert got["long"].status_code == 400 and error["code"] == "context_length_exceeded"
    assert f"max_seq_len={MAX_SEQ}" in error["message"] and "takes 360001 tokens" in \
        error["message"]
