"""SamplingParams' structured-output fields -> one ``Constraint``, checked up front.

At most one of ``json_schema``, ``json_object``, ``regex``, ``grammar`` and ``choice``
may be given. Each is checked when the SamplingParams is made: its form, the JSON
schema's keywords (``schema_check``) and its syntax, which xgrammar parses without a
tokenizer in well under a millisecond (cached per text). What is wrong comes back as an
InvalidRequestError naming the field, the problem and what is accepted; the compilation
against the engine's tokenizer happens later, when the engine adds the request.
"""
from __future__ import annotations

import functools
import json
import re

import attrs

from ..errors import InvalidRequestError
from .schema_check import check_schema

KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")
#: the logits processor that runs a Constraint (core/structured/grammar.py)
PROCESSOR = "grammar"
INSTALL = "pip install 'infergraft[structured]'"
ACCEPTED = {
    "json_schema": "a JSON schema: a dict, its JSON text, or a pydantic model class",
    "regex": "a regular expression in xgrammar's syntax (literals, classes such as [a-z] "
             r"\d \w \s, groups, |, ?, *, +, {m,n}; no backreferences or lookaround)",
    "grammar": "an EBNF grammar in GBNF form (llama.cpp's: rules 'name ::= ...' with a "
               "'root' rule) or a Lark grammar (rules 'name: ...' with a 'start' rule)",
    "choice": "a non-empty list of non-empty strings",
}


@attrs.frozen
class Constraint:
    """What the output must match. ``kind``: json_schema, json_object, regex, ebnf, lark
    or choice; ``text``: what xgrammar compiles (the schema's JSON text, the regex, the
    grammar; for a choice an EBNF grammar of its strings; "" for json_object)."""
    kind: str
    text: str


def schema_text(value):
    """``json_schema`` as JSON text: a dict (or list / bool), JSON text, or a pydantic
    model class (its ``model_json_schema()``); None stays None."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, type) and hasattr(value, "model_json_schema"):
        value = value.model_json_schema()
    if not isinstance(value, (dict, bool)):
        raise InvalidRequestError(f"json_schema must be {ACCEPTED['json_schema']}, got "
                                  f"{type(value).__name__}")
    try:
        return json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise InvalidRequestError(f"json_schema does not serialise as JSON: {e}") from None


def choices(value):
    """``choice`` as a tuple of strings (None stays None)."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)) and value and all(
            isinstance(c, str) and c for c in value):
        return tuple(value)
    raise InvalidRequestError(f"choice must be {ACCEPTED['choice']}, got {value!r}")


def check_constraint(params) -> Constraint | None:
    """The request's Constraint (None: unconstrained); InvalidRequestError if it is bad."""
    if not isinstance(params.jump_forward, bool):
        raise InvalidRequestError(f"jump_forward must be True or False, got {params.jump_forward!r}")
    given = [k for k in KINDS if getattr(params, k) not in (None, False)]
    if len(given) > 1:
        raise InvalidRequestError(f"give at most one of {', '.join(KINDS)}; got {', '.join(given)}")
    if not given:
        return None
    kind = given[0]
    value = getattr(params, kind)
    if kind == "json_object":
        if value is not True:
            raise InvalidRequestError(f"json_object must be True or False, got {value!r}")
        return Constraint("json_object", "")
    if kind == "choice":
        # each string a GBNF literal: JSON's escapes are GBNF's (\" \\ \n \t \uXXXX)
        text = "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value)
        return _checked(Constraint("choice", text), kind)
    if not isinstance(value, str) or not value.strip():
        raise InvalidRequestError(f"{kind} must be {ACCEPTED[kind]}, got {value!r}")
    if kind == "json_schema":
        try:
            schema = json.loads(value)
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"json_schema is not valid JSON: {e}") from None
        check_schema(schema)
        text = json.dumps(schema)
        return _checked(Constraint(kind, text), kind)
    if kind == "grammar":
        kind_of_grammar = "ebnf" if "::=" in value else "lark"
        return _checked(Constraint(kind_of_grammar, value), kind)
    return _checked(Constraint(kind, value), kind)


def _checked(constraint: Constraint, field: str) -> Constraint:
    error = syntax_error(constraint.kind, constraint.text)
    if error is not None:
        raise InvalidRequestError(f"{field} is not valid: {error}; accepted: {ACCEPTED[field]}")
    return constraint


@functools.lru_cache(maxsize=1024)
def syntax_error(kind: str, text: str) -> str | None:
    """xgrammar's complaint about ``text`` parsed as ``kind`` (None: it parses)."""
    xgr = xgrammar()
    parse = {"json_schema": lambda t: xgr.Grammar.from_json_schema(t, any_whitespace=False),
             "regex": xgr.Grammar.from_regex, "ebnf": xgr.Grammar.from_ebnf,
             "choice": xgr.Grammar.from_ebnf, "lark": xgr.Grammar.from_lark}[kind]
    try:
        parse(text)
    except Exception as e:  # xgrammar raises RuntimeError / ValueError with its reason
        return _reason(e)
    return None


def xgrammar():
    """The xgrammar module, or an InvalidRequestError saying how to install it."""
    try:
        import xgrammar
    except ImportError:
        raise InvalidRequestError(f"structured output (json_schema, json_object, regex, "
                                  f"grammar, choice) needs xgrammar: {INSTALL}") from None
    return xgrammar


# "[04:17:44] /project/cpp/regex_converter.cc:94: " and "Check failed: (...) is false: "
_NOISE = re.compile(r"^\[[0-9:]+\] \S+:\d+: |Check failed: \(.*?\) is false: ")


def _reason(error: Exception) -> str:
    text = str(error).strip()
    return _NOISE.sub("", text.splitlines()[0] if "\n" in text else text).strip() \
        or type(error).__name__
