"""What a template family's tool calls look like in a model's text: ``Family``.

A family names the markers that open a block of calls in the text (Hermes' ``<tool_call>``,
Mistral's ``[TOOL_CALLS]``, LLaMA 3's bare ``{``), reads such a block as it arrives
(``open(...).advance(text, final)``: None while it may go on, else a ``Block`` saying
where it ends and which calls it holds, or that it holds none and stays text), writes the
system prompt that lists the tools and an assistant's past calls as text (for chat
templates that know no tools), and makes call ids. ``shaping.py`` turns a choice's text
into content and calls with it, streamed or whole."""
from __future__ import annotations

import json
import secrets
import string
from typing import Optional

import attrs

from .scanning import JsonScanner, Malformed, call_of

ALNUM = string.ascii_letters + string.digits


@attrs.frozen
class Block:
    """A judged block: it ends at ``end``; ``calls`` (name, arguments) or None: no call
    (the text up to ``end`` stays in the content)."""
    end: int
    calls: Optional[list] = None


class Family:
    name = ""
    markers: tuple[str, ...] = ()  # texts that open a block of calls
    # a marker some tokenizers hold as a special token, which decoding drops: the shaper
    # puts it back where its token id came (tool_calls/shaping.py)
    special: Optional[str] = None
    separators = " \t\r\n"  # what sits between calls and around them, dropped there
    arguments_key = "arguments"  # the key of a call's arguments in its JSON
    keys = ("arguments", "parameters")  # the keys a parsed call may use

    def find(self, text: str, pos: int) -> Optional[int]:
        """Where the first marker at or after ``pos`` begins (None: none whole yet)."""
        found = [i for i in (text.find(m, pos) for m in self.markers) if i >= 0]
        return min(found) if found else None

    def hold_from(self, text: str, pos: int) -> int:
        """Where a tail of ``text`` that may be the start of a marker begins (len: none)."""
        for k in range(min(max(map(len, self.markers)) - 1, len(text) - pos), 0, -1):
            if any(m.startswith(text[-k:]) for m in self.markers):
                return len(text) - k
        return len(text)

    def open(self, text: str, start: int, names):
        """The reader of the block whose marker begins at ``start``."""
        raise NotImplementedError

    def describe(self, tools: list[dict]) -> str:
        """The system prompt listing ``tools`` and how to call them, for a template
        without tools."""
        raise NotImplementedError

    def render(self, calls: list[dict]) -> str:
        """An assistant message's ``tool_calls`` as the model would have written them."""
        raise NotImplementedError

    def new_id(self) -> str:
        return "call_" + "".join(secrets.choice(ALNUM) for _ in range(24))


def tool_lines(tools: list[dict]) -> str:
    """Each tool's function (name, description, parameters) as one line of JSON."""
    return "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)


class JsonBlock:
    """A block whose calls are one JSON value after a marker of ``skip`` characters: an
    object (one call) or, where ``lists`` allows, an array of them (all calls, or none)."""

    def __init__(self, start: int, skip: int, names, keys, lists: bool = True):
        self.start, self.names, self.keys, self.lists = start, names, keys, lists
        self.scanner = JsonScanner(start + skip)
        # where a block that holds no call ends: past its marker (a bare "{": past it)
        self.opening = start + max(skip, 1)

    def advance(self, text: str, final: bool) -> Optional[Block]:
        try:
            end = self.scanner.advance(text)
        except Malformed:
            return Block(self.opening)
        if end is None:
            return Block(self.opening) if final else None
        try:
            value = json.loads(text[self.scanner.begin:end])
        except ValueError:
            return Block(end)
        return Block(end, self.calls(value))

    def calls(self, value) -> Optional[list]:
        values = value if self.lists and isinstance(value, list) and value else [value]
        calls = [call_of(v, self.names, self.keys) for v in values]
        return None if any(c is None for c in calls) else calls
