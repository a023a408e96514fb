"""The server's request parsing, response shapes, metrics and fan-out, against fakes of
their neighbours (no HTTP, no model): what each bad parameter is answered with."""
import asyncio
import json

import attrs
import pytest

from infergraft.core.serving import responses as R
from infergraft.core.serving.body import MAX_DEPTH, decode_json, read_body
from infergraft.core.serving.fanout import Fanout
from infergraft.core.serving.protocol import (OpenAIError, param_of, parse_chat,
                                              parse_completion)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}


def error_of(parse, body) -> OpenAIError:
    with pytest.raises(OpenAIError) as e:
        parse(body)
    assert e.value.status == 400 and e.value.type == "invalid_request_error"
    return e.value


def test_completion_defaults_are_openais():
    r = parse_completion(COMPLETION)
    assert (r.kind, r.model, r.prompts, r.n, r.stream, r.logprobs) == \
        ("completion", "m", ["hi"], 1, False, None)
    assert r.sampling["max_new_tokens"] == 16 and r.sampling["temperature"] == 1.0
    assert r.sampling["top_p"] is None and r.sampling["top_k"] is None


def test_every_parameter_reaches_the_sampling_arguments():
    r = parse_completion(dict(COMPLETION, max_tokens=5, temperature=0, top_p=0.5, n=3, seed=7,
                              stop=["a", "b"], logprobs=2, presence_penalty=0.5,
                              frequency_penalty=-1, top_k=4, min_p=0.1,
                              repetition_penalty=1.2, ignore_eos=True, stream=True,
                              stream_options={"include_usage": True}, speculative=False))
    assert r.sampling == {"max_new_tokens": 5, "temperature": 0, "top_p": 0.5, "top_k": 4,
                          "seed": 7, "stop": ("a", "b"), "ignore_eos": True,
                          "presence_penalty": 0.5, "frequency_penalty": -1, "min_p": 0.1,
                          "repetition_penalty": 1.2, "speculative": False}
    assert (r.n, r.logprobs, r.stream, r.include_usage) == (3, 2, True, True)


def test_chat_messages_logprobs_and_max_completion_tokens():
    r = parse_chat(dict(CHAT, messages=[{"role": "developer", "content": "be brief"},
                                        {"role": "user", "content": [
                                            {"type": "text", "text": "a"},
                                            {"type": "text", "text": "b"}]}],
                        logprobs=True, top_logprobs=3, max_completion_tokens=9, max_tokens=4))
    assert r.prompts == [[{"role": "system", "content": "be brief"},
                          {"role": "user", "content": "ab"}]]
    assert (r.logprobs, r.sampling["max_new_tokens"], r.max_tokens_name) == \
        (3, 9, "max_completion_tokens")
    assert parse_chat(CHAT).sampling["max_new_tokens"] is None  # the rest of the context
    assert parse_chat(dict(CHAT, logprobs=True)).logprobs == 0


@pytest.mark.parametrize("param,value", [
    ("max_tokens", 0), ("max_tokens", "5"), ("max_tokens", 1.5), ("max_tokens", True),
    ("temperature", -0.1), ("temperature", 2.5), ("temperature", "hot"),
    ("top_p", 0), ("top_p", 1.5), ("n", 0), ("n", 129), ("n", "2"),
    ("seed", -1), ("seed", 2 ** 63), ("seed", 1.0), ("stop", ""), ("stop", ["a"] * 5),
    ("stop", [1]), ("logprobs", 21), ("logprobs", -1), ("logprobs", True),
    ("presence_penalty", 2.5), ("frequency_penalty", -3), ("frequency_penalty", "x"),
    ("top_k", -2), ("top_k", 2.5), ("min_p", 1.5), ("min_p", -0.1),
    ("repetition_penalty", 0), ("repetition_penalty", -1), ("ignore_eos", "yes"),
    ("stream", 1), ("model", 3), ("prompt", ""), ("prompt", "   "), ("prompt", []),
    ("prompt", [[]]), ("prompt", {"text": "hi"}), ("prompt", [1, "a"]),
    ("best_of", 3), ("echo", True), ("suffix", "x"), ("logit_bias", {"1": 5}),
    ("frobnicate", 1), ("temperature", 10 ** 400), ("repetition_penalty", 10 ** 400),
    ("repetition_penalty", float("nan")), ("top_p", -10 ** 400)])
