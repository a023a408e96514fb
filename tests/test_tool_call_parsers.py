"""The tool-call parsers of each template family (Hermes/Qwen ``<tool_call>``, LLaMA 3's
bare JSON, Mistral's ``[TOOL_CALLS]``) and the forced calls' reader, on text as models
write it: text before and after a call, several calls, malformed JSON and unknown
functions (content, never an error), and the same message whether the text comes whole
or in any pieces."""
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infergraft.core.serving.tool_calls import FAMILIES
from infergraft.core.serving.tool_calls.scanning import JsonScanner, Malformed
from infergraft.core.serving.tool_calls.shaping import AutoShaper, ForcedShaper

NAMES = ("get_weather", "add")
WEATHER = {"city": "Paris", "note": "a \"quoted\" } brace"}
ADD = {"a": 1, "b": [2, {"c": None}]}


def shaped(shaper, pieces):
    """The message of ``pieces`` fed one by one, and the deltas streamed meanwhile."""
    deltas = []
    for piece in pieces:
        deltas += shaper.feed(piece)
    deltas += shaper.finish()
    return shaper.message(), deltas


def auto(family, text, **kw):
    return shaped(AutoShaper(FAMILIES[family], NAMES, **kw), [text])[0]


def calls_of(message):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message.get("tool_calls", [])]


def reassembled(deltas):
    """A stream's deltas added up as the openai client does: (content, calls by index)."""
    content, calls = "", {}
    for d in deltas:
        content += d.get("content", "")
        for c in d.get("tool_calls", []):
            call = calls.setdefault(c["index"], {"id": None, "name": None, "arguments": ""})
            call["id"] = c.get("id", call["id"])
            call["name"] = c.get("function", {}).get("name", call["name"])
            call["arguments"] += c.get("function", {}).get("arguments", "")
    return content, [calls[i] for i in sorted(calls)]


def hermes_call(name, arguments):
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def test_hermes_text_around_and_several_calls():
    text = (f"Let me look.\n{hermes_call('get_weather', WEATHER)}\n"
            f"{hermes_call('add', ADD)}\nDone.")
    m = auto("hermes", text)
    assert calls_of(m) == [("get_weather", WEATHER), ("add", ADD)]
    assert m["content"] == "Let me look.\nDone."
    assert all(c["id"].startswith("call_") and len(c["id"]) == 29 and c["type"] == "function"
               for c in m["tool_calls"])
    assert len({c["id"] for c in m["tool_calls"]}) == 2
    only = auto("hermes", hermes_call("add", ADD))
    assert only["content"] is None and calls_of(only) == [("add", ADD)]
    unclosed = auto("hermes", '<tool_call>\n{"name": "add", "arguments": {}}\n')
    assert calls_of(unclosed) == [("add", {})]  # the model stopped before closing it


@pytest.mark.parametrize("block", [
    '<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call>',  # malformed
    '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',  # not a tool given
    '<tool_call>\n{"name": "add", "arguments": "1, 2"}\n</tool_call>',  # not an object
    '<tool_call>\n{"name": "add", "arguments": {}, "extra": 1}\n</tool_call>',
    '<tool_call>\n{"name": "add", "argu'])  # cut short
def test_hermes_blocks_that_are_no_call_stay_content(block):
    m = auto("hermes", f"Hi {block}")
    assert m == {"role": "assistant", "content": f"Hi {block}"}


def test_plain_text_is_the_content_unchanged():
    for family in FAMILIES:
        for text in ("", "Paris.", "  two spaces\n\n", "a; b; {not json", "x <tool_call"):
            assert auto(family, text) == {"role": "assistant", "content": text}


def test_llama3_bare_json_python_tag_and_semicolons():
    one = json.dumps({"name": "add", "parameters": ADD})
    two = json.dumps({"name": "get_weather", "arguments": WEATHER})
    assert calls_of(auto("llama3_json", f"{one}; {two}")) == \
        [("add", ADD), ("get_weather", WEATHER)]
    assert calls_of(auto("llama3_json", f"<|python_tag|>{one}")) == [("add", ADD)]
    m = auto("llama3_json", f"Calling it: {one} then done")
    assert m["content"] == "Calling it: then done" and calls_of(m) == [("add", ADD)]
    # JSON that is an answer, not a call, stays content
    answer = '{"name": "Paris", "country": "France"} and {"name": "add"}'
    assert auto("llama3_json", answer) == {"role": "assistant", "content": answer}


def test_mistral_lists_single_objects_and_v11_calls():
    listed = json.dumps([{"name": "add", "arguments": ADD},
                         {"name": "get_weather", "arguments": WEATHER}])
    m = auto("mistral", f"Sure. [TOOL_CALLS] {listed}")
    assert m["content"] == "Sure." and calls_of(m) == [("add", ADD), ("get_weather", WEATHER)]
    assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in m["tool_calls"])
    v11 = f"[TOOL_CALLS]add[ARGS]{json.dumps(ADD)}[TOOL_CALLS]get_weather[ARGS]{{}}"
    assert calls_of(auto("mistral", v11)) == [("add", ADD), ("get_weather", {})]
    bad = '[TOOL_CALLS] [{"name": "add", "arguments": {}}, {"name": "nope", "arguments": {}}]'
    assert auto("mistral", bad) == {"role": "assistant", "content": bad}  # all or none


