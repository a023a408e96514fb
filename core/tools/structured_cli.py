"""``infergraft generate``'s structured-output flags: the output constrained to a JSON
schema, any JSON object, a regex, a grammar or one of a list of strings (the
SamplingParams fields of core/structured/). Files are read and the constraint checked
before the model loads, so a bad schema exits 2 at once."""
from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import InvalidRequestError


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("structured output (at most one; pip install "
                             "'infergraft[structured]')")
    g.add_argument("--json-schema", metavar="FILE",
                   help="the output is JSON valid under the JSON schema in FILE")
    g.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    g.add_argument("--regex", metavar="R", help="the output matches the regular expression R")
    g.add_argument("--grammar", metavar="FILE",
                   help="the output follows the grammar in FILE: EBNF in GBNF form "
                        "('root ::= ...') or Lark ('start: ...')")
    g.add_argument("--choice", metavar="A,B,...",
                   help="the output is one of these comma-separated strings")


def constraint_fields(args) -> dict:
    """The SamplingParams fields the flags ask for (files read)."""
    fields = {}
    if args.json_schema is not None:
        fields["json_schema"] = _read(args.json_schema, "--json-schema")
    if args.json_object:
        fields["json_object"] = True
    if args.regex is not None:
        fields["regex"] = args.regex
    if args.grammar is not None:
        fields["grammar"] = _read(args.grammar, "--grammar")
    if args.choice is not None:
        fields["choice"] = [c for c in args.choice.split(",") if c] or None
        if fields["choice"] is None:
            raise InvalidRequestError(f"--choice takes comma-separated strings, got "
                                      f"{args.choice!r}")
    return fields


def _read(path: str, flag: str) -> str:
    try:
        return Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidRequestError(f"{flag} {path}: cannot read it ({e.__class__.__name__}: "
                                  f"{e.strerror or e})") from None
