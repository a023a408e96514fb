"""Mistral (v0.3 and later instruct models): ``[TOOL_CALLS]`` and a JSON array of
``{"name": ..., "arguments": {...}}`` (a single object taken too), or, from the v11
tokenizers on, ``[TOOL_CALLS]name[ARGS]{...}`` per call. ``[TOOL_CALLS]`` is a special
token of Mistral's tokenizers: the shaper restores it from the token ids. Call ids are 9
letters and digits: Mistral's templates refuse any other in the next request."""
from __future__ import annotations

import json
import secrets
from typing import Optional

from .base import ALNUM, Block, Family, JsonBlock, tool_lines
from .scanning import JsonScanner, Malformed

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
LONGEST_NAME = 64  # OpenAI's limit: past it without [ARGS], no v11 call


class Mistral(Family):
    name = "mistral"
    markers = (TOOL_CALLS,)
    special = TOOL_CALLS

    def open(self, text: str, start: int, names):
        return _Block(start, names, self.keys)

    def describe(self, tools: list[dict]) -> str:
        return ("You can call functions to answer. Each is described by a JSON schema of its "
                f"arguments:\n{tool_lines(tools)}\nTo call them, answer with [TOOL_CALLS] and "
                'a JSON list of calls: [TOOL_CALLS][{"name": "<function name>", "arguments": '
                "{<its arguments>}}]")

    def render(self, calls: list[dict]) -> str:
        return TOOL_CALLS + json.dumps(calls, ensure_ascii=False)

    def new_id(self) -> str:
        return "".join(secrets.choice(ALNUM) for _ in range(9))


class _Block:
    """``[TOOL_CALLS]`` then JSON (JsonBlock), or then ``name[ARGS]{...}``."""

    def __init__(self, start: int, names, keys):
        self.start, self.names, self.keys = start, names, keys
        self.json: Optional[JsonBlock] = None
        self.args: Optional[JsonScanner] = None
        self.name = ""

    def advance(self, text: str, final: bool) -> Optional[Block]:
        if self.json is not None:
            return self.json.advance(text, final)
        if self.args is None:
            body = self.start + len(TOOL_CALLS)
            rest = text[body:].lstrip()
            if rest[:1] in ("[", "{"):
                self.json = JsonBlock(self.start, len(TOOL_CALLS), self.names, self.keys)
                return self.json.advance(text, final)
            at = text.find(ARGS, body)
            if at < 0:
                waiting = not final and len(rest) <= LONGEST_NAME
                return None if waiting else self._none()
            self.name = text[body:at].strip()
            self.args = JsonScanner(at + len(ARGS))
        try:
            end = self.args.advance(text)
        except Malformed:
            return self._none()
        if end is None:
            return self._none() if final else None
        try:
            arguments = json.loads(text[self.args.begin:end])
        except ValueError:
            return Block(end)
        if self.name not in self.names or not isinstance(arguments, dict):
            return Block(end)
        return Block(end, [(self.name, arguments)])

    def _none(self) -> Block:
        return Block(self.start + len(TOOL_CALLS))
