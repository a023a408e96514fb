"""Structured output and tools in the server's request parsing, prompts and response
shapes, against fakes of their neighbours (no HTTP, no model): response_format, vLLM's
guided_* and structured_outputs, tools and tool_choice read into the engine's terms, each
bad one a 400 naming the parameter; conversations with tool calls rendered by templates
that know tools and by ones that do not; streamed chunks adding up to the whole body."""
import json
import types

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tool_support import ADD, SCHEMAS, TEMPLATES, TOOLS, WEATHER
from transformers import AutoTokenizer

from infergraft.core.loading.demo import ensure_demo_model
from infergraft.core.request import encode_prompt
from infergraft.core.serving import responses as R
from infergraft.core.serving.prompts import PromptEncoder
from infergraft.core.serving.protocol import OpenAIError, parse_chat, parse_completion
from infergraft.core.serving.tool_calls import FAMILIES, detect

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


def error_of(parse, body) -> OpenAIError:
    with pytest.raises(OpenAIError) as e:
        parse(body)
    assert e.value.status == 400 and e.value.type == "invalid_request_error"
    return e.value


def test_each_constraint_spelling_reaches_its_sampling_field():
    rows = [({"response_format": {"type": "json_object"}}, {"json_object": True}),
            ({"response_format": {"type": "json_schema", "json_schema": {
                "name": "n", "schema": SCHEMA, "strict": True}}}, {"json_schema": SCHEMA}),
            ({"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}},
             {"json_object": True}),  # no schema: any object, as OpenAI
            ({"response_format": {"type": "text"}}, {}),
            ({"guided_json": SCHEMA}, {"json_schema": SCHEMA}),
            ({"guided_regex": "[ab]+"}, {"regex": "[ab]+"}),
            ({"guided_choice": ["yes", "no"]}, {"choice": ["yes", "no"]}),
            ({"guided_grammar": 'root ::= "x"'}, {"grammar": 'root ::= "x"'}),
            ({"structured_outputs": {"json": SCHEMA}}, {"json_schema": SCHEMA}),
            ({"structured_outputs": {"json_object": True}}, {"json_object": True}),
            ({"structured_outputs": {"choice": ["a"], "json_object": False}}, {"choice": ["a"]})]
    fields = ("json_schema", "json_object", "regex", "grammar", "choice")
    for extra, want in rows:
        for parse, body in ((parse_chat, CHAT), (parse_completion, {"prompt": "x"})):
            got = {k: v for k, v in parse(dict(body, **extra)).sampling.items() if k in fields}
            assert got == want, extra


@pytest.mark.parametrize("extra,param,says", [
    ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
    ({"response_format": "json"}, "response_format", "text, json_object"),
    ({"response_format": {"type": "json_object", "schema": {}}}, "response_format.schema", ""),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
     "response_format.json_schema.name", "1 to 64"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b"}}},
     "response_format.json_schema.name", ""),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "x": 1}}},
     "response_format.json_schema.x", "unknown field"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "object", "properties": {"a": {"oneOf": [{"type": "string"}]}}}}}},
     "response_format.json_schema.schema", "oneOf"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": [1]}}},
     "response_format.json_schema.schema", "object"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_json": {"type": "strin"}}, "guided_json", "strin"),
    ({"guided_regex": "(unclosed"}, "guided_regex", "regex"),
    ({"guided_regex": 5}, "guided_regex", "regular expression"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"guided_grammar": "root ::= "}, "guided_grammar", "grammar"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs.jsn", "json, regex"),
    ({"structured_outputs": []}, "structured_outputs", ""),
    ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_regex", "guided_json, guided_regex"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs.regex", "response_format, structured_outputs.regex")])
def test_a_bad_or_second_constraint_is_named(extra, param, says):
    for parse, body in ((parse_chat, CHAT), (parse_completion, {"prompt": "x"})):
        e = error_of(parse, dict(body, **extra))
        assert e.param == param and says in e.message, e.message


def chat_tools(**extra):
    return parse_chat(dict(CHAT, tools=TOOLS, **extra))


