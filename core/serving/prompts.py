"""A parsed request's prompts as token ids (``PromptEncoder.encode``), for a pool thread:
tokenising a long prompt, or rendering a chat template over long messages, takes seconds
that the event loop spends serving /health and the streams meanwhile (the tokenizers
library lets go of the interpreter lock while it encodes).

A prompt that cannot fit the context is refused before it is tokenised where its length
in bytes already proves it too long (``token_bound``); the exact count decides the rest
(``app.py``). Needs nothing beyond the core."""
from __future__ import annotations

import json
from typing import Optional

import attrs

from .protocol import OpenAIError, ParsedRequest, bad
from .tool_calls import FAMILIES, render

# pre-tokenizers that split a text without dropping any of it ("removed" drops the match)
_SPLITTERS = {"Split", "Digits", "Punctuation"}
# bytes that UTF-8 text never holds: a byte-level vocabulary may lack them
_NOT_UTF8 = {0xC0, 0xC1, *range(0xF5, 0x100)}


@attrs.frozen
class TokenBound:
    """A lower bound of a text's tokens from its bytes, where ``token_bound`` finds one."""

    max_token_bytes: int  # the most bytes of text one token stands for
    dropped: bytes  # the bytes its vocabulary lacks: the tokenizer drops them

    def counted_bytes(self, text: str) -> int:
        """The bytes of ``text`` in UTF-8 that tokens stand for."""
        data = text.encode("utf-8", "surrogatepass")
        return len(data) - sum(data.count(b) for b in self.dropped)

    def at_least(self, text: str) -> int:
        return -(-self.counted_bytes(text) // self.max_token_bytes)


class PromptEncoder:
    def __init__(self, engine, tool_family=FAMILIES["hermes"]):
        """``engine``: an Engine, or what EngineProcess has of one (tokenizer, plan, encode);
        ``tool_family``: how tools are shown to a chat template that knows none."""
        self.engine, self.tool_family = engine, tool_family
        self.bound = token_bound(engine.tokenizer)

    def encode(self, req: ParsedRequest) -> list[list[int]]:
        """Each prompt's token ids; OpenAIError 400 for messages the chat template refuses
        or a prompt proven too long; the engine's InvalidRequestError for a bad prompt."""
        if req.kind == "completion":
            return [self._ids(p, "prompt") for p in req.prompts]
        tools = None if req.tools is None else req.tools.shown()
        return [self._ids(self._chat_text(req.prompts[0], tools), "messages")]

    def _chat_text(self, messages: list[dict], tools=None) -> str:
        tok = self.engine.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise bad("messages", "this model has no chat template: use /v1/completions")
        try:
            return render(tok, messages, tools, self.tool_family)
        except Exception as e:  # jinja's TemplateError: roles out of order, say
            raise bad("messages", f"the chat template refused these messages: {e}") from e

    def _ids(self, prompt, what: str) -> list[int]:
        if isinstance(prompt, str):
            self._refuse_if_surely_too_long(prompt, what)
        return self.engine.encode(prompt)

    def _refuse_if_surely_too_long(self, text: str, what: str) -> None:
        if self.bound is None:
            return
        limit = self.engine.plan.max_seq_len
        at_least = self.bound.at_least(text)
        if at_least >= limit:  # the prompt and one new token must fit
            raise too_long(what, f"at least {at_least} tokens (its "
                                 f"{self.bound.counted_bytes(text)} bytes of text, a token of "
                                 f"this tokenizer standing for {self.bound.max_token_bytes} at "
                                 "most)", limit)


def too_long(what: str, length: str, limit: int) -> OpenAIError:
    """The 400 of a prompt ``length`` long ("N tokens") where ``max_seq_len=limit``."""
    verb = "takes" if what == "prompt" else "take"
    return bad(what, f"the {what} {verb} {length}; the context holds max_seq_len={limit} "
                     "tokens, the prompt and at least one new one: shorten it",
               code="context_length_exceeded")


def token_bound(tokenizer) -> Optional[TokenBound]:
    """The bound of a prompt's tokens from its bytes that ``tokenizer`` allows, or None.

    Characters alone bound nothing: one token may stand for a whole word (WordPiece's
    [UNK]), a run of spaces (an added token with lstrip), or nothing at all (text a
    normaliser deletes, a byte the vocabulary lacks). The bound holds for byte-level BPE
    (GPT-2, Llama 3, SmolLM2) with no normaliser, splitting pre-tokenizers that drop
    nothing and no added token that swallows its neighbours: there every byte of the
    prompt that the vocabulary has lies in exactly one token (the others are dropped, so
    not counted: SmolLM2 lacks six control characters and two lead bytes), and a token
    stands for at most as many bytes as the longest entry of its vocabulary (added tokens
    included, matched as written), so N counted bytes take at least ceil(N / that)
    tokens; special tokens the template adds only add to them."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    desc = json.loads(backend.to_str())
    model = desc.get("model") or {}
    if desc.get("normalizer") is not None or model.get("type") != "BPE" or \
            not _byte_level(desc.get("pre_tokenizer")):
        return None
    vocab = model.get("vocab") or {}
    added = desc.get("added_tokens") or []
    if any(t.get("lstrip") or t.get("rstrip") for t in added):
        return None  # they swallow the spaces beside them
    alphabet = byte_chars()
    missing = bytes(b for b in sorted(alphabet) if alphabet[b] not in vocab and b not in _NOT_UTF8)
    chars = set(alphabet.values())
    longest = max(len(t) if chars.issuperset(t) else len(t.encode()) for t in vocab)
    return TokenBound(max([longest] + [len(t["content"].encode()) for t in added]), missing)


def byte_chars() -> dict[int, str]:
    """The character byte-level BPE writes each byte as (GPT-2's ``bytes_to_unicode``):
    printable Latin-1 as itself, the others from U+0100 on, in order."""
    kept = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    moved = [b for b in range(256) if b not in kept]
    return {**{b: chr(b) for b in kept}, **{b: chr(0x100 + i) for i, b in enumerate(moved)}}


def _byte_level(pre: Optional[dict]) -> bool:
    """``pre`` is ByteLevel, or a sequence of it and splitters that keep every byte."""
    members = (pre or {}).get("pretokenizers", [pre]) if pre else []
    return any(m.get("type") == "ByteLevel" for m in members) and all(
        m.get("type") == "ByteLevel" or (m.get("type") in _SPLITTERS
                                         and m.get("behavior") != "Removed")
        for m in members)
