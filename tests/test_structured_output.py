"""Structured output through the engine on tiny random models: every output under a JSON
schema, a regex, a grammar or a choice is accepted by it (hypothesis over random schemas
and regexes, several constraints in one batch), unconstrained requests beside them get
their own tokens, a constraint that cannot finish in time ends with "length", and the
compiled vocabulary and grammars are cached."""
import json
import threading

import pytest
from hypothesis import HealthCheck, assume, given
from hypothesis import strategies as st

from infergraft import core
from infergraft.core.testing.strategies import kit_settings
from structured_support import (check_json, check_regex, max_chars, object_schemas, regexes,
                                schemas, tiny_engine)

SETTINGS = kit_settings(max_examples=12, deadline=None,
                        suppress_health_check=[HealthCheck.function_scoped_fixture,
                                               HealthCheck.too_slow])
PROMPTS = ["The answer:", "{", "hello world", "x"]


@pytest.fixture(scope="module")
def engine():
    return tiny_engine()


MAX_NEW = 200  # tokens: a schema drawn is kept when its longest output fits


def _params(temperature, seed, **constraint):
    return core.SamplingParams(max_new_tokens=MAX_NEW, temperature=temperature, seed=seed,
                               **constraint)


@SETTINGS
@given(st.lists(schemas(), min_size=1, max_size=4), st.sampled_from([0.0, 1.0]),
       st.integers(0, 2 ** 16))
def test_every_output_validates_against_its_schema(engine, batch, temperature, seed):
    assume(all(max_chars(s) <= MAX_NEW for s in batch))  # so every output completes
    # one batch, each row its own schema: the per-row masks must not mix
    seqs = [engine.add_request(PROMPTS[i % 4], _params(temperature, seed + i, json_schema=s))
            for i, s in enumerate(batch)]
    while engine.has_unfinished():
        engine.step()
    for seq, schema in zip(seqs, batch):
        assert seq.finish_reason == "stop", (schema, seq.text)
        check_json(seq.text, schema)


@kit_settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(object_schemas(), st.booleans())
def test_object_schemas_with_and_without_jump_forward(engine, schema, jump):
    assume(max_chars(schema) <= MAX_NEW)
    done = engine.generate(PROMPTS[:2], max_new_tokens=MAX_NEW, json_schema=schema,
                           jump_forward=jump, temperature=1.0, seed=7)
    for d in done:
        assert d.finish_reason == "stop"
        check_json(d.text, schema)


@SETTINGS
@given(st.lists(regexes(), min_size=1, max_size=4), st.sampled_from([0.0, 1.0]),
       st.integers(0, 2 ** 16))
def test_every_output_matches_its_regex(engine, batch, temperature, seed):
    seqs = [engine.add_request(PROMPTS[i % 4], _params(temperature, seed + i, regex=r))
            for i, r in enumerate(batch)]
    while engine.has_unfinished():
        engine.step()
    for seq, pattern in zip(seqs, batch):
        assert seq.finish_reason == "stop", (pattern, seq.text)
        check_regex(seq.text, pattern, finished=True)


def test_unconstrained_requests_beside_constrained_ones_get_their_own_tokens(engine):
    free = [engine.generate(p, max_new_tokens=24)[0].token_ids for p in PROMPTS[:2]]
    sampled = engine.generate(PROMPTS[2], max_new_tokens=24, temperature=1.0, seed=3)
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0,
                                                     "maximum": 9999}}, "required": ["a"]}
    seqs = [engine.add_request(PROMPTS[0], core.SamplingParams(max_new_tokens=24)),
            engine.add_request(PROMPTS[3], core.SamplingParams(max_new_tokens=24,
                                                               json_schema=schema)),
            engine.add_request(PROMPTS[1], core.SamplingParams(max_new_tokens=24)),
            engine.add_request(PROMPTS[3], core.SamplingParams(max_new_tokens=24,
                                                               regex=r"[a-c]{3}\d{5}")),
            engine.add_request(PROMPTS[2], core.SamplingParams(max_new_tokens=24,
                                                               temperature=1.0, seed=3))]
    while engine.has_unfinished():
        engine.step()
    assert [seqs[0].output_ids, seqs[2].output_ids] == free
    assert seqs[4].output_ids == sampled[0].token_ids
    check_json(seqs[1].text, schema)
    check_regex(seqs[3].text, r"[a-c]{3}\d{5}", finished=True)


def test_json_object_grammars_and_choices(engine):
    obj = engine.generate(PROMPTS, max_new_tokens=120, json_object=True, temperature=1.0,
                          seed=2)
    for d in obj:  # any object, compact; a cut one still begins one
        assert d.text.startswith("{")
        if d.finish_reason == "stop":
            assert isinstance(json.loads(d.text), dict)
    ebnf = 'root ::= num (("+" | "*") num){0,3}\nnum ::= [1-9] [0-9]{0,2}'
    lark = 'start: NUM (OP NUM)~0..3\nNUM: /[1-9][0-9]{0,2}/\nOP: "+" | "*"'
    for grammar in (ebnf, lark):
        for d in engine.generate(PROMPTS, max_new_tokens=40, grammar=grammar, temperature=1.0,
                                 seed=5):
            assert d.finish_reason == "stop"
            check_regex(d.text, r"[1-9][0-9]{0,2}([+*][1-9][0-9]{0,2}){0,3}", finished=True)
    options = ["yes", "no", 'say "hi"\n', "a\\b"]
    picked = engine.generate(PROMPTS * 2, max_new_tokens=20, choice=options, temperature=1.0,
                             seed=1)
    assert all(d.text in options and d.finish_reason == "stop" for d in picked)


