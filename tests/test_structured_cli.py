"""``infergraft generate --json-schema FILE / --json-object / --regex R / --grammar FILE /
--choice A,B``: the printed answer obeys the constraint (a tiny random model behind
SmolLM2's real byte-level BPE tokenizer: merges, added tokens, a chat template); a bad
constraint exits 2 naming what is wrong before the model loads."""
import json
import re

import jsonschema
import pytest

from infergraft.core import cli
from cli_support import tiny_chat_model

SCHEMA = {"type": "object", "properties": {
    "unit": {"enum": ["m", "km", "mile"]}, "count": {"type": "integer", "minimum": 0,
                                                    "maximum": 1000},
    "ok": {"type": "boolean"},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["unit", "count", "ok", "tags"]}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(tiny_chat_model(tmp_path_factory.mktemp("tiny-chat")))


def generate(capsys, model_dir, *extra):
    argv = ["generate", "Describe a trip", "--model", model_dir, "--max-seq-len", "256",
            "--max-new-tokens", "120", "-v", *extra]
    assert cli.main(argv) == 0
    out = capsys.readouterr()
    return out.out.rstrip("\n"), out.err


def test_json_schema_and_json_object(capsys, model_dir, tmp_path):
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMA))
    for extra in ([], ["--stream"], ["--temperature", "1", "--seed", "3"]):
        text, err = generate(capsys, model_dir, "--json-schema", str(path), *extra)
        jsonschema.validate(json.loads(text), SCHEMA)
        assert "finish=stop" in err, (extra, text)
    text, err = generate(capsys, model_dir, "--json-object", "--max-new-tokens", "24")
    assert text.startswith("{")


def test_regex_grammar_and_choice(capsys, model_dir, tmp_path):
    text, _ = generate(capsys, model_dir, "--regex", r"[A-Z][a-z]{2,8} \d{1,4}")
    assert re.fullmatch(r"[A-Z][a-z]{2,8} \d{1,4}", text), text
    grammar = tmp_path / "sum.gbnf"
    grammar.write_text('root ::= num " + " num " = " num\nnum ::= [0-9]{1,3}\n')
    text, _ = generate(capsys, model_dir, "--grammar", str(grammar))
    assert re.fullmatch(r"\d{1,3} \+ \d{1,3} = \d{1,3}", text), text
    text, _ = generate(capsys, model_dir, "--choice", "north,south,east,west")
    assert text in ("north", "south", "east", "west")


@pytest.mark.parametrize("extra, message", [
    (["--regex", "a(b"], "regex is not valid: .*parenthesis is not closed"),
    (["--choice", ","], "--choice takes comma-separated strings"),
    (["--regex", "a", "--json-object"], "at most one of .*got json_object, regex"),
    (["--grammar", "/no/such.gbnf"], r"--grammar /no/such.gbnf: cannot read it"),
])
def test_a_bad_constraint_exits_2_before_the_model_loads(capsys, extra, message):
    # no such model: had it tried to load one, the error would be about the model
    assert cli.main(["generate", "hi", "--model", "/no/such/model", *extra]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err


def test_an_unsupported_schema_keyword_is_named(capsys, tmp_path):
    path = tmp_path / "schema.json"
    path.write_text(json.dumps({"type": "array", "uniqueItems": True}))
    assert cli.main(["generate", "hi", "--model", "/no/such/model", "--json-schema",
                     str(path)]) == 2
    err = capsys.readouterr().err
    assert "#/uniqueItems uses keyword 'uniqueItems'" in err and "accepted keywords" in err
