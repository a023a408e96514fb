"""Structured output in a request: OpenAI's ``response_format`` (``text``, ``json_object``,
``json_schema``), vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar`` and their newer spelling ``structured_outputs: {json | regex | choice |
grammar | json_object}`` (the openai client sends vLLM's through ``extra_body``).

``constraint_sources`` reads each of them into the SamplingParams field it sets, with the
request parameter it came from; ``checked_constraint`` takes at most one of those (a
forced tool call, ``tool_calls/``, is one too) and checks it as the engine would (schema
keywords, regex and grammar syntax), so that what is wrong is a 400 naming the parameter
before anything is queued. Needs nothing beyond the core."""
from __future__ import annotations

import re

import attrs

from ..errors import InvalidRequestError
from ..request import SamplingParams
from .openai_errors import bad, short

RESPONSE_FORMATS = ("text", "json_object", "json_schema")
JSON_SCHEMA_KEYS = {"name", "schema", "strict", "description"}
# OpenAI's rule for a response format's (and a function's) name
NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
GUIDED = {"guided_json": "json_schema", "guided_regex": "regex",
          "guided_choice": "choice", "guided_grammar": "grammar"}
STRUCTURED_OUTPUTS = {"json": "json_schema", "regex": "regex", "choice": "choice",
                      "grammar": "grammar", "json_object": "json_object"}
KEYS = {"response_format", "structured_outputs", *GUIDED}


@attrs.frozen
class Source:
    """One constraint a request gives: the SamplingParams field and value, and where."""
    param: str  # the request parameter, as the 400 names it ("response_format", ...)
    field: str  # json_schema, json_object, regex, grammar or choice
    value: object


def constraint_sources(body: dict) -> list[Source]:
    """Every constraint ``body`` gives, in the order of KEYS' parameters (none: [])."""
    found = []
    fmt = body.get("response_format")
    if fmt is not None:
        found += _response_format(fmt)
    for param, field in GUIDED.items():
        if body.get(param) is not None:
            found.append(Source(param, field, body[param]))
    outputs = body.get("structured_outputs")
    if outputs is not None:
        found += _structured_outputs(outputs)
    return found


def checked_constraint(sources: list[Source]) -> dict:
    """The SamplingParams keyword of the one constraint in ``sources`` ({} for none),
    checked; a 400 naming the parameters when there are several, or the one at fault."""
    if len(sources) > 1:
        names = ", ".join(s.param for s in sources)
        raise bad(sources[1].param, f"give at most one constraint on the output: got {names} "
                                    "(response_format, guided_json, guided_regex, "
                                    "guided_choice, guided_grammar, structured_outputs and "
                                    "a tool_choice that forces a call each constrain it)")
    if not sources:
        return {}
    source = sources[0]
    kw = {source.field: source.value}
    try:
        SamplingParams(**kw)  # the engine's own checks (syntax parsed and cached here)
    except InvalidRequestError as e:
        raise bad(source.param, f"{source.param}: {e}") from None
    return kw


def _response_format(fmt) -> list[Source]:
    if not isinstance(fmt, dict) or fmt.get("type") not in RESPONSE_FORMATS:
        got = fmt.get("type") if isinstance(fmt, dict) else fmt
        raise bad("response_format", f"response_format must be an object whose type is one of "
                                     f"{', '.join(RESPONSE_FORMATS)}, got {short(got)}")
    kind = fmt["type"]
    extra = set(fmt) - {"type"} - ({"json_schema"} if kind == "json_schema" else set())
    if extra:
        raise bad(f"response_format.{sorted(extra)[0]}",
                  f"response_format of type {kind} takes no {', '.join(sorted(extra))}")
    if kind == "text":
        return []
    if kind == "json_object":
        return [Source("response_format", "json_object", True)]
    spec = fmt.get("json_schema")
    where = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise bad(where, f"{where} must be an object with name, schema (a JSON schema), "
                         f"strict and description, got {short(spec)}")
    if set(spec) - JSON_SCHEMA_KEYS:
        key = sorted(set(spec) - JSON_SCHEMA_KEYS)[0]
        raise bad(f"{where}.{key}", f"{where} has an unknown field {key!r} (accepted: "
                                    f"{', '.join(sorted(JSON_SCHEMA_KEYS))})")
    name = spec.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise bad(f"{where}.name", f"{where}.name must be 1 to 64 letters, digits, _ or -, "
                                   f"got {short(name)}")
    for key, kinds, what in (("strict", bool, "true or false"),
                             ("description", str, "a string")):
        if spec.get(key) is not None and not isinstance(spec[key], kinds):
            raise bad(f"{where}.{key}", f"{where}.{key} must be {what}, got {short(spec[key])}")
    schema = spec.get("schema")
    if schema is None:  # OpenAI: no schema, any JSON object
        return [Source("response_format", "json_object", True)]
    if not isinstance(schema, dict):
        raise bad(f"{where}.schema", f"{where}.schema must be a JSON schema (an object), got "
                                     f"{short(schema)}")
    # (strict false promises less than we give: the schema is followed either way)
    return [Source(f"{where}.schema", "json_schema", schema)]


def _structured_outputs(outputs) -> list[Source]:
    if not isinstance(outputs, dict):
        raise bad("structured_outputs", f"structured_outputs must be an object with one of "
                                        f"{', '.join(STRUCTURED_OUTPUTS)}, got {short(outputs)}")
    unknown = sorted(set(outputs) - set(STRUCTURED_OUTPUTS))
    if unknown:
        raise bad(f"structured_outputs.{unknown[0]}",
                  f"structured_outputs has an unknown field {unknown[0]!r} (accepted: "
                  f"{', '.join(STRUCTURED_OUTPUTS)})")
    found = []
    for key, field in STRUCTURED_OUTPUTS.items():
        value = outputs.get(key)
        if value is None or (key == "json_object" and value is False):
            continue
        found.append(Source(f"structured_outputs.{key}", field, value))
    return found

