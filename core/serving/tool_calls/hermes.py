"""Hermes and Qwen (2, 2.5, 3): each call a JSON object ``{"name": ..., "arguments": {...}}``
between ``<tool_call>`` and ``</tool_call>``, text before and after it the content. A
block the model did not close is read to the end of the output."""
from __future__ import annotations

import json
from typing import Optional

from .base import Block, Family, tool_lines
from .scanning import call_of

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class Hermes(Family):
    name = "hermes"
    markers = (OPEN,)

    def open(self, text: str, start: int, names):
        return _Block(start, names, self.keys)

    def describe(self, tools: list[dict]) -> str:
        return ("You can call functions to answer. Each is described by a JSON schema of its "
                f"arguments:\n<tools>\n{tool_lines(tools)}\n</tools>\nTo call one, write a "
                "JSON object with its name and arguments between <tool_call> tags:\n"
                '<tool_call>\n{"name": "<function name>", "arguments": {<its arguments>}}\n'
                "</tool_call>")

    def render(self, calls: list[dict]) -> str:
        return "\n".join(f"{OPEN}\n{json.dumps(c, ensure_ascii=False)}\n{CLOSE}"
                         for c in calls)


class _Block:
    def __init__(self, start: int, names, keys):
        self.body = self.searched = start + len(OPEN)
        self.names, self.keys = names, keys

    def advance(self, text: str, final: bool) -> Optional[Block]:
        close = text.find(CLOSE, self.searched)
        if close < 0 and not final:
            self.searched = max(self.body, len(text) - len(CLOSE) + 1)
            return None
        body, end = (text[self.body:], len(text)) if close < 0 else \
            (text[self.body:close], close + len(CLOSE))
        try:
            call = call_of(json.loads(body), self.names, self.keys)
        except ValueError:
            call = None
        return Block(end, None if call is None else [call])
