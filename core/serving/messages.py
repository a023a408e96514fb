"""A chat request's ``messages``, checked one by one and put in the form chat templates
read: ``{role, content}`` (developer becomes system), an assistant's ``tool_calls`` with
their ``arguments`` as an object (Hugging Face's templates write them with ``tojson``;
OpenAI sends a JSON string), a tool result's ``tool_call_id``. A tool result must answer
a call an earlier assistant message made, as OpenAI requires. Needs nothing beyond the
core."""
from __future__ import annotations

import json

from .openai_errors import bad, short

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
         "tool": "tool"}
FIELDS = {"system": {"name"}, "user": {"name"}, "assistant": {"name", "tool_calls", "refusal"},
          "tool": {"tool_call_id", "name"}}


def parse_messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise bad("messages", f"messages must be a non-empty list of {{role, content}} "
                              f"objects, got {short(messages)}")
    out, calls_made = [], set()
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(where, f"{where} must be an object with role and content, got {short(m)}")
        if m.get("role") not in ROLES:
            raise bad(f"{where}.role", f"{where}.role must be one of "
                                       f"{', '.join(ROLES)}, got {short(m.get('role'))}")
        role = ROLES[m["role"]]
        allowed = {"role", "content"} | FIELDS[role]
        extra = set(m) - allowed
        if extra:
            raise bad(f"{where}.{sorted(extra)[0]}", f"{where} ({m['role']}) has fields this "
                      f"server does not take: {', '.join(sorted(extra))} (accepted: "
                      f"{', '.join(sorted(allowed))})")
        message = {"role": role}  # (a name is checked, not rendered: templates ignore it)
        if m.get("name") is not None and not isinstance(m["name"], str):
            raise bad(f"{where}.name", f"{where}.name must be a string, got {short(m['name'])}")
        calls = m.get("tool_calls") or []
        if role == "assistant" and m.get("refusal") is not None:
            raise bad(f"{where}.refusal", f"{where}.refusal must be null (this server never "
                                          "refuses), got " + short(m["refusal"]))
        if role == "assistant" and calls:
            message["tool_calls"] = _tool_calls(calls, f"{where}.tool_calls")
            calls_made.update(c["id"] for c in message["tool_calls"])
            message["content"] = "" if m.get("content") is None else \
                _content(m["content"], where)
        else:
            message["content"] = _content(m.get("content"), where)
        if role == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str) or call_id not in calls_made:
                raise bad(f"{where}.tool_call_id", f"{where}.tool_call_id must be the id of a "
                          f"call an earlier assistant message made (its tool_calls[].id: "
                          f"{', '.join(sorted(calls_made)) or 'none made'}), got "
                          f"{short(call_id)}")
            message["tool_call_id"] = call_id
        out.append(message)
    if all(not m["content"].strip() and not m.get("tool_calls") for m in out):
        raise bad("messages", "messages are empty: give at least one non-blank content")
    return out


def _tool_calls(calls, where: str) -> list[dict]:
    if not isinstance(calls, list):
        raise bad(where, f"{where} must be a list of {{id, type: function, function: {{name, "
                         f"arguments}}}} objects, got {short(calls)}")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(call, dict) or set(call) - {"id", "type", "function"} or \
                call.get("type", "function") != "function" or not isinstance(fn, dict):
            raise bad(at, f"{at} must be {{id, type: function, function: {{name, arguments}}}}, "
                          f"got {short(call)}")
        if not isinstance(call.get("id"), str) or not call["id"]:
            raise bad(f"{at}.id", f"{at}.id must be a non-empty string (what the tool "
                                  f"result's tool_call_id names), got {short(call.get('id'))}")
        if set(fn) - {"name", "arguments"} or not isinstance(fn.get("name"), str) \
                or not fn["name"]:
            raise bad(f"{at}.function", f"{at}.function must be {{name, arguments}} with a "
                                        f"non-empty name, got {short(fn)}")
        out.append({"id": call["id"], "type": "function",
                    "function": {"name": fn["name"],
                                 "arguments": _arguments(fn.get("arguments"),
                                                         f"{at}.function.arguments")}})
    return out


def _arguments(text, where: str) -> dict:
    """A call's arguments, sent as JSON text, as the object templates write."""
    try:
        value = json.loads(text) if isinstance(text, str) else None
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise bad(where, f"{where} must be a JSON object as text (what the call's "
                         f"function.arguments held), got {short(text)}")
    return value


def _content(content, where: str) -> str:
    """A string, or a list of text parts (``{"type": "text", "text": ...}``) joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise bad(f"{where}.content", f"{where}.content must be a string or a list of "
                                  f"{{type: text, text}} parts (text only), got {short(content)}")
