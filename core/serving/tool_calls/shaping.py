"""A choice's text as OpenAI's assistant message: content and ``tool_calls``.

A shaper is fed the text as it comes (``feed``, then ``finish``) and returns the chat
deltas to stream (``{"content": ...}`` or ``{"tool_calls": [...]}``); a whole response
is the same run over the whole text, so a stream's deltas add up to the non-streamed
message by construction.

* ``AutoShaper`` (``tool_choice: auto``): the text through a template family's parser.
  Content streams as it comes, less a tail that may begin a marker and the separators
  (whitespace; LLaMA 3's ``;`` too) that may precede a call, which are dropped if one
  does; after a call its separators are kept only between content and more content. A
  block of calls is held until it is whole and then sent as calls if each names one of
  the request's functions with object arguments, else as the text it was (malformed
  JSON is content, never an error); ``parallel_tool_calls: false`` takes the first.
* ``ForcedShaper`` (``required`` or a named function): the output is JSON the grammar
  forces (``request.py``): the named function's arguments, or ``{"name", ARGS_KEY}``
  objects (one, or an array of them), so each call's id and name are sent as soon as the
  name is read and its arguments stream as they are written. A text cut short (``length``)
  keeps the calls begun; one where no name was read yet is content. Finish reasons as
  OpenAI's: "tool_calls" where calls were made (``auto``, ``required``), but "stop" for a
  named function.
"""
from __future__ import annotations

import json
from typing import Optional

from .scanning import Call, JsonScanner, Malformed


def _call_delta(index: int, call: Call, arguments: Optional[str] = None) -> dict:
    """The first delta of a call (id, type, name) or, with ``arguments``, a later one."""
    if arguments is not None:
        return {"tool_calls": [{"index": index, "function": {"arguments": arguments}}]}
    return {"tool_calls": [{"index": index, "id": call.id, "type": "function",
                            "function": {"name": call.name, "arguments": call.arguments}}]}


class Shaper:
    def __init__(self):
        self.text = ""
        self.content = ""
        self.calls: list[Call] = []

    def message(self) -> dict:
        """The whole assistant message (after ``finish``)."""
        calls = [{"id": c.id, "type": "function",
                  "function": {"name": c.name, "arguments": c.arguments}} for c in self.calls]
        content = self.content if self.content or not calls else None
        return {"role": "assistant", "content": content, **({"tool_calls": calls} if calls
                                                            else {})}

    def finish_reason(self, reason: Optional[str]) -> Optional[str]:
        return "tool_calls" if reason == "stop" and self.calls else reason

    def _say(self, out: list, text: str) -> None:
        if text:
            self.content += text
            out.append({"content": text})


class AutoShaper(Shaper):
    def __init__(self, family, names, max_calls: Optional[int] = None,
                 marker_id: Optional[int] = None, decode=None):
        """``names``: the request's functions; ``max_calls``: 1 when parallel_tool_calls
        is false; ``marker_id``: the token id of the family's special marker, which
        ``decode`` (ids -> text) drops: put back into the text where it came."""
        super().__init__()
        self.family, self.names, self.max_calls = family, frozenset(names), max_calls
        self.marker_id, self.decode = marker_id, decode
        self.pos = 0  # the text before it is judged: sent as content, or calls
        self.reader = None  # the block being read
        self.after_call = False  # a call was the last thing judged

    def feed(self, text: str, token_ids=()) -> list[dict]:
        self.text += self._with_marker(text, list(token_ids))
        return self._advance(final=False)

    def finish(self) -> list[dict]:
        return self._advance(final=True)

    def _with_marker(self, text: str, ids: list) -> str:
        if self.marker_id is None or self.marker_id not in ids:
            return text
        k = ids.index(self.marker_id)
        at = 0 if k == 0 else min(len(self.decode(ids[:k])), len(text))
        return text[:at] + self.family.special + self._with_marker(text[at:], ids[k + 1:])

    def _held(self, end: int) -> int:
        """Where the separators just before ``end`` begin (not before ``pos``)."""
        seps = self.family.separators
        while end > self.pos and self.text[end - 1] in seps:
            end -= 1
        return end

    def _advance(self, final: bool) -> list[dict]:
        out: list[dict] = []
        text, family = self.text, self.family
        while True:
            if self.reader is None:
                start = family.find(text, self.pos)
                if start is None:
                    end = len(text) if final else self._held(family.hold_from(text, self.pos))
                    self._content(out, text[self.pos:end])
                    self.pos = end
                    break
                before = self._held(start)  # (the separators wait for the block's verdict)
                self._content(out, text[self.pos:before])
                self.pos = before
                self.reader = family.open(text, start, self.names)
            block = self.reader.advance(text, final)
            if block is None:
                break
            self.reader = None
            room = self.max_calls is None or len(self.calls) + len(block.calls or ()) \
                <= self.max_calls
            if block.calls and room:
                for name, arguments in block.calls:
                    call = Call(family.new_id(), name, json.dumps(arguments, ensure_ascii=False))
                    out.append(_call_delta(len(self.calls), call))
                    self.calls.append(call)
                self.after_call = True
            else:
                self._content(out, text[self.pos:block.end])
            self.pos = block.end
        return out

    def _content(self, out: list, text: str) -> None:
        """Say ``text``; after a call, its separators only between content and content."""
        if self.after_call and text:
            seps = self.family.separators
            if not text.strip(seps):  # (at the end: nothing follows them)
                return
            self.after_call = False
            if not self.content:
                text = text.lstrip(seps)
        self._say(out, text)