def test_tool_choices_and_the_schema_a_forced_call_is_held_to():
    assert chat_tools().tools.choice == "auto" and "json_schema" not in chat_tools().sampling
    assert chat_tools(tool_choice="none").tools.shown() is None
    named = chat_tools(tool_choice={"type": "function", "function": {"name": "add"}})
    assert (named.tools.choice, named.tools.function) == ("function", "add")
    assert named.sampling["json_schema"] == SCHEMAS["add"]
    # required: an array of {name, arguments}; one object without parallel calls
    many = chat_tools(tool_choice="required").sampling["json_schema"]
    one = chat_tools(tool_choice="required", parallel_tool_calls=False).sampling["json_schema"]
    calls = [{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}},
             {"name": "add", "arguments": {"a": -3, "b": 4}}]
    jsonschema.validate(calls, many)  # the $ref inside add's parameters still resolves
    jsonschema.validate(calls[1], one)
    for wrong in ([], [{"name": "add", "arguments": {"a": 1, "b": 10}}],
                  [{"name": "rm", "arguments": {}}], [dict(calls[0], extra=1)]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, many)
    llama = parse_chat(dict(CHAT, tools=TOOLS, tool_choice="required"),
                       arguments_key="parameters")
    assert "parameters" in llama.sampling["json_schema"]["items"]["anyOf"][0]["properties"]
    # a response format with tools: the output cannot be a call, none is shown or parsed
    fmt = chat_tools(response_format={"type": "json_object"})
    assert fmt.tools.choice == "none" and fmt.sampling["json_object"]


def bad_tool(**function):
    return {"type": "function", "function": dict({"name": "f"}, **function)}


@pytest.mark.parametrize("extra,param,says", [
    ({"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools[0].type", "function"),
    ({"tools": [{"type": "function"}]}, "tools[0].function", "name"),
    ({"tools": {"f": 1}}, "tools", "list"),
    ({"tools": [WEATHER, "add"]}, "tools[1]", ""),
    ({"tools": [bad_tool(name="two words")]}, "tools[0].function.name", "letters"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name", "twice"),
    ({"tools": [bad_tool(parameters={"type": "string"})]}, "tools[0].function.parameters",
     "type object"),
    ({"tools": [bad_tool(parameters=[])]}, "tools[0].function.parameters", ""),
    ({"tools": [bad_tool(strict="yes")]}, "tools[0].function.strict", ""),
    ({"tools": [bad_tool(returns={})]}, "tools[0].function.returns", ""),
    ({"tools": [dict(WEATHER, cache=True)]}, "tools[0].cache", "unknown field"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "not among tools (get_weather, add)"),
    ({"tools": TOOLS, "tool_choice": "any"}, "tool_choice", "none, auto, required"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls", ""),
    ({"tools": [bad_tool(parameters={"type": "object", "properties": {
        "x": {"not": {"type": "string"}}}}), ADD], "tool_choice": "required"},
     "tools[0].function.parameters", "'not'"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tool_choice",
     "guided_regex, tool_choice")])
def test_a_bad_tool_or_tool_choice_is_named(extra, param, says):
    e = error_of(parse_chat, dict(CHAT, **extra))
    assert e.param == param and says in e.message, e.message


def test_what_a_forced_call_cannot_follow_matters_only_when_forced():
    odd = bad_tool(parameters={"type": "object", "properties": {"x": {"not": {}}}})
    assert parse_chat(dict(CHAT, tools=[odd])).tools.choice == "auto"  # not enforced: fine
    assert error_of(parse_completion, {"prompt": "x", "tools": TOOLS}).param == "tools"


def conversation(call_id="call_1"):
    return [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": call_id, "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'}}]},
            {"role": "tool", "tool_call_id": call_id, "content": "12 C, rain"}]


def test_tool_calls_and_results_in_the_history():
    messages = parse_chat(dict(CHAT, messages=conversation())).prompts[0]
    assert messages[2] == {"role": "assistant", "content": "", "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}}]}
    assert messages[3] == {"role": "tool", "content": "12 C, rain", "tool_call_id": "call_1"}
    history = conversation()
    for where, change, param in [
            (3, {"tool_call_id": "call_9"}, "messages[3].tool_call_id"),
            (2, {"tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": "{oops"}}]},
             "messages[2].tool_calls[0].function.arguments"),
            (2, {"tool_calls": [{"id": "", "function": {"name": "f", "arguments": "{}"}}]},
             "messages[2].tool_calls[0].id"),
            (1, {"tool_calls": []}, "messages[1].tool_calls"),
            (3, {"tool_call_id": None}, "messages[3].tool_call_id")]:
        messages = [dict(m, **change) if i == where else m for i, m in enumerate(history)]
        assert error_of(parse_chat, dict(CHAT, messages=messages)).param == param


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(ensure_demo_model("smollm2-135m", quiet=True))


def prompt(tokenizer, template, body, family=None):
    tok = types.SimpleNamespace(**{k: getattr(tokenizer, k) for k in ("decode", "encode")})
    tok.chat_template = template
    tok.apply_chat_template = lambda *a, **kw: tokenizer.apply_chat_template(
        *a, chat_template=template, **kw)
    engine = types.SimpleNamespace(tokenizer=tok, plan=types.SimpleNamespace(max_seq_len=4096),
                                   encode=lambda p: encode_prompt(p, tokenizer, len(tokenizer)))
    encoder = PromptEncoder(engine, FAMILIES[family or detect(template)])
    return tokenizer.decode(encoder.encode(parse_chat(body))[0])


@pytest.mark.parametrize("family", sorted(TEMPLATES))
def test_templates_that_know_tools_get_them_and_the_calls_as_objects(tokenizer, family):
    template = TEMPLATES[family]
    assert detect(template) == family
    call_id = FAMILIES[family].new_id()
    text = prompt(tokenizer, template, dict(CHAT, tools=TOOLS, messages=conversation(call_id)))
    assert '"get_weather"' in text and '"maxLength": 12' in text and "12 C, rain" in text
    assert '"arguments": {"city": "Oslo", "days": 1}' in text or \
        '"parameters": {"city": "Oslo", "days": 1}' in text  # an object, not a string
    if family == "mistral":  # its template insists on Mistral's 9-character ids
        with pytest.raises(OpenAIError, match="length 9"):
            prompt(tokenizer, template, dict(CHAT, messages=conversation("call_123456789")))
    none = prompt(tokenizer, template, dict(CHAT, tools=TOOLS, tool_choice="none"))
    assert "get_weather" not in none


def test_a_template_without_tools_gets_them_from_the_family(tokenizer):
    smol = tokenizer.chat_template  # SmolLM2's: no tools, no tool_calls
    assert detect(smol) == "hermes"
    text = prompt(tokenizer, smol, dict(CHAT, tools=TOOLS, messages=conversation()))
    assert text.startswith("<|im_start|>system\nBe brief.\n\nYou can call functions")
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}' \
           '\n</tool_call>' in text and "<|im_start|>tool\n12 C, rain" in text
    llama = prompt(tokenizer, smol, dict(CHAT, tools=[ADD]), family="llama3_json")
    assert '"parameters": {<its arguments>}' in llama and "You are a helpful" not in llama