def test_a_bad_completion_parameter_is_named(param, value):
    e = error_of(parse_completion, dict(COMPLETION, **{param: value}))
    assert e.param == param and (param in e.message or param == "frobnicate")
    assert json.loads(json.dumps(e.body()))["error"]["param"] == param


def test_numbers_reach_the_engine_as_floats():
    # an int past int64 would reach the sampler's tensors and fail there (not a 400)
    r = parse_completion(dict(COMPLETION, repetition_penalty=10 ** 29, temperature=1))
    assert r.sampling["repetition_penalty"] == 1e29 and r.sampling["temperature"] == 1.0
    assert all(type(r.sampling[k]) is float for k in ("repetition_penalty", "temperature"))


def test_messages_of_no_role_or_no_text_are_named_to_the_field():
    for messages, param in [([], "messages"), ("hi", "messages"), ([3], "messages[0]"),
                            ([{"role": "robot", "content": "x"}], "messages[0].role"),
                            ([{"role": "user", "content": 5}], "messages[0].content"),
                            ([{"role": "user", "content": [{"type": "image_url"}]}],
                             "messages[0].content"),
                            ([{"role": "user", "content": "x", "tool_calls": []}],
                             "messages[0].tool_calls"),
                            ([{"role": "user", "content": "  "}], "messages")]:
        assert error_of(parse_chat, dict(CHAT, messages=messages)).param == param


def test_chat_only_rules():
    assert error_of(parse_chat, dict(CHAT, top_logprobs=2)).param == "top_logprobs"
    assert error_of(parse_chat, dict(CHAT, logprobs=2)).param == "logprobs"  # a bool here
    assert error_of(parse_chat, dict(CHAT, logprobs=True, top_logprobs=21)).param == \
        "top_logprobs"
    assert error_of(parse_chat, dict(CHAT, stream_options={"include_usage": True})).param == \
        "stream_options"
    assert error_of(parse_chat, dict(CHAT, tools=[{"type": "function"}])).param == \
        "tools[0].function"
    assert error_of(parse_chat, dict(CHAT, seed=2 ** 63 - 1, n=2)).param == "seed"
    assert error_of(parse_chat, ["not", "an", "object"]).param is None
    assert parse_chat(dict(CHAT, user="u", tools=[], response_format={"type": "text"}))


@pytest.mark.parametrize("raw,param", [
    (b'{"prompt": "a \\ud800 b"}', "prompt"), (b'{"model": "\\udfff"}', "model"),
    (b'{"prompt": ["ok", "\\ud83d"]}', "prompt[1]"),
    (b'{"messages": [{"role": "user", "content": "\\udc00"}]}', "messages[0].content"),
    (b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
     "messages[0].content[0].text"),
    (b'{"\\ud800": 1}', None), (b'{"stop": {"\\ud800": 1}}', "stop"),
    ('{"prompt": "raw \ud800 bytes"}'.encode("utf-8", "surrogatepass"), "prompt")])
def test_a_lone_surrogate_is_refused_naming_where(raw, param):
    e = error_of(decode_json, raw)
    assert e.param == param and "lone UTF-16 surrogate ('\\ud" in e.message
    json.dumps(e.body(), ensure_ascii=False).encode()  # the reply holds none: it can be sent


def test_a_surrogate_pair_is_one_character_and_passes():
    assert decode_json(b'{"prompt": "\\ud83d\\ude00"}') == {"prompt": "\U0001F600"}


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 5000, 100_000])
def test_bodies_nested_too_deep_are_refused(depth):
    e = error_of(decode_json, b"[" * depth + b"]" * depth)
    assert f"deeper than {MAX_DEPTH} levels" in e.message
    assert decode_json(b"[" * MAX_DEPTH + b"]" * MAX_DEPTH)  # the limit itself passes
    e = error_of(decode_json, b"[" * 100_000)  # not even closed
    assert "deeper" in e.message or "not valid JSON" in e.message


def test_invalid_json_says_so():
    for raw in (b"{not json", b"\xff\xfe{", b'{"n": ' + b"1" * 5000 + b"}"):
        assert "not valid JSON" in error_of(decode_json, raw).message