class ForcedShaper(Shaper):
    def __init__(self, new_id, function: Optional[str] = None, key: str = "arguments"):
        """``function``: the named function (the text is its arguments); None: the text
        is ``{"name", key}`` objects, one or an array of them."""
        super().__init__()
        self.new_id, self.function, self.key = new_id, function, key
        self.pos, self.state, self.array = 0, "begin", False
        self.field = None  # the key whose value comes next
        self.call: Optional[int] = None  # the current object's call, once its name is read
        self.args: Optional[JsonScanner] = None  # its arguments' scanner, once they begin
        self.sent = 0  # its arguments' characters sent

    def finish_reason(self, reason: Optional[str]) -> Optional[str]:
        """As OpenAI's: a named function's call ends "stop" (the caller chose the call),
        ``required``'s ends "tool_calls"."""
        return reason if self.function is not None else super().finish_reason(reason)

    def feed(self, text: str, token_ids=()) -> list[dict]:
        self.text += text
        out: list[dict] = []
        if self.function is not None:
            if not self.calls:
                self._begin(out, self.function)
            self._extend(out, 0, text)
            return out
        self._read(out)
        return out

    def finish(self) -> list[dict]:
        out: list[dict] = []
        if not self.calls:  # cut short before a name: the text is all there is
            self._say(out, self.text)
        return out

    def _begin(self, out: list, name: str) -> None:
        call = Call(self.new_id(), name, "")
        out.append(_call_delta(len(self.calls), call))
        self.calls.append(call)

    def _extend(self, out: list, index: int, new: str) -> None:
        if new:
            call = self.calls[index]
            self.calls[index] = Call(call.id, call.name, call.arguments + new)
            out.append(_call_delta(index, call, new))

    def _send_arguments(self, out: list, end: int) -> None:
        """The current call's arguments written up to ``end`` and not sent yet."""
        if self.call is not None and self.args is not None:
            begin = self.args.begin if self.args.begin is not None else self.args.pos
            new = self.text[begin + self.sent:end]
            self.sent += len(new)
            self._extend(out, self.call, new)

    def _read(self, out: list) -> None:
        """Reads on through the text, a JSON token at a time, as far as it is whole."""
        text = self.text
        while self.state not in ("done", "broken"):
            if self.state == "args":
                try:
                    end = self.args.advance(text)
                except Malformed:
                    self.state = "broken"
                    return
                self._send_arguments(out, len(text) if end is None else end)
                if end is None:
                    return
                self.pos, self.state = end, "key"
                continue
            while self.pos < len(text) and text[self.pos] in " \t\r\n":
                self.pos += 1
            if self.pos == len(text):
                return
            c, state = text[self.pos], self.state
            if state in ("begin", "object") and c == "{":
                self.call, self.args, self.sent = None, None, 0
                self.state = "key"
            elif state == "begin" and c == "[":
                self.array, self.state = True, "object"
            elif state == "next" and c in ",]":
                self.state = "object" if c == "," else "done"
            elif state == "key" and c in ",}":
                if c == "}":
                    self.state = "next" if self.array else "done"
            elif state in ("key", "name") and c == '"':
                end = _string_end(text, self.pos)
                if end is None:
                    return
                try:
                    value = json.loads(text[self.pos:end])
                except ValueError:  # (not what a grammar lets through)
                    self.state = "broken"
                    return
                self.pos = end
                if state == "key":
                    self.field, self.state = value, "colon"
                    continue
                self.state = "key"
                if self.call is None:
                    self.call = len(self.calls)
                    self._begin(out, value)
                    self._send_arguments(out, self.args.pos if self.args else 0)
                continue
            elif state == "colon" and c == ":":
                self.state = "name" if self.field == "name" else "value"
            elif state == "value" and self.field == self.key and self.args is None:
                self.args, self.state = JsonScanner(self.pos), "args"
                continue
            else:
                self.state = "broken"
                return
            self.pos += 1


def _string_end(text: str, start: int) -> Optional[int]:
    """The index past the JSON string that opens at ``start`` (None: not closed yet)."""
    i, n = start + 1, len(text)
    while i < n:
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == '"':
            return i + 1
        i += 1
    return None
