"""Structured output and tool calling through one real ``infergraft serve`` (a tiny random
model with SmolLM2's tokenizer and chat template, which knows no tools) and the official
openai client: whatever a random model would say, under a constraint its output obeys it
(``parse`` returns the pydantic object, every spelling of a constraint is followed), a
tool-calling loop runs to its answer, streamed tool calls add up to the whole ones, bad
input is a 400 naming the parameter while other requests run on unchanged, and a
constraint that cannot finish in max_tokens ends with "length" and the partial text."""
import asyncio
import json
import re

import jsonschema
import openai
import pydantic
import pytest
from serve_support import serving, tiny_model
from tool_support import SCHEMAS, TOOLS

HI = [{"role": "user", "content": "Tell me about a city."}]
CITY = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                         "size": {"type": "integer", "minimum": 0,
                                                  "maximum": 999}},
        "required": ["name", "size"]}


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    country: str = pydantic.Field(max_length=12)
    population: int = pydantic.Field(ge=0, le=10 ** 7)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(tiny_model(tmp_path_factory), "--max-seq-len", "512",
                 "--max-batch-size", "4") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def chat(client, server, **kw):
    kw = dict({"model": server.model, "messages": HI, "max_tokens": 64, "temperature": 0}, **kw)
    return client.chat.completions.create(**kw)


def test_parse_returns_the_pydantic_object(client, server):
    r = client.chat.completions.parse(model=server.model, messages=HI, response_format=City,
                                      max_tokens=80, temperature=0.7, seed=3, n=2)
    for choice in r.choices:
        assert isinstance(choice.message.parsed, City) and choice.finish_reason == "stop"
        assert City.model_validate_json(choice.message.content) == choice.message.parsed


def test_every_constraint_spelling_is_obeyed_on_both_routes(client, server):
    checks = [({"response_format": {"type": "json_schema", "json_schema": {
                  "name": "city", "schema": CITY, "strict": True}}},
               lambda t: jsonschema.validate(json.loads(t), CITY) is None),
              ({"extra_body": {"guided_json": CITY}},
               lambda t: jsonschema.validate(json.loads(t), CITY) is None),
              ({"extra_body": {"guided_regex": r"[a-c]{2,5}-\d\d"}},
               lambda t: re.fullmatch(r"[a-c]{2,5}-\d\d", t)),
              ({"extra_body": {"guided_choice": ["yes", "no", "maybe"]}},
               lambda t: t in ("yes", "no", "maybe")),
              ({"extra_body": {"guided_grammar": 'root ::= ("ab" | "c")+ "."'}},
               lambda t: re.fullmatch(r"(ab|c)+\.", t)),
              ({"extra_body": {"structured_outputs": {"regex": "[xyz]{3}"}}},
               lambda t: re.fullmatch("[xyz]{3}", t))]
    for kw, valid in checks:
        text = chat(client, server, temperature=1, seed=5, **kw).choices[0].message.content
        assert valid(text), (kw, text)
        body = kw.get("extra_body") or kw  # (the client's completions take no response_format)
        done = client.completions.create(model=server.model, prompt="Data:", max_tokens=64,
                                         temperature=1, seed=6, extra_body=body).choices[0]
        assert valid(done.text) and done.finish_reason == "stop", (kw, done.text)
    # any object: a random model's keys run on (unbounded strings), so it may be cut short
    for seed in range(3):
        r = chat(client, server, temperature=1, seed=seed, max_tokens=24,
                 response_format={"type": "json_object"}).choices[0]
        assert r.message.content.startswith("{")
        assert r.finish_reason == "length" or isinstance(json.loads(r.message.content), dict)


def test_a_streamed_constrained_answer_is_the_whole_one(client, server):
    kw = {"response_format": {"type": "json_schema", "json_schema": {"name": "c",
                                                                     "schema": CITY}}}
    whole = chat(client, server, **kw).choices[0].message.content
    chunks = chat(client, server, stream=True, **kw)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole


def calls_of(message):
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


@pytest.mark.parametrize("tool_choice,parallel", [
    ("required", True), ("required", False),
    ({"type": "function", "function": {"name": "add"}}, True)])
def test_a_tool_calling_loop_runs_to_its_answer(client, server, tool_choice, parallel):
    messages = [{"role": "user", "content": "What is 2 + 3, and the weather in Rome?"}]
    r = chat(client, server, messages=messages, tools=TOOLS, tool_choice=tool_choice,
             parallel_tool_calls=parallel, temperature=0.8, seed=1, max_tokens=120)
    choice = r.choices[0]
    # as OpenAI's: a named function's call ends "stop", required's "tool_calls"
    assert choice.finish_reason == ("stop" if isinstance(tool_choice, dict) else "tool_calls")
    assert choice.message.content is None
    calls = calls_of(choice.message)
    assert len(calls) >= 1 and (parallel or len(calls) == 1)
    for name, arguments in calls:
        jsonschema.validate(arguments, SCHEMAS[name])
    if isinstance(tool_choice, dict):
        assert [name for name, _ in calls] == ["add"]
    assert all(c.id.startswith("call_") and c.type == "function"
               for c in choice.message.tool_calls)
    messages.append(choice.message.model_dump(exclude_none=True))
    messages += [{"role": "tool", "tool_call_id": c.id, "content": '{"result": 5}'}
                 for c in choice.message.tool_calls]
    answer = chat(client, server, messages=messages, tools=TOOLS, max_tokens=8).choices[0]
    assert isinstance(answer.message.content, str) and answer.finish_reason == "length"
    assert not answer.message.tool_calls


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function",
                                                      "function": {"name": "get_weather"}}])
