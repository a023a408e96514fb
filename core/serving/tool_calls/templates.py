"""Chat templates and tools: which family's calls a template asks for (``detect``), and
the prompt of a conversation with tools (``render``).

A template that takes ``tools`` (Hugging Face's ``apply_chat_template(tools=...)``) lists
them itself and writes an assistant's ``tool_calls`` and the ``tool`` results its own way.
One that knows no tools (SmolLM2's, many older ones) gets them from the family instead: a
system message listing them and saying how to call one, the past calls written as the
model would have written them, and the results as ``tool`` messages."""
from __future__ import annotations

import functools
from typing import Optional

from .hermes import Hermes
from .llama3 import Llama3Json
from .mistral import Mistral

FAMILIES = {f.name: f for f in (Llama3Json(), Hermes(), Mistral())}
# what in a template's source says which family's calls it asks for, in this order
SIGNS = (("[TOOL_CALLS]", "mistral"), ("<tool_call>", "hermes"),
         ("<|python_tag|>", "llama3_json"), ("ipython", "llama3_json"))
DEFAULT = "hermes"  # for a template that names none: the most common form, Qwen's


def template_of(tokenizer, with_tools: bool = True) -> str:
    """The template ``apply_chat_template`` would use ('' for none): a tokenizer's named
    templates hold a ``tool_use`` one for requests with tools (Hermes 2 Pro's)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = template.get("tool_use" if with_tools and "tool_use" in template
                                else "default", "")
    return template if isinstance(template, str) else ""


def detect(template: str) -> str:
    """The family whose calls ``template`` asks for (DEFAULT when it says nothing)."""
    for sign, family in SIGNS:
        if sign in template:
            return family
    return DEFAULT


@functools.lru_cache(maxsize=16)
def takes_tools(template: str) -> bool:
    """Whether ``template`` reads a ``tools`` variable (Jinja's own parse says)."""
    try:
        from jinja2 import Environment, meta

        return "tools" in meta.find_undeclared_variables(Environment().parse(template))
    except Exception:  # (not Jinja that plain jinja2 parses: transformers' extensions)
        return "tools" in template


def render(tokenizer, messages: list[dict], tools: Optional[list[dict]], family) -> str:
    """The prompt of ``messages`` (checked by ``messages.py``) with ``tools`` listed."""
    template = template_of(tokenizer, with_tools=tools is not None)
    if not takes_tools(template):
        messages = _without_tool_syntax(messages, tools, family,
                                        calls_known="tool_calls" in template)
        tools = None
    return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                         tokenize=False)


def _without_tool_syntax(messages: list[dict], tools, family, calls_known: bool) -> list:
    """The conversation for a template that takes no tools: them listed in the system
    message (joined to the first one, or a new one), past calls as text (unless the
    template writes ``tool_calls`` itself)."""
    out = []
    for m in messages:
        if m.get("tool_calls") and not calls_known:
            calls = [c["function"] for c in m["tool_calls"]]
            text = "\n".join(t for t in (m["content"], family.render(calls)) if t)
            m = {"role": "assistant", "content": text}
        out.append(m)
    if tools:
        listed = family.describe(tools)
        if out[0]["role"] == "system":
            out[0] = dict(out[0], content=f"{out[0]['content']}\n\n{listed}".lstrip())
        else:
            out.insert(0, {"role": "system", "content": listed})
    return out


def special_marker_id(tokenizer, family) -> Optional[int]:
    """The token id of ``family``'s marker where ``tokenizer`` holds it as one special
    token, which decoding drops (None otherwise)."""
    marker = family.special
    if marker is None or tokenizer is None:
        return None
    try:
        ids = tokenizer.encode(marker, add_special_tokens=False)
        dropped = len(ids) == 1 and tokenizer.decode(ids, skip_special_tokens=True) == ""
    except Exception:  # (a tokenizer that cannot say)
        return None
    return ids[0] if dropped else None
