"""Calibration text for GPTQ: English that ships with Python, disjoint from the text the
quality tests measure perplexity on.

The source is ``pydoc_data.topics.topics`` (the help texts of the language reference that
``help("if")`` prints: about 450,000 characters in 77 topics on Python 3.11, about 110,000
tokens of SmolLM2's tokenizer), every topic except ``EVAL_TOPICS``, which
``tests/demo_support.py`` evaluates on. Topics go in sorted order, each tokenised alone
(no special tokens) and joined by the tokens of a blank line; the stream is cut into
windows of ``seq_len`` tokens, of which a seeded draw picks as many as the token count
asks. Other Python versions ship other revisions of these texts, so the windows (and the
quantised weights) differ a little between them.

Where the tokenizer has a chat template (an instruct model), the first half of the drawn
windows are read as the assistant's answer to a user turn asking ``PROMPT``: each starts
with the template's tokens up to the answer (system prompt and role markers included),
the window's text after them. An instruct model's inputs begin that way, and a
calibration without those tokens leaves their activations out of the Hessians. On the
demo model (whose float answer to the demo question starts on a near-tie: "The" 0.15,
"L" 0.14), GPTQ with act-order calibrated on plain windows lost "Paris" on two seeds of
three; with half the windows behind the chat prefix it kept it on four of four, the doc
text's perplexity ratio moving from 1.079-1.085 to 1.076-1.099.
"""
from __future__ import annotations

import torch

EVAL_TOPICS = ("assignment", "class")  # tests/demo_support.TEXT: never calibrated on
PROMPT = "Tell me about Python."  # the user turn of the chat-formatted windows
CHAT_FRACTION = 0.5
SOURCE = ("pydoc_data.topics (Python's language reference help texts), every topic but "
          + " and ".join(repr(t) for t in EVAL_TOPICS))


def calibration_texts() -> list[str]:
    """The topics calibrated on, in sorted order of their names."""
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics) if name not in EVAL_TOPICS]


def token_stream(tokenizer) -> list[int]:
    """Every calibration topic's tokens, joined by a blank line's."""
    sep = tokenizer.encode("\n\n", add_special_tokens=False)
    ids: list[int] = []
    for text in calibration_texts():
        ids += tokenizer.encode(text, add_special_tokens=False) + sep
    return ids


def chat_prefix(tokenizer) -> list[int]:
    """The tokens of the tokenizer's chat template around a user turn asking ``PROMPT``, up
    to where the assistant's answer starts; [] where it has no chat template."""
    if not getattr(tokenizer, "chat_template", None):
        return []
    text = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}],
                                         add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def calibration_ids(tokenizer, tokens: int, seq_len: int = 256, seed: int = 0,
                    vocab_size: int | None = None,
                    chat_fraction: float = CHAT_FRACTION) -> torch.Tensor:
    """int64 [tokens // seq_len, seq_len]: windows of the calibration stream drawn with
    ``seed``, the first ``chat_fraction`` of them behind the chat prefix where the
    tokenizer has a chat template. A ValueError where the text holds fewer tokens than
    asked for, or a token id beyond ``vocab_size`` (a tokenizer that is not the model's)."""
    if tokens < seq_len:
        raise ValueError(f"calibration_tokens={tokens} is less than one sequence of {seq_len}")
    stream = torch.tensor(token_stream(tokenizer), dtype=torch.int64)
    windows = stream[:len(stream) // seq_len * seq_len].reshape(-1, seq_len)
    wanted = tokens // seq_len
    if wanted > len(windows):
        raise ValueError(f"calibration_tokens={tokens}: the calibration text ({SOURCE}) holds "
                         f"{len(windows)} sequences of {seq_len} tokens "
                         f"({len(windows) * seq_len} tokens) for this tokenizer; ask for at "
                         f"most that many")
    prefix = torch.tensor(chat_prefix(tokenizer), dtype=torch.int64)
    top = max(int(stream.max()), int(prefix.max()) if len(prefix) else 0)
    if vocab_size is not None and top >= vocab_size:
        raise ValueError(f"the tokenizer gives token id {top}, beyond the model's vocab_size "
                         f"{vocab_size}: it is not this model's tokenizer")
    g = torch.Generator().manual_seed(seed)
    drawn = windows[torch.randperm(len(windows), generator=g)[:wanted]]  # [n, S], a copy
    if 0 < len(prefix) <= seq_len // 2:  # a longer template would crowd the text out
        for row in drawn[:round(chat_fraction * wanted)]:
            row[:] = torch.cat([prefix, row[:seq_len - len(prefix)]])
    return drawn
