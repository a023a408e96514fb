"""A length-bounded string's grammar (schema_check.schema_grammar): xgrammar's own, its
character class corrected, accepts exactly what the slow pattern form accepts: the
characters JSON allows unescaped, between the bounds, and no raw control character."""
import functools
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from infergraft.core.structured import schema_check
from infergraft.core.testing.strategies import kit_settings
from structured_support import EOS, VOCAB, ascii_tokenizer

xgr = pytest.importorskip("xgrammar")


@functools.cache
def compiler():
    return xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(
        ascii_tokenizer(), vocab_size=VOCAB, stop_token_ids=[EOS]))


def accepts(grammar, text: str) -> bool:
    """Whether ``text`` is a whole output of ``grammar`` (then the stop token is allowed)."""
    matcher = xgr.GrammarMatcher(compiler().compile_grammar(grammar))
    return matcher.accept_string(text) and matcher.accept_token(EOS)


bounds = st.integers(0, 6).flatmap(lambda low: st.tuples(st.just(low), st.integers(low, 8)))
characters = st.sampled_from(['a', 'Z', ' ', '~', '\x7f', 'é', '\u4e2d', '"', '\\',
                              '\x00', '\x01', '\t', '\n', '\r', '\x1f'])


# where the string sits (xgrammar writes short ones inline, long ones as a repetition)
PLACES = {
    "root": (lambda s: s, "{}"),
    "property": (lambda s: {"type": "object", "required": ["s"], "properties": {"s": s}},
                 '{{"s": {}}}'),
    "items": (lambda s: {"type": "array", "items": s, "minItems": 1, "maxItems": 1}, "[{}]"),
    "anyOf": (lambda s: {"anyOf": [s, {"type": "integer"}]}, "{}"),
    "$ref": (lambda s: {"$defs": {"s": s}, "$ref": "#/$defs/s"}, "{}"),
}


@kit_settings(max_examples=60)
@given(bounds=bounds, text=st.lists(characters, max_size=10).map("".join),
       place=st.sampled_from(sorted(PLACES)))
def test_the_corrected_grammar_accepts_what_the_pattern_form_accepts(bounds, text, place):
    low, high = bounds
    wrap, output = PLACES[place]
    schema = wrap({"type": "string", "minLength": low, "maxLength": high})
    fast = schema_check.schema_grammar(xgr, json.dumps(schema))
    assert "Regex(" not in str(fast)  # (bounded repetition, not one state a character)
    slow = xgr.Grammar.from_json_schema(json.dumps(
        schema_check.with_string_lengths_as_patterns(schema)), any_whitespace=False)
    output = output.format('"' + text + '"')
    want = low <= len(text) <= high and not any(c in '"\\' or ord(c) < 0x20 for c in text)
    assert accepts(slow, output) == want
    assert accepts(fast, output) == want


def test_a_corrected_grammar_that_does_not_parse_back_takes_the_pattern_form(monkeypatch):
    schema = {"type": "object", "required": ["s"], "properties": {
        "s": {"type": "string", "maxLength": 3}}}
    def disagree(text, *args, **kwargs):
        raise RuntimeError("EBNF parser: unexpected token")

    monkeypatch.setattr(xgr.Grammar, "from_ebnf", staticmethod(disagree))
    grammar = schema_check.schema_grammar(xgr, json.dumps(schema))
    assert "Regex(" in str(grammar)
    assert accepts(grammar, '{"s": "abc"}') and not accepts(grammar, '{"s": "a\x01"}')
