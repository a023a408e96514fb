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
"""
from __future__ import annotations

import torch

EVAL_TOPICS = ("assignment", "class")  # tests/demo_support.TEXT: never calibrated on
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


def calibration_ids(tokenizer, tokens: int, seq_len: int = 256, seed: int = 0,
                    vocab_size: int | None = None) -> torch.Tensor:
    """int64 [tokens // seq_len, seq_len]: windows of the calibration stream drawn with
    ``seed``. A ValueError where the text holds fewer tokens than asked for, or a token id
    beyond ``vocab_size`` (a tokenizer that is not the model's)."""
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
    if vocab_size is not None and int(stream.max()) >= vocab_size:
        raise ValueError(f"the tokenizer gives token id {int(stream.max())}, beyond the model's "
                         f"vocab_size {vocab_size}: it is not this model's tokenizer")
    g = torch.Generator().manual_seed(seed)
    return windows[torch.randperm(len(windows), generator=g)[:wanted]]
