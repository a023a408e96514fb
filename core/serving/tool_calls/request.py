"""A chat request's ``tools``, ``tool_choice`` and ``parallel_tool_calls``, checked:
``ToolRequest``, and for a choice that forces a call the JSON schema the output is held to.

``tool_choice``: ``none`` (the tools are not shown to the model and nothing is parsed),
``auto`` (the default with tools: the output is parsed for calls, ``shaping.AutoShaper``),
``required`` (one call or more: an array of ``{"name", ARGS}`` objects, or one such
object when ``parallel_tool_calls`` is false) or ``{"type": "function", "function":
{"name": ...}}`` (that function: the output is its arguments, as vLLM does). A forced
call's schema is built from the functions' ``parameters`` and checked as any
``json_schema`` is, a keyword it cannot follow refused naming the tool. Needs nothing
beyond the core."""
from __future__ import annotations

import copy
from typing import Optional

import attrs

from ..openai_errors import bad, short
from ..structured import NAME, Source, checked_constraint
from .shaping import AutoShaper, ForcedShaper

CHOICES = ("none", "auto", "required")
FUNCTION_KEYS = {"name", "description", "parameters", "strict"}
NO_PARAMETERS = {"type": "object", "properties": {}}


@attrs.frozen
class ToolRequest:
    tools: tuple  # {"type": "function", "function": {name, description, parameters}}
    choice: str  # none, auto, required or function
    function: Optional[str] = None  # the one tool_choice names
    parallel: bool = True

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    def shown(self) -> Optional[list[dict]]:
        """The tools the chat template lists (none for tool_choice none)."""
        return None if self.choice == "none" else [dict(t) for t in self.tools]

    def shaper(self, family, marker_id=None, decode=None):
        """A choice's shaper (None: tool_choice none, the text is all content)."""
        if self.choice == "none":
            return None
        if self.choice == "auto":
            return AutoShaper(family, self.names, None if self.parallel else 1, marker_id,
                              decode)
        return ForcedShaper(family.new_id, self.function, family.arguments_key)


def parse_tools(body: dict, arguments_key: str = "arguments") -> tuple:
    """(ToolRequest or None, [the Source of a forced call's schema] or [])."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad("parallel_tool_calls", f"parallel_tool_calls must be true or false, got "
                                         f"{short(parallel)}")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise bad("tool_choice", f"tool_choice {short(choice)} needs tools: give the "
                                     "functions in tools, or leave tool_choice out")
        return None, []
    checked = _tools(tools)
    request = ToolRequest(checked, *_choice(choice, [t["function"]["name"] for t in checked]),
                          parallel is not False)
    if request.choice not in ("required", "function"):
        return request, []
    return request, [Source("tool_choice", "json_schema", _forced_schema(request,
                                                                          arguments_key))]


def _tools(tools) -> tuple:
    if not isinstance(tools, list):
        raise bad("tools", f"tools must be a list of {{type: function, function: {{name, "
                           f"description, parameters}}}} objects, got {short(tools)}")
    out, seen = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad(where, f"{where} must be {{type: function, function: {{...}}}}, got "
                             f"{short(tool)}")
        if tool.get("type") != "function":
            raise bad(f"{where}.type", f"{where}.type must be 'function' (the only kind of "
                                       f"tool this server calls), got {short(tool.get('type'))}")
        if set(tool) - {"type", "function"}:
            key = sorted(set(tool) - {"type", "function"})[0]
            raise bad(f"{where}.{key}", f"{where} has an unknown field {key!r} (accepted: "
                                        "type, function)")
        fn = tool.get("function")
        if not isinstance(fn, dict) or set(fn) - FUNCTION_KEYS:
            what = sorted(set(fn) - FUNCTION_KEYS)[0] if isinstance(fn, dict) else None
            raise bad(f"{where}.function" + (f".{what}" if what else ""),
                      f"{where}.function must be an object of {', '.join(sorted(FUNCTION_KEYS))}"
                      f", got {short(fn)}")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise bad(f"{where}.function.name", f"{where}.function.name must be 1 to 64 "
                                                f"letters, digits, _ or -, got {short(name)}")
        if name in seen:
            raise bad(f"{where}.function.name", f"{where}.function.name {name!r} is given "
                                                "twice: function names must be unique")
        seen.add(name)
        for key, kind, what in (("description", str, "a string"),
                                ("strict", bool, "true or false")):
            if fn.get(key) is not None and not isinstance(fn[key], kind):
                raise bad(f"{where}.function.{key}", f"{where}.function.{key} must be {what}, "
                                                     f"got {short(fn[key])}")
        params = fn.get("parameters")
        if params is not None and params != {} and (not isinstance(params, dict)
                                                     or params.get("type") != "object"):
            raise bad(f"{where}.function.parameters", f"{where}.function.parameters must be a "
                      f"JSON schema of type object (or left out: no arguments), got "
                      f"{short(params)}")
        function = {k: v for k, v in fn.items() if v is not None}
        function["parameters"] = params or dict(NO_PARAMETERS)
        out.append({"type": "function", "function": function})
    return tuple(out)


def _choice(choice, names: list[str]) -> tuple[str, Optional[str]]:
    if choice is None:
        return "auto", None
    if choice in CHOICES:
        return choice, None
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or \
            set(choice) != {"type", "function"} or not isinstance(fn, dict) or \
            set(fn) != {"name"}:
        raise bad("tool_choice", f"tool_choice must be none, auto, required or {{type: "
                                 f"function, function: {{name}}}}, got {short(choice)}")
    if fn["name"] not in names:
        raise bad("tool_choice", f"tool_choice names function {short(fn['name'])}, which is "
                                 f"not among tools ({', '.join(names)})")
    return "function", fn["name"]


def _forced_schema(request: ToolRequest, key: str) -> dict:
    """The JSON schema of a forced call; each tool's parameters checked on their own
    first, so that what is wrong names the tool."""
    forced = [i for i, name in enumerate(request.names)
              if request.choice == "required" or name == request.function]
    for i in forced:
        checked_constraint([Source(f"tools[{i}].function.parameters", "json_schema",
                                   request.tools[i]["function"]["parameters"])])
    if request.choice == "function":
        return request.tools[forced[0]]["function"]["parameters"]
    root = "#/items/anyOf" if request.parallel else "#/anyOf"
    cases = []
    for n, i in enumerate(forced):
        fn = request.tools[i]["function"]
        params = _moved_refs(copy.deepcopy(fn["parameters"]), f"{root}/{n}/properties/{key}")
        cases.append({"type": "object", "properties": {"name": {"const": fn["name"]},
                                                       key: params},
                      "required": ["name", key], "additionalProperties": False})
    if not request.parallel:
        return {"anyOf": cases}
    return {"type": "array", "minItems": 1, "items": {"anyOf": cases}}


def _moved_refs(schema, prefix: str):
    """``schema`` placed at ``prefix`` of a larger one: its local ``$ref``s ("#/$defs/X")
    rewritten to point there."""
    if isinstance(schema, dict):
        for k, v in schema.items():
            if k == "$ref" and isinstance(v, str) and v.startswith("#"):
                schema[k] = prefix + v[1:]
            else:
                _moved_refs(v, prefix)
    elif isinstance(schema, list):
        for v in schema:
            _moved_refs(v, prefix)
    return schema
