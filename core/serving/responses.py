"""OpenAI's response shapes out: whole bodies (``text_completion``, ``chat.completion``),
streamed chunks (``*.chunk``, sent as server-sent events ``data: {json}`` ending with
``data: [DONE]``), usage (``prompt_tokens_details.cached_tokens``: prompt tokens served
from the prefix cache) and the two logprobs layouts (completions': parallel lists; chat's:
one entry per token with its top alternatives). ``token_text(id)`` is a token's
text as the tokenizer decodes it alone (what OpenAI lists as ``token``)."""
from __future__ import annotations

import json
import time
import uuid
from typing import Callable, Optional

import attrs

DONE = "data: [DONE]\n\n"
LOGPROB_FLOOR = -9999.0  # OpenAI's stand-in for -inf (JSON has no infinities)


def request_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def now() -> int:
    return int(time.time())


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


@attrs.define
class Choice:
    """One choice's output so far, gathered from RequestOutputs."""
    index: int
    text: str = ""
    token_ids: list = attrs.field(factory=list)
    logprobs: Optional[list] = None  # TokenLogprob each, when asked for
    finish_reason: Optional[str] = None
    completion_tokens: int = 0
    error: Optional[str] = None
    num_cached_tokens: int = 0  # of its prompt, from the prefix cache

    def add(self, out) -> None:
        self.text += out.text
        self.token_ids += out.token_ids
        if out.logprobs is not None:
            self.logprobs = (self.logprobs or []) + list(out.logprobs)
        self.completion_tokens = out.completion_tokens
        self.num_cached_tokens = out.num_cached_tokens
        if out.finished:
            self.finish_reason = out.finish_reason
            self.error = getattr(out, "error", None)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage; ``cached_tokens``: the prompt tokens served from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def request_usage(prompt_tokens: int, choices: list[Choice], n: int) -> dict:
    """The usage of a request whose ``choices`` are ``n`` per prompt, prompt by prompt.
    Each prompt counts once, as in OpenAI's usage, and so do its cached tokens: its first
    choice's. That one is queued first and admitted first (the waiting queue is FIFO), so
    it sees the cache as the request found it; a later choice may also hit the blocks its
    sibling just computed, which the request itself paid for (the max would count them)."""
    return usage(prompt_tokens, sum(c.completion_tokens for c in choices),
                 sum(c.num_cached_tokens for c in choices[::n]))


def _lp(x: float) -> float:
    return max(float(x), LOGPROB_FLOOR)


def completion_logprobs(entries, token_text: Callable[[int], str], offset: int = 0) -> dict:
    """Completions' layout; ``offset``: where in the choice's text these tokens start."""
    tokens = [token_text(e.token_id) for e in entries]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [_lp(e.logprob) for e in entries],
            "top_logprobs": [{token_text(i): _lp(lp) for i, lp in e.top} for e in entries],
            "text_offset": offsets}


def chat_logprobs(entries, token_text: Callable[[int], str]) -> dict:
    def item(token_id, logprob):
        text = token_text(token_id)
        return {"token": text, "logprob": _lp(logprob), "bytes": list(text.encode())}

    return {"content": [dict(item(e.token_id, e.logprob),
                             top_logprobs=[item(i, lp) for i, lp in e.top]) for e in entries],
            "refusal": None}


def _head(kind: str, rid: str, created: int, model: str, chunk: bool) -> dict:
    obj = ("chat.completion" if kind == "chat" else "text_completion") + (
        ".chunk" if chunk and kind == "chat" else "")
    return {"id": rid, "object": obj, "created": created, "model": model}


def body(kind: str, rid: str, created: int, model: str, choices: list[Choice],
         use: dict, token_text: Callable[[int], str], shape=None) -> dict:
    """The whole (non-streamed) response; ``shape()``: a chat choice's tool-call shaper
    (``tool_calls/shaping.py``), or None: its text is the content."""
    out = []
    for c in choices:
        if kind == "chat":
            lp = None if c.logprobs is None else chat_logprobs(c.logprobs, token_text)
            message, finish = {"role": "assistant", "content": c.text}, c.finish_reason
            shaper = shape() if shape is not None else None
            if shaper is not None:
                shaper.feed(c.text, c.token_ids)
                shaper.finish()
                message, finish = shaper.message(), shaper.finish_reason(finish)
            out.append({"index": c.index, "message": message, "logprobs": lp,
                        "finish_reason": finish})
        else:
            lp = None if c.logprobs is None else completion_logprobs(c.logprobs, token_text)
            out.append({"index": c.index, "text": c.text, "logprobs": lp,
                        "finish_reason": c.finish_reason})
    return dict(_head(kind, rid, created, model, False), choices=out, usage=use)


