"""Hostile bodies at one real ``infergraft serve``: whatever JSON (or near-JSON) comes to
/v1/completions or /v1/chat/completions, the answer is a 4xx in OpenAI's error shape or a
200, never a 5xx, and a valid request after it still gets its 200."""
import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serve_support import serving, tiny_model

MAX_SEQ = 64  # what a valid request that a mutation left valid can cost
SURROGATES = ["\ud800", "\udfff", "x\udc00y", "\ud83d"]  # lone: no pair
# JSON text json.dumps would not write (or not this way), by name: placed into the body
RAW = {"nan": "NaN", "-inf": "-Infinity", "1e400": "1e400", "-1e400": "-1e400",
       "5001 digits": "1" + "0" * 5000, "4000 digits": "1" * 4000,
       "100k [": "[" * 100_000, "5000 [[]]": "[" * 5000 + "]" * 5000,
       "3000 {}": '{"a":' * 3000 + "1" + "}" * 3000, "escaped \\ud800": '"\\ud800"',
       "escaped pair reversed": '"\\udfff\\ud800"', "escaped nul": '"\\u0000"',
       "30 digits": "123456789012345678901234567890", "-0": "-0", "1.5e-400": "1.5e-400"}

class Raw:
    """One of RAW, by name: placed into the body as it is, not as a JSON string."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:  # what a failing example shows
        return f"Raw({self.name!r})"


texts = st.text(max_size=12) | st.builds(lambda a, s: a + s, st.text(max_size=4),
                                         st.sampled_from(SURROGATES))
scalars = (st.none() | st.booleans() | st.integers() | st.floats() | texts
           | st.sampled_from([0, -1, 2 ** 63, 2 ** 64 + 1, 10 ** 300, 1e308, 0.5, 129]))
json_values = st.recursive(scalars, lambda kids: st.lists(kids, max_size=4)
                           | st.dictionaries(texts, kids, max_size=4), max_leaves=12)
weird = json_values | st.sampled_from(sorted(RAW)).map(Raw)

COMPLETION_FIELDS = ["model", "prompt", "max_tokens", "temperature", "top_p", "n", "stream",
                     "stream_options", "seed", "stop", "presence_penalty", "frequency_penalty",
                     "logprobs", "top_k", "min_p", "repetition_penalty", "ignore_eos",
                     "best_of", "echo", "suffix", "logit_bias", "user", "\ud800",
                     "response_format", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar", "structured_outputs"]
CHAT_FIELDS = [f for f in COMPLETION_FIELDS if f not in ("prompt", "best_of", "echo", "suffix")
               ] + ["messages", "max_completion_tokens", "top_logprobs", "tools",
                    "tool_choice", "parallel_tool_calls"]


def dumps(body, ascii_only: bool) -> bytes:
    """``body`` as JSON bytes, its Raw values as they are; not ascii_only: the string's own
    characters, a lone surrogate as the 3 bytes UTF-8 would give it."""
    raws = []

    def mark(value):
        if isinstance(value, Raw):
            raws.append(RAW[value.name])
            return f"@@raw{len(raws) - 1}@@"
        if isinstance(value, dict):
            return {k: mark(v) for k, v in value.items()}
        if isinstance(value, list):
            return [mark(v) for v in value]
        return value

    text = json.dumps(mark(body), ensure_ascii=ascii_only)
    for i, raw in enumerate(raws):
        text = text.replace(f'"@@raw{i}@@"', raw)
    return text.encode("utf-8", "surrogatepass")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(tiny_model(tmp_path_factory), "--max-seq-len", str(MAX_SEQ),
                 "--max-batch-size", "4") as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def valid(server, kind: str) -> dict:
    if kind == "completion":
        return {"model": server.model, "prompt": "Hello", "max_tokens": 2}
    return {"model": server.model, "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 2}


def answered(r: httpx.Response) -> None:
    """A 200, or a 4xx whose body is OpenAI's error object."""
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code == 200:
        return
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:500])
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["type"] == "invalid_request_error" and error["message"], error


def route(kind: str) -> str:
    return "/v1/completions" if kind == "completion" else "/v1/chat/completions"


def post_then_still_serving(http, server, kind: str, content: bytes) -> None:
    answered(http.post(route(kind), content=content,
                       headers={"Content-Type": "application/json"}))
    ok = http.post(route(kind), json=valid(server, kind))
    assert ok.status_code == 200, ok.text


HYPOTHESIS = settings(max_examples=60, deadline=None,
                      suppress_health_check=[HealthCheck.function_scoped_fixture,
                                             HealthCheck.too_slow])


@HYPOTHESIS
@given(kind=st.sampled_from(["completion", "chat"]), body=weird, ascii_only=st.booleans())
def test_any_json_is_answered_with_a_4xx_or_a_200(http, server, kind, body, ascii_only):
    post_then_still_serving(http, server, kind, dumps(body, ascii_only))


@st.composite
def mutated(draw, body: dict):
    """``body`` (a valid request) with one field, or one of its message's, given a value of
    the wrong type, out of range, not a number, or not text."""
    body = dict(body)
    chat = "messages" in body
    field = draw(st.sampled_from(CHAT_FIELDS + ["messages[0]"] if chat else COMPLETION_FIELDS))
    value = draw(weird)
    if field == "messages[0]":
        message = dict(body["messages"][0])
        message[draw(st.sampled_from(["role", "content", "name", "tool_calls",
                                      "tool_call_id", "\udc00"]))] = value
        body["messages"] = [message]
    else:
        body[field] = value
    return body


@HYPOTHESIS
@given(kind=st.sampled_from(["completion", "chat"]), data=st.data(), ascii_only=st.booleans())
def test_a_valid_request_with_one_field_mutated_is_a_4xx_or_a_200(http, server, kind, data,
                                                                   ascii_only):
    body = data.draw(mutated(valid(server, kind)))
    post_then_still_serving(http, server, kind, dumps(body, ascii_only))


def test_the_server_is_healthy_after_it_all(http, server):
    assert http.get("/health").json() == {"status": "ok"}
    assert server.proc.poll() is None
    assert "Traceback" not in server.output(), server.output()[-3000:]