def test_streamed_tool_call_chunks_add_up_to_the_whole_body():
    text = 'Checking.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    request = chat_tools()
    shape = lambda: request.tools.shaper(FAMILIES["hermes"])  # noqa: E731
    writer = R.ChunkWriter("chat", "id", "m", 1, False, str, shape=shape)
    events, pieces = "", [text[i:i + 7] for i in range(0, len(text), 7)]
    for k, piece in enumerate(pieces):
        last = k == len(pieces) - 1
        out = types.SimpleNamespace(text=piece, token_ids=[k], logprobs=None, finished=last,
                                    finish_reason="stop" if last else None)
        events += writer.output(0, out)
    chunks = [json.loads(e[6:]) for e in events.split("\n\n") if e]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    content = "".join(d.get("content") or "" for d in deltas)
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert content == "Checking." and calls[0]["function"] == {"name": "add", "arguments":
                                                              '{"a": 1, "b": 2}'}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    choice = R.Choice(0, text=text, finish_reason="stop")
    whole = R.body("chat", "id", 0, "m", [choice], R.usage(1, 1), str, shape)["choices"][0]
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] == content
    assert whole["message"]["tool_calls"][0]["function"] == calls[0]["function"]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.sampled_from(
        ["", "function", "auto", "required", "none", "add", "object", "text", "json_object",
         "json_schema", "{}", "[a-z]", "x"]),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.sampled_from(
        ["type", "function", "name", "parameters", "arguments", "id", "json_schema",
         "schema", "properties", "json", "regex", "choice", "tool_calls", "role",
         "content", "tool_call_id"]), kids, max_size=3), max_leaves=10)


@settings(max_examples=400, deadline=None)
@given(field=st.sampled_from(["tools", "tool_choice", "response_format", "guided_json",
                              "structured_outputs", "messages", "parallel_tool_calls"]),
       value=json_values, with_tools=st.booleans())
def test_any_value_of_the_new_fields_is_taken_or_a_400(field, value, with_tools):
    body = dict(CHAT, **({"tools": TOOLS} if with_tools else {}))
    body[field] = value
    try:
        parse_chat(body)
    except OpenAIError as e:
        assert e.status == 400 and e.param and e.message