class ChunkWriter:
    """The server-sent events of one streamed response, choice by choice as outputs come."""

    def __init__(self, kind: str, rid: str, model: str, n: int, include_usage: bool,
                 token_text: Callable[[int], str], token_ids: bool = False, shape=None):
        """``token_ids``: each completions chunk carries its tokens' ids (vLLM's
        ``token_ids`` field), and a chunk goes out for every new token even without text:
        what a model without a tokenizer streams. ``shape()``: a chat choice's tool-call
        shaper: its deltas (content, tool_calls) are streamed instead of the text."""
        self.kind, self.include_usage, self.token_text = kind, include_usage, token_text
        self.token_ids = token_ids
        self.shapers = [shape() for _ in range(n)] if shape is not None else None
        self.head = _head(kind, rid, now(), model, True)
        self.offsets = [0] * n  # completions' text_offset, per choice
        self.started = [False] * n  # chat: the role goes in a choice's first chunk

    def _chunk(self, choice: dict) -> str:
        obj = dict(self.head, choices=[choice])
        if self.include_usage:
            obj["usage"] = None
        return sse(obj)

    def output(self, index: int, out) -> str:
        """The events for one RequestOutput of choice ``index`` ('' when it says nothing)."""
        events = ""
        finish = out.finish_reason if out.finished else None
        entries = out.logprobs
        if self.kind == "chat":
            if not self.started[index]:
                self.started[index] = True
                events += self._chunk({"index": index, "logprobs": None, "finish_reason": None,
                                       "delta": {"role": "assistant", "content": ""}})
            if self.shapers is not None:
                return events + self._shaped(index, out, finish)
            if out.text or entries:
                lp = None if entries is None else chat_logprobs(entries, self.token_text)
                events += self._chunk({"index": index, "delta": {"content": out.text},
                                       "logprobs": lp, "finish_reason": None})
            if finish:
                events += self._chunk({"index": index, "delta": {}, "logprobs": None,
                                       "finish_reason": finish})
            return events
        if out.text or entries or finish or (self.token_ids and out.token_ids):
            lp = None
            if entries is not None:
                lp = completion_logprobs(entries, self.token_text, self.offsets[index])
                self.offsets[index] += sum(len(t) for t in lp["tokens"])
            choice = {"index": index, "text": out.text, "logprobs": lp, "finish_reason": finish}
            if self.token_ids:
                choice["token_ids"] = list(out.token_ids)
            events += self._chunk(choice)
        return events

    def _shaped(self, index: int, out, finish: Optional[str]) -> str:
        shaper, entries = self.shapers[index], out.logprobs
        deltas = shaper.feed(out.text, out.token_ids)
        if finish:
            deltas += shaper.finish()
        lp = None if entries is None else chat_logprobs(entries, self.token_text)
        if lp is not None and not deltas:  # (the text is held: its logprobs are not)
            deltas = [{}]
        events = "".join(self._chunk({"index": index, "delta": d, "finish_reason": None,
                                      "logprobs": lp if k == 0 else None})
                         for k, d in enumerate(deltas))
        if finish:
            events += self._chunk({"index": index, "delta": {}, "logprobs": None,
                                   "finish_reason": shaper.finish_reason(finish)})
        return events

    def usage(self, use: dict) -> str:
        """The last chunk when include_usage: no choices, the usage of the whole request."""
        return sse(dict(self.head, choices=[], usage=use)) if self.include_usage else ""


def error_event(message: str, type: str = "server_error", code: Optional[str] = None) -> str:
    """A failure after the stream began (its status is already 200): OpenAI's error body
    as an event; the openai client raises it as an APIError."""
    return sse({"error": {"message": message, "type": type, "param": None, "code": code}})