def test_samples_of_n_and_streams_are_constrained_too(engine):
    schema = {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 4}
    done = engine.generate(PROMPTS[0], n=3, max_new_tokens=60, json_schema=schema,
                           temperature=1.0, seed=9)
    assert len(done) == 3
    for d in done:
        check_json(d.text, schema)
    text = "".join(engine.stream(PROMPTS[1], max_new_tokens=60, regex=r"(ab|cd){2,4}!"))
    check_regex(text, r"(ab|cd){2,4}!", finished=True)


def test_a_constraint_that_cannot_finish_in_time_ends_with_length(engine):
    long = "x" * 40
    done = engine.generate(PROMPTS[:2], max_new_tokens=10, regex=f"{long}|{long}y")[0]
    assert done.finish_reason == "length" and done.text == "x" * 10
    cut = engine.generate(PROMPTS[0], max_new_tokens=12, jump_forward=False,
                          json_schema={"type": "object", "properties": {
                              "name": {"type": "string", "minLength": 20, "maxLength": 30}},
                              "required": ["name"]})[0]
    assert cut.finish_reason == "length" and len(cut.token_ids) == 12
    assert cut.text.startswith('{"name": "') and len(cut.text) == 12  # as far as it got


def test_jump_forward_appends_forced_text_without_a_step_per_token(engine):
    schema = {"type": "object", "properties": {"first_field_name": {"type": "boolean"},
                                               "second_field_name": {"type": "boolean"}},
              "required": ["first_field_name", "second_field_name"]}
    steps = {}
    for jump in (False, True):
        seq = engine.add_request(PROMPTS[0], core.SamplingParams(
            max_new_tokens=80, json_schema=schema, jump_forward=jump))
        steps[jump] = 0
        while not seq.finished:
            engine.step()
            steps[jump] += 1
        check_json(seq.text, schema)
        assert seq.text == '{"first_field_name": ' + seq.text[21:]
    # '{"first_field_name": ' and ', "second_field_name": ' forced: 40 tokens, one step
    # each without jump-forward; with it, the booleans' tokens and two feeds of the rest
    assert steps[True] < steps[False] - 30, steps


def test_the_vocabulary_and_each_grammar_compile_once(engine):
    processor = engine.constraints.processors.get("grammar")
    schema = {"type": "object", "properties": {"once": {"type": "boolean"}}, "required": ["once"]}
    engine.generate(PROMPTS[0], max_new_tokens=20, json_schema=schema)
    compiler = processor.compiler(engine.constraints.vocab)  # this tokenizer's
    vocabulary, compilers = compiler._compiler, len(processor._compilers)
    before = len(compiler.compile_seconds)
    engine.generate(PROMPTS, max_new_tokens=20, json_schema=json.dumps(schema))
    engine.generate(PROMPTS[1], max_new_tokens=20, json_schema=schema, temperature=1.0, seed=1)
    assert len(compiler.compile_seconds) == before
    engine.generate(PROMPTS[0], max_new_tokens=20, regex="once|twice")
    assert len(compiler.compile_seconds) == before + 1
    assert processor.compiler(engine.constraints.vocab) is compiler
    assert compiler._compiler is vocabulary and len(processor._compilers) == compilers


@pytest.mark.parametrize("device", ["cpu", "cuda"])  # compiled at once / in the background
@pytest.mark.parametrize("limit", ["count", "bytes"])
def test_compiled_grammars_are_dropped_least_recently_asked_first(monkeypatch, limit, device):
    from infergraft.core.logits_processor import Vocabulary
    from infergraft.core.structured import grammar
    from structured_support import EOS, VOCAB, ascii_tokenizer

    if limit == "count":
        monkeypatch.setattr(grammar, "CACHED", 2)
    compiler = grammar.Compiler(Vocabulary(VOCAB, frozenset({EOS}), ascii_tokenizer(), device))
    a, b, c = (core.SamplingParams(regex=r).constraint for r in ("a+", "b+", "c+"))
    threads, compile_one = [], compiler._compile
    compiler._compile = lambda *args, **kw: threads.append(
        threading.current_thread().name) or compile_one(*args, **kw)
    first = compiler.compile(a)
    compiler.compile(b).result()
    # on the CPU in the caller's thread, beside a GPU in the background
    assert all(t.startswith("infergraft-grammar") == (device == "cuda") for t in threads)
    assert compiler.compile(a) is first and first.result()  # a asked again: the newest
    if limit == "bytes":  # what a and b hold: a third one goes past it
        monkeypatch.setattr(grammar, "CACHED_BYTES", sum(compiler._bytes.values()))
    compiler.compile(c).result()  # b, the least recently asked, is dropped
    assert compiler.compile(a) is first and len(compiler.compile_seconds) == 3
    compiler.compile(b).result()  # compiled again
    assert len(compiler.compile_seconds) == 4