class FakeRequest:
    """Starlette's Request as read_body reads it; ``read``: the chunks taken so far."""

    def __init__(self, chunks, headers=None):
        self.chunks, self.headers, self.read = chunks, headers or {}, 0

    async def stream(self):
        for chunk in self.chunks:
            self.read += 1
            yield chunk


def test_a_body_past_the_limit_is_413_before_the_rest_is_read():
    def read(request, limit=10):
        return asyncio.run(read_body(request, limit))

    assert read(FakeRequest([b"12345", b"67890"], {"content-length": "10"})) == b"1234567890"
    declared = FakeRequest([b"x" * 11], {"content-length": "11"})
    with pytest.raises(OpenAIError) as e:
        read(declared)
    assert (e.value.status, e.value.code, declared.read) == (413, "request_too_large", 0)
    assert "10 bytes at most" in e.value.message and "--max-request-bytes" in e.value.message
    chunked = FakeRequest([b"x" * 6] * 100)  # no length declared: counted as it comes
    with pytest.raises(OpenAIError) as e:
        read(chunked)
    assert e.value.status == 413 and chunked.read == 2


def test_engine_errors_map_to_the_parameter_sent():
    assert param_of("max_new_tokens must be an integer >= 1, got 0", "completion") == \
        "max_tokens"
    assert param_of("prompt is empty: give at least one token", "chat") == "messages"
    assert param_of("token ids [99999] are outside the vocabulary", "completion") == "prompt"
    assert param_of("logprobs must be None or ...", "chat") == "top_logprobs"
    assert param_of("something else", "chat") is None


@attrs.frozen
class Out:  # the fields of AsyncEngine's RequestOutput the builders read
    text: str
    token_ids: list
    finished: bool = False
    finish_reason: str = None
    logprobs: list = None
    completion_tokens: int = 0
    metrics: object = None
    error: str = None
    num_cached_tokens: int = 0


@attrs.frozen
class Lp:
    token_id: int
    logprob: float
    top: tuple = ()


def test_logprob_layouts_and_offsets():
    entries = [Lp(1, -0.5, ((1, -0.5), (2, -1.0))), Lp(2, float("-inf"), ())]
    text = {1: "He", 2: "llo"}.get
    c = R.completion_logprobs(entries, text, offset=3)
    assert c == {"tokens": ["He", "llo"], "token_logprobs": [-0.5, R.LOGPROB_FLOOR],
                 "top_logprobs": [{"He": -0.5, "llo": -1.0}, {}], "text_offset": [3, 5]}
    chat = R.chat_logprobs(entries, text)["content"]
    assert chat[0] == {"token": "He", "logprob": -0.5, "bytes": [72, 101], "top_logprobs": [
        {"token": "He", "logprob": -0.5, "bytes": [72, 101]},
        {"token": "llo", "logprob": -1.0, "bytes": [108, 108, 111]}]}


def events_of(text: str) -> list:
    assert text.endswith("\n\n") and all(b.startswith("data: ") for b in text.split("\n\n")[:-1])
    return [json.loads(b[6:]) for b in text.split("\n\n")[:-1]]


def test_chat_chunks_open_with_the_role_and_close_with_the_reason():
    w = R.ChunkWriter("chat", "id", "m", 2, True, str)
    first = events_of(w.output(1, Out("Hi", [5])))
    assert [e["choices"][0]["delta"] for e in first] == [{"role": "assistant", "content": ""},
                                                         {"content": "Hi"}]
    assert all(e["object"] == "chat.completion.chunk" and e["usage"] is None for e in first)
    last = events_of(w.output(1, Out("", [], True, "length", completion_tokens=1)))
    assert last[-1]["choices"][0] == {"index": 1, "delta": {}, "logprobs": None,
                                      "finish_reason": "length"}
    tail = events_of(w.usage(R.usage(3, 1)))[0]
    assert tail["choices"] == [] and tail["usage"]["total_tokens"] == 4


def test_completion_chunks_carry_offsets_across_chunks():
    w = R.ChunkWriter("completion", "id", "m", 1, False, {1: "ab", 2: "c"}.get)
    a = events_of(w.output(0, Out("ab", [1], logprobs=[Lp(1, -0.1)])))[0]["choices"][0]
    b = events_of(w.output(0, Out("c", [2], True, "stop", [Lp(2, -0.2)])))[0]["choices"][0]
    assert (a["logprobs"]["text_offset"], b["logprobs"]["text_offset"]) == ([0], [2])
    assert b["finish_reason"] == "stop" and w.usage(R.usage(1, 2)) == ""


