"""The JSON-schema keywords structured output follows; any other is refused by name.

xgrammar compiles a schema into a grammar but silently ignores what it cannot express
(``allOf``, ``oneOf``'s "exactly one", ``multipleOf``, ``uniqueItems``, ``not``, ...), so an
output could break a schema that was accepted. Rather than that, a schema may use only the
keywords below (about OpenAI's strict subset, plus bounds xgrammar does enforce), and
annotations, which constrain nothing; anything else is an InvalidRequestError naming the
keyword, where it is and what is accepted. Outputs are compact JSON (", " and ": "
separators); an object gets no property its schema does not list unless
``additionalProperties`` allows them.

``schema_grammar``: xgrammar's grammar for a string with minLength / maxLength lets raw
control characters through (invalid JSON), so that string's character class is corrected
in the grammar, which keeps xgrammar's bounded repetition (a schema compiles in
milliseconds). Where the corrected grammar does not parse back, such a string is written
as the pattern of that many unescaped characters instead (``with_string_lengths_as_patterns``),
which xgrammar also gets right but compiles one state per character: tenths of a second.
"""
from __future__ import annotations

import json
import re

from ..errors import InvalidRequestError

# xgrammar's class of a length-bounded string's characters: anything but a quote, a
# backslash, CR and LF (other control characters let through); and JSON's instead
_LENGTH_CHARACTERS = re.compile(r'\[\^\\"\\\\\\r\\n\]')
_JSON_CHARACTERS = r'[^\\0-\\x1f\\"\\\\]'

ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$id",
                         "$comment", "deprecated", "readOnly", "writeOnly"})
KEYWORDS = {  # what each applies to -> the keywords the output is guaranteed to follow
    "any": ("type", "enum", "const", "anyOf", "$ref", "$defs", "definitions"),
    "string": ("minLength", "maxLength", "pattern", "format"),
    "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"),
    "array": ("items", "prefixItems", "minItems", "maxItems"),
    "object": ("properties", "required", "additionalProperties", "minProperties",
               "maxProperties"),
}
SUPPORTED = frozenset(k for words in KEYWORDS.values() for k in words)
FORMATS = ("date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6",
           "uri", "uri-reference", "uri-template", "uuid", "json-pointer",
           "relative-json-pointer")
TYPES = ("string", "integer", "number", "boolean", "object", "array", "null")
# keywords whose value is a schema, a list of schemas, or a name -> schema map
_SCHEMA = ("items", "additionalProperties")
_SCHEMA_LIST = ("anyOf", "prefixItems")
_SCHEMA_MAP = ("properties", "$defs", "definitions")


def accepted() -> str:
    """The accepted keywords, for error messages and docs."""
    kinds = "; ".join(f"{kind}: {', '.join(words)}" for kind, words in KEYWORDS.items())
    return (f"{kinds}; annotations ({', '.join(sorted(ANNOTATIONS))}) and 'x-' extensions "
            "are ignored")


def check_schema(schema, path: str = "#") -> None:
    """InvalidRequestError if ``schema`` (parsed JSON) uses a keyword outside SUPPORTED,
    a format outside FORMATS, an unknown type, or a non-local $ref."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        _refuse(path, f"is {type(schema).__name__}, not a schema (an object or a boolean)")
    for key, value in schema.items():
        where = f"{path}/{key}"
        if key in ANNOTATIONS or key.startswith("x-"):
            continue
        if key not in SUPPORTED:
            _refuse(where, f"uses keyword {key!r}, which structured output cannot guarantee")
        if key in _SCHEMA:
            check_schema(value, where)
        elif key in _SCHEMA_LIST:
            if not isinstance(value, list) or not value:
                _refuse(where, "must be a non-empty list of schemas")
            for i, sub in enumerate(value):
                check_schema(sub, f"{where}/{i}")
        elif key in _SCHEMA_MAP:
            if not isinstance(value, dict):
                _refuse(where, "must map names to schemas")
            for name, sub in value.items():
                check_schema(sub, f"{where}/{name}")
    _check_values(schema, path)


def _check_values(schema: dict, path: str) -> None:
    kinds = schema.get("type")
    for kind in kinds if isinstance(kinds, list) else [kinds] if kinds is not None else []:
        if kind not in TYPES:
            _refuse(f"{path}/type", f"names type {kind!r}; JSON schema's types are "
                                    f"{', '.join(TYPES)}", keywords=False)
    for key in ("minLength", "maxLength"):
        n = schema.get(key, 0)
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            _refuse(f"{path}/{key}", f"is {n!r}; a length is an integer >= 0", keywords=False)
    if schema.get("minLength", 0) > schema.get("maxLength", schema.get("minLength", 0)):
        _refuse(path, "has minLength above maxLength: no string fits", keywords=False)
    fmt = schema.get("format")
    if fmt is not None and fmt not in FORMATS:
        _refuse(f"{path}/format", f"names format {fmt!r}; the formats followed are "
                                  f"{', '.join(FORMATS)}", keywords=False)
    # xgrammar builds a pattern's (or a format's) grammar and drops the lengths beside it
    if ({"pattern", "format"} & set(schema)) and ({"minLength", "maxLength"} & set(schema)):
        _refuse(path, "combines pattern or format with minLength / maxLength, which would "
                      "not be followed together: put the length in the pattern ({m,n})",
                keywords=False)
    ref = schema.get("$ref")
    if ref is not None and (not isinstance(ref, str) or not ref.startswith("#")):
        _refuse(f"{path}/$ref", f"is {ref!r}; only references inside the schema "
                                "('#/$defs/...') are followed", keywords=False)


def schema_grammar(xgr, text: str):
    """xgrammar's Grammar of a checked schema's JSON ``text`` (compact separators), its
    length-bounded strings' characters those JSON allows unescaped."""
    grammar = xgr.Grammar.from_json_schema(text, any_whitespace=False)
    printed = str(grammar).splitlines()
    corrected = [line if "Regex(" in line else  # (a pattern's own text)
                 _LENGTH_CHARACTERS.sub(_JSON_CHARACTERS, line) for line in printed]
    if corrected == printed:
        return grammar
    try:
        return xgr.Grammar.from_ebnf("\n".join(corrected))
    except Exception:  # (xgrammar's printer and parser disagree: the slower, right form)
        text = json.dumps(with_string_lengths_as_patterns(json.loads(text)))
        return xgr.Grammar.from_json_schema(text, any_whitespace=False)


def with_string_lengths_as_patterns(schema):
    """``schema`` (checked) with each string's minLength / maxLength written as a pattern:
    that many characters other than a quote, a backslash or a control character."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA:
        if key in out:
            out[key] = with_string_lengths_as_patterns(out[key])
    for key in _SCHEMA_LIST:
        if key in out:
            out[key] = [with_string_lengths_as_patterns(sub) for sub in out[key]]
    for key in _SCHEMA_MAP:
        if key in out:
            out[key] = {k: with_string_lengths_as_patterns(v) for k, v in out[key].items()}
    if {"minLength", "maxLength"} & set(out):
        low, high = out.pop("minLength", 0), out.pop("maxLength", "")
        out["pattern"] = '^[^"\\\\\\x00-\\x1f]{%s,%s}$' % (low, high)
    return out


def _refuse(where: str, what: str, keywords: bool = True):
    also = f"; accepted keywords: {accepted()}" if keywords else ""
    raise InvalidRequestError(f"json_schema at {where} {what}{also}")