def test_a_special_marker_dropped_by_decoding_is_put_back_from_the_token_ids():
    # Mistral's tokenizers hold [TOOL_CALLS] as special token 5: the engine's text lacks it
    words = {1: "Sure.", 2: " ", 5: ""}
    decode = lambda ids: "".join(words.get(i, "?") for i in ids)  # noqa: E731
    shaper = AutoShaper(FAMILIES["mistral"], NAMES, marker_id=5, decode=decode)
    call = '[{"name": "add", "arguments": {"a": 1}}]'
    deltas = shaper.feed("Sure. ", [1, 2]) + shaper.feed(call[:9], [5, 7]) + \
        shaper.feed(call[9:], [8]) + shaper.finish()
    assert calls_of(shaper.message()) == [("add", {"a": 1})]
    assert reassembled(deltas)[0] == "Sure." == shaper.message()["content"]


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = hermes_call("add", ADD) + hermes_call("get_weather", WEATHER)
    m = auto("hermes", text, max_calls=1)
    assert calls_of(m) == [("add", ADD)] and m["content"] == hermes_call("get_weather", WEATHER)


def texts(family):
    """Model-like text of ``family``: prose, calls, malformed blocks, in any order."""
    def call(name, args):
        if family == "hermes":
            return hermes_call(name, args)
        if family == "mistral":
            return "[TOOL_CALLS]" + json.dumps([{"name": name, "arguments": args}])
        return json.dumps({"name": name, "parameters": args})

    broken = {"hermes": "<tool_call>{oops}</tool_call>", "mistral": "[TOOL_CALLS] [{",
              "llama3_json": '{"name": "add", "parameters": [}'}[family]
    part = st.one_of(st.text("ab ,.\n;{}[]<>_", max_size=12),
                     st.sampled_from([call("add", ADD), call("get_weather", WEATHER), broken]))
    return st.lists(part, max_size=5).map("".join)


@settings(max_examples=150, deadline=None)
@given(family=st.sampled_from(sorted(FAMILIES)), data=st.data())
def test_any_pieces_stream_what_the_whole_text_gives(family, data):
    text = data.draw(texts(family))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    whole, _ = shaped(AutoShaper(FAMILIES[family], NAMES), [text])
    message, deltas = shaped(AutoShaper(FAMILIES[family], NAMES), pieces)
    assert calls_of(message) == calls_of(whole) and message["content"] == whole["content"]
    content, calls = reassembled(deltas)
    assert content == (message["content"] or "")
    assert [(c["id"], c["name"], c["arguments"]) for c in calls] == \
        [(c["id"], c["function"]["name"], c["function"]["arguments"])
         for c in message.get("tool_calls", [])]


def ids():
    n = iter(range(100))
    return lambda: f"call_{next(n)}"


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(0, 120), max_size=10), parallel=st.booleans())
def test_forced_calls_stream_their_arguments_as_they_are_written(cuts, parallel):
    objects = [{"name": "add", "arguments": ADD}, {"name": "get_weather", "arguments": WEATHER}]
    text = json.dumps(objects) if parallel else json.dumps(objects[0])
    cuts = sorted(min(c, len(text)) for c in cuts)
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    message, deltas = shaped(ForcedShaper(ids()), pieces)
    want = [("add", ADD), ("get_weather", WEATHER)][:2 if parallel else 1]
    assert calls_of(message) == want and message["content"] is None
    assert [c["arguments"] for c in reassembled(deltas)[1]] == \
        [json.dumps(a) for _, a in want]  # the raw text, as written
    named, deltas = shaped(ForcedShaper(ids(), "add"), pieces[:1] + [json.dumps(ADD)])
    assert named["tool_calls"][0]["function"] == {"name": "add", "arguments":
                                                  pieces[0] + json.dumps(ADD)}
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "add", "arguments": ""}


def test_forced_calls_cut_short_keep_what_was_begun():
    text = '[{"name": "add", "arguments": {"a": 1}}, {"name": "get_weather", "arguments": {"ci'
    shaper = ForcedShaper(ids())
    message, _ = shaped(shaper, [text])
    assert [c["function"] for c in message["tool_calls"]] == [
        {"name": "add", "arguments": '{"a": 1}'}, {"name": "get_weather", "arguments": '{"ci'}]
    assert shaper.finish_reason("length") == "length" and shaper.finish_reason("stop") == \
        "tool_calls"
    named = ForcedShaper(ids(), "add")  # OpenAI's: a named function's call ends "stop"
    shaped(named, ['{"a": 1, "b": 2}'])
    assert named.calls and named.finish_reason("stop") == "stop"
    early, deltas = shaped(ForcedShaper(ids()), ['{"name": "ad'])  # no name read: content
    assert early == {"role": "assistant", "content": '{"name": "ad'}
    assert deltas == [{"content": '{"name": "ad'}]


def test_the_scanner_finds_the_end_across_pieces_and_refuses_mismatches():
    text = ' {"a": "}]\\"", "b": [1, {"c": "["}]} tail'
    scanner = JsonScanner(0)
    assert [scanner.advance(text[:k]) for k in (5, 20)] == [None, None]
    end = scanner.advance(text)
    assert text[scanner.begin:end] == text.strip()[:-5] and json.loads(text[scanner.begin:end])
    for bad in ("{]", "x", '[1, "a"}'):
        with pytest.raises(Malformed):
            JsonScanner(0).advance(bad)
