"""LLaMA 3.1 to 3.3 (``llama3_json``): a call is a bare JSON object ``{"name": ...,
"parameters": {...}}`` (``"arguments"`` taken too), after ``<|python_tag|>`` or not,
several separated by ``;``. Any other JSON object in the text (an answer that is JSON)
stays content: a call names one of the request's functions and holds nothing else."""
from __future__ import annotations

import json

from .base import Family, JsonBlock, tool_lines

PYTHON_TAG = "<|python_tag|>"


class Llama3Json(Family):
    name = "llama3_json"
    markers = (PYTHON_TAG, "{")
    special = PYTHON_TAG
    separators = " \t\r\n;"
    arguments_key = "parameters"

    def open(self, text: str, start: int, names):
        skip = len(PYTHON_TAG) if text.startswith(PYTHON_TAG, start) else 0
        return JsonBlock(start, skip, names, self.keys, lists=False)

    def describe(self, tools: list[dict]) -> str:
        return ("You can call functions to answer. Each is described by a JSON schema of its "
                f"parameters:\n{tool_lines(tools)}\nTo call one, answer with only a JSON "
                'object of the form {"name": "<function name>", "parameters": {<its '
                'arguments>}}; separate several calls with "; ".')

    def render(self, calls: list[dict]) -> str:
        return "; ".join(json.dumps({"name": c["name"], "parameters": c["arguments"]},
                                    ensure_ascii=False) for c in calls)