class FakeEngine:
    """AsyncEngine.generate's shape: outputs per request, a refusal for some prompts."""

    def __init__(self, refuse=()):
        self.refuse, self.cancelled = set(refuse), []

    async def generate(self, ids, params, request_id):
        if request_id in self.refuse:
            raise ValueError(f"refused {request_id}")
        try:
            for k in range(3):
                await asyncio.sleep(0.001 * len(ids))
                yield Out(f"{request_id}:{k} ", [k], k == 2, "length" if k == 2 else None)
        except asyncio.CancelledError:
            self.cancelled.append(request_id)
            raise


def test_usage_counts_each_prompt_once_with_its_first_choices_cached_tokens():
    # 2 prompts x 2 choices; each second choice found blocks its sibling had just computed
    choices = [R.Choice(i) for i in range(4)]
    for c, hit in zip(choices, (16, 48, 0, 32)):
        c.add(Out("x", [1], True, "length", completion_tokens=3, num_cached_tokens=hit))
    assert R.request_usage(100, choices, 2) == {
        "prompt_tokens": 100, "completion_tokens": 12, "total_tokens": 112,
        "prompt_tokens_details": {"cached_tokens": 16}}
    assert R.usage(3, 1)["prompt_tokens_details"] == {"cached_tokens": 0}


def test_fanout_interleaves_choices_and_cancels_on_a_refusal():
    async def main():
        fake = FakeEngine()
        fan = Fanout(fake, [([1], None, "a"), ([1, 2, 3], None, "b")])
        await fan.start()
        got = [(i, o.text) async for i, o in fan.outputs()]
        assert sorted(got) == [(0, "a:0 "), (0, "a:1 "), (0, "a:2 "),
                               (1, "b:0 "), (1, "b:1 "), (1, "b:2 ")]
        fake = FakeEngine(refuse={"b"})
        fan = Fanout(fake, [([1] * 50, None, "a"), ([1], None, "b")])
        with pytest.raises(ValueError, match="refused b"):
            await fan.start()
        await asyncio.sleep(0.01)
        assert fake.cancelled == ["a"]  # the accepted choice does not run on alone

    asyncio.run(main())


def test_metrics_read_the_engine_stats_and_count_outcomes():
    from infergraft.core.metrics import RequestMetrics
    from infergraft.core.serving.metrics import ServerMetrics

    class Stats:
        def stats(self):
            return {"requests_running": 2, "requests_waiting": 1, "kv_cache_usage_ratio": 0.25,
                    "prompt_tokens_total": 30, "generation_tokens_total": 12,
                    "num_preemptions": 3, "num_swapped_out": 2, "num_recomputed": 1,
                    "prefix_cache_queries": 40, "prefix_cache_hits": 16,
                    "kv_blocks_total": 64, "kv_blocks_free": 60}

    m = ServerMetrics(Stats())
    rm = RequestMetrics(arrival=1.0, first_token=1.5, token_times=[1.5, 2.0, 2.5], finished=2.5)
    m.finished("stop", rm)
    m.finished(None)
    text = m.render()[0].decode()
    for line in ("infergraft_requests_running 2.0", "infergraft_requests_waiting 1.0",
                 "infergraft_kv_cache_usage_ratio 0.25", "infergraft_prompt_tokens_total 30.0",
                 "infergraft_generation_tokens_total 12.0",
                 "infergraft_prefix_cache_queries_total 40.0",
                 "infergraft_prefix_cache_hits_total 16.0", "infergraft_num_preemptions_total 3.0",
                 "infergraft_num_swapped_out_total 2.0", "infergraft_num_recomputed_total 1.0",
                 "infergraft_kv_blocks 64.0", "infergraft_kv_blocks_free 60.0",
                 'infergraft_request_success_total{finish_reason="stop"} 1.0',
                 'infergraft_request_success_total{finish_reason="abort"} 1.0',
                 "infergraft_time_to_first_token_seconds_sum 0.5",
                 "infergraft_time_per_output_token_seconds_sum 0.5",
                 "infergraft_e2e_request_latency_seconds_sum 1.5"):
        assert line in text.splitlines(), line
    assert ServerMetrics(Stats()).render()[0].count(b"request_success_total{") == 4