def test_streamed_tool_call_deltas_add_up_to_the_whole_call(client, server, tool_choice):
    # (greedy, a random model calls on until max_tokens: seeded, it stops)
    kw = dict(tools=TOOLS, tool_choice=tool_choice, max_tokens=120, temperature=0.8, seed=1)
    whole = chat(client, server, **kw).choices[0]
    calls, finish, first = {}, None, []
    for chunk in chat(client, server, stream=True, **kw):
        delta = chunk.choices[0].delta
        assert not delta.content  # a forced call has no content
        for d in delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "args": ""})
            first.append(d.id is not None)
            call["args"] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == whole.finish_reason == ("stop" if isinstance(tool_choice, dict)
                                             else "tool_calls")
    assert [(c["name"], json.loads(c["args"])) for c in calls.values()] == \
        calls_of(whole.message)
    assert sum(first) == len(calls) and len(first) > len(calls)  # arguments in pieces
    # the client's own helper reassembles them the same way
    with client.chat.completions.stream(model=server.model, messages=HI, **kw) as stream:
        final = stream.get_final_completion().choices[0].message
    assert calls_of(final) == calls_of(whole.message)


def test_auto_parses_and_streams_what_the_model_says(client, server):
    whole = chat(client, server, tools=TOOLS, max_tokens=24).choices[0]
    assert whole.finish_reason == "length" and isinstance(whole.message.content, str)
    chunks = chat(client, server, tools=TOOLS, max_tokens=24, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.message.content
    plain = chat(client, server, max_tokens=24).choices[0].message.content
    assert plain != whole.message.content  # the tools were shown to the model


def test_a_constraint_cut_short_ends_with_length_and_the_partial_text(client, server):
    r = chat(client, server, max_tokens=3,
             response_format={"type": "json_schema", "json_schema": {"name": "c",
                                                                     "schema": CITY}})
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content.startswith('{"') and r.usage.completion_tokens == 3
    with pytest.raises(openai.LengthFinishReasonError):
        client.chat.completions.parse(model=server.model, messages=HI, response_format=City,
                                      max_tokens=3)
    cut = chat(client, server, max_tokens=2, tools=TOOLS, tool_choice="required").choices[0]
    assert cut.finish_reason == "length" and not cut.message.tool_calls
    assert cut.message.content.startswith("[{")  # no call named yet: the text itself


BAD = [({"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": {
           "type": "object", "properties": {"a": {"allOf": [{"type": "string"}]}}}}}},
        "response_format.json_schema.schema", "allOf"),
       ({"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": {
           "type": "objekt"}}}}, "response_format.json_schema.schema", "objekt"),
       ({"extra_body": {"guided_regex": "a(b"}}, "guided_regex", "guided_regex"),
       ({"extra_body": {"guided_grammar": "root ::= undefined_rule"}}, "guided_grammar", ""),
       ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "mul"}}},
        "tool_choice", "mul"),
       ({"tools": [{"type": "web_search"}]}, "tools[0].type", "function"),
       ({"tools": [{"type": "function", "function": {"description": "no name"}}]},
        "tools[0].function.name", ""),
       ({"response_format": {"type": "json_object"}, "extra_body": {"guided_choice": ["a"]}},
        "guided_choice", "response_format, guided_choice")]


def test_bad_input_is_a_400_and_other_requests_run_on_unchanged(client, server):
    alone = chat(client, server, max_tokens=40).choices[0].message.content

    async def main():
        aclient = server.async_client()
        running = asyncio.create_task(aclient.chat.completions.create(
            model=server.model, messages=HI, max_tokens=40, temperature=0, stream=True))
        constrained = asyncio.create_task(aclient.chat.completions.create(
            model=server.model, messages=HI, max_tokens=60, temperature=0,
            extra_body={"guided_json": CITY}))
        errors = []
        for kw, param, says in BAD:
            with pytest.raises(openai.BadRequestError) as e:
                await aclient.chat.completions.create(**dict(
                    {"model": server.model, "messages": HI, "max_tokens": 4}, **kw))
            errors.append((e.value.param, param, says in e.value.message, e.value.message))
        text = "".join([c.choices[0].delta.content or "" async for c in await running])
        return text, (await constrained).choices[0].message.content, errors

    text, city, errors = asyncio.run(main())
    for got, param, said, message in errors:
        assert got == param and said, message
    assert text == alone  # beside constrained and refused requests: its own tokens
    jsonschema.validate(json.loads(city), CITY)
    assert server.proc.poll() is None and "Traceback" not in server.output()
