"""SamplingParams' structured-output fields checked when the params are made: a bad
schema, regex or grammar, a schema keyword the output could break, two constraints at
once, an engine without a tokenizer, xgrammar missing: each an InvalidRequestError naming
what is wrong and what is accepted, before anything is queued."""
import builtins
import json
import pickle

import attrs
import pydantic
import pytest

from infergraft import core
from infergraft.core import InvalidRequestError, SamplingParams
from infergraft.core.structured import constraint as constraint_module
from infergraft.core.testing.models import random_prompt


class City(pydantic.BaseModel):
    name: str
    population: int


@pytest.mark.parametrize("fields, message", [
    (dict(json_schema={"type": "bogus"}), r"#/type names type 'bogus'; JSON schema's types"),
    (dict(json_schema="{nope"), r"json_schema is not valid JSON"),
    (dict(json_schema=42), r"json_schema must be a JSON schema: a dict, its JSON text"),
    (dict(json_schema={"type": "integer", "multipleOf": 3}),
     r"#/multipleOf uses keyword 'multipleOf'.*accepted keywords: any: type, enum"),
    (dict(json_schema={"properties": {"a": {"allOf": [{"type": "integer"}]}}}),
     r"#/properties/a/allOf uses keyword 'allOf'"),
    (dict(json_schema={"type": "array", "items": {"oneOf": [{}, {}]}}),
     r"#/items/oneOf uses keyword 'oneOf'"),
    (dict(json_schema={"type": "string", "format": "phone"}), r"names format 'phone'"),
    (dict(json_schema={"type": "string", "pattern": "a+", "maxLength": 3}),
     r"combines pattern or format with minLength / maxLength"),
    (dict(json_schema={"type": "string", "minLength": 4, "maxLength": 2}),
     r"minLength above maxLength"),
    (dict(json_schema={"$ref": "https://example.com/s.json"}), r"only references inside"),
    (dict(json_schema={"$ref": "#/$defs/missing"}), r"json_schema is not valid: .*missing"),
    (dict(regex="a(b"), r"regex is not valid: Regex parsing error at position \d: The "
                        r"parenthesis is not closed.*accepted: a regular expression"),
    (dict(regex=r"(a)\1"), r"Backreference is not supported"),
    (dict(regex=""), r"regex must be a regular expression"),
    (dict(grammar='root ::= "a" |'), r"grammar is not valid: EBNF parser error at line 1"),
    (dict(grammar='start: undefined_rule'), r"grammar is not valid: Lark error at line 1, "
                                            r"column 8: unknown name 'undefined_rule'; accepted"),
    (dict(grammar='other ::= "a"'), r'root rule with name "root" is not found'),
    (dict(choice=[]), r"choice must be a non-empty list of non-empty strings"),
    (dict(choice="yes"), r"choice must be a non-empty list"),
    (dict(choice=["a", ""]), r"choice must be a non-empty list of non-empty strings"),
    (dict(regex="a", choice=["a"]), r"at most one of json_schema, json_object, regex, "
                                    r"grammar, choice; got regex, choice"),
    (dict(json_object="yes"), r"json_object must be True or False"),
    (dict(jump_forward=1), r"jump_forward must be True or False"),
    (dict(logits_processors=7), r"logits_processors must map registered processor names"),
])
def test_bad_fields_are_refused_by_name(fields, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**fields)


def test_good_fields_become_one_constraint():
    assert SamplingParams().constraint is None and SamplingParams().plain_greedy
    p = SamplingParams(json_schema=City)  # a pydantic model class: its JSON schema
    assert p.constraint.kind == "json_schema" and not p.plain_greedy and p.constrained
    assert json.loads(p.json_schema) == City.model_json_schema()
    assert SamplingParams(json_schema=City.model_json_schema()) == p  # a dict: the same
    assert SamplingParams(choice=["a", 'b"c']).constraint.text == 'root ::= "a" | "b\\"c"'
    assert SamplingParams(grammar='start: "x"').constraint.kind == "lark"
    assert SamplingParams(grammar='root ::= "x"').constraint.kind == "ebnf"
    # the schema's own text (its string lengths are corrected in the grammar: schema_check)
    text = SamplingParams(json_schema={"type": "string", "maxLength": 3}).constraint.text
    assert json.loads(text) == {"type": "string", "maxLength": 3}
    # annotations and extensions are no constraint
    SamplingParams(json_schema={"title": "T", "description": "d", "x-note": 1,
                                "type": "object", "properties": {"a": {"default": 1}}})


def test_params_rebuild_from_their_fields_and_pickle():
    # what the server's ranks and the engine process do with them
    p = SamplingParams(json_schema={"type": "integer"}, max_new_tokens=9,
                       logits_processors={"ban-tokens": [1]})
    fields = {a.name: getattr(p, a.name) for a in attrs.fields(SamplingParams) if a.init}
    assert SamplingParams(**fields) == p
    back = pickle.loads(pickle.dumps(p))
    assert back == p and back.constraint == p.constraint and not back.plain_greedy


def test_without_xgrammar_the_error_says_how_to_install_it(monkeypatch):
    real = builtins.__import__

    def no_xgrammar(name, *args, **kwargs):
        if name == "xgrammar":
            raise ImportError("No module named 'xgrammar'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_xgrammar)
    constraint_module.syntax_error.cache_clear()
    with pytest.raises(InvalidRequestError, match=r"needs xgrammar: pip install "
                                                  r"'infergraft\[structured\]'"):
        SamplingParams(regex="never-compiled-before")
    SamplingParams(temperature=0.5)  # the rest needs no xgrammar


def test_engines_refuse_what_they_cannot_run_before_queueing(tiny_llama):
    engine = core.build(tiny_llama, max_seq_len=64)  # token ids only: no tokenizer
    prompt = random_prompt(4, 256, 1)
    with pytest.raises(InvalidRequestError, match="structured output .* needs a tokenizer"):
        engine.generate(prompt, regex="a+")
    with pytest.raises(InvalidRequestError, match=r"unknown sampling parameter\(s\) "
                                                  r"\['json'\]; SamplingParams takes: .*json_schema"):
        engine.generate(prompt, json={"type": "object"})
    with pytest.raises(InvalidRequestError, match="unknown logits processor 'nope'"):
        engine.add_request(prompt, SamplingParams(logits_processors=["nope"]))
    assert not engine.has_unfinished()
    # the other fields pass through generate and stream
    done = engine.generate(prompt, max_new_tokens=3, logprobs=2, min_p=0.1)[0]
    assert len(done.logprobs) == 3
    assert sum(len(d) for d in engine.stream(prompt, max_new_tokens=3, repetition_penalty=1.2)) == 3
