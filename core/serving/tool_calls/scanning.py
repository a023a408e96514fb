"""Where a JSON object or array ends in text that is still arriving.

``JsonScanner`` reads a growing text from where a value opens (``{`` or ``[``) and says
where it closes, keeping its place between calls so that a streamed call's text is read
once, not again at every token. It follows brackets and strings (escapes included), not
the rest of JSON's grammar: ``json.loads`` of the span it finds says whether the value is
valid. ``call_of`` decides whether a parsed value is a call of one of the request's
functions."""
from __future__ import annotations

from typing import Optional

import attrs

_CLOSE = {"{": "}", "[": "]"}


class Malformed(ValueError):
    """The text cannot be the JSON value it opened (a bracket closed by the other kind,
    something other than an object or array where one should open)."""


class JsonScanner:
    def __init__(self, start: int):
        """``start``: where the value begins in the text (whitespace before it skipped)."""
        self.pos = start  # the next character to read
        self.stack: list[str] = []  # the closing brackets owed
        self.in_string = self.escaped = False
        self.opened = False
        self.begin: Optional[int] = None  # where the value opens, once read

    def advance(self, text: str) -> Optional[int]:
        """The index just past the value once ``text`` holds all of it, else None (read on
        when more text has come); Malformed if it cannot be one."""
        pos, n = self.pos, len(text)
        while pos < n:
            c = text[pos]
            pos += 1
            if not self.opened:
                if c in " \t\r\n":
                    continue
                if c not in _CLOSE:
                    raise Malformed(f"expected an object or array, got {c!r}")
                self.opened, self.begin = True, pos - 1
                self.stack.append(_CLOSE[c])
            elif self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in _CLOSE:
                self.stack.append(_CLOSE[c])
            elif c in "}]":
                if c != self.stack.pop():
                    raise Malformed(f"{c!r} closes a {'{' if c == ']' else '['}")
                if not self.stack:
                    self.pos = pos
                    return pos
        self.pos = pos
        return None


@attrs.frozen
class Call:
    """One function call: its id (``call_...``), function name and arguments (JSON text)."""
    id: str
    name: str
    arguments: str


def call_of(value, names, keys=("arguments", "parameters")) -> Optional[tuple[str, dict]]:
    """(name, arguments) if ``value`` is ``{"name": one of names, KEY: {...}}`` for one of
    ``keys``, else None: what a template family's call looks like once parsed."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    given = [k for k in keys if k in value]
    if value["name"] not in names or len(given) != 1 or set(value) != {"name", given[0]}:
        return None
    arguments = value[given[0]]
    return (value["name"], arguments) if isinstance(arguments, dict) else None
