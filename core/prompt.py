"""A request's prompt as the engine takes it: one prompt or a batch of them, text or token
ids, encoded and checked against the vocabulary, ``max_seq_len`` and what the engine has
(a tokenizer for text and stop strings) before anything is queued."""
from __future__ import annotations

import torch

from .errors import InvalidRequestError


def as_batch(prompts) -> list:
    """One prompt (a string or a list of token ids) or a non-empty list of them -> a list."""
    if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                    and all(isinstance(t, int) for t in prompts)):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts:
        return list(prompts)
    raise InvalidRequestError("prompts must be a string, a list of token ids, or a "
                              "non-empty list of those")


def encode_prompt(prompt, tokenizer, vocab_size: int) -> list[int]:
    """A prompt (a string, a list of token ids, or a 1-d integer tensor) as token ids;
    InvalidRequestError for anything else, an empty prompt, or ids outside the vocabulary."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InvalidRequestError("this engine has no tokenizer: pass prompts as lists "
                                      "of token ids, or build with tokenizer=...")
        ids = tokenizer.encode(prompt, add_special_tokens=True)
    elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
        ids = list(prompt)
    elif isinstance(prompt, torch.Tensor) and prompt.dim() == 1 and not prompt.is_floating_point():
        ids = prompt.tolist()
    else:
        raise InvalidRequestError(f"a prompt is a string or a list of token ids, got "
                                  f"{type(prompt).__name__}")
    if not ids or (isinstance(prompt, str) and not prompt.strip()):
        raise InvalidRequestError("prompt is empty: give at least one token")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"token ids {bad[:5]} are outside the vocabulary "
                                  f"[0, {vocab_size})")
    return ids


def check_request(ids: list[int], params: SamplingParams, max_seq_len: int, spec,
                  tokenizer) -> None:
    """InvalidRequestError if prompt + max_new_tokens exceed ``max_seq_len``, or stop
    strings come without a tokenizer to match them."""
    if len(ids) + params.max_new_tokens > max_seq_len:
        if spec.position == "learned" and max_seq_len >= spec.max_position:
            advice = (f"the model has {spec.max_position} learned positions, so "
                      "shorten the prompt or lower max_new_tokens")
        else:
            advice = "shorten the prompt, lower max_new_tokens, or build with a larger max_seq_len"
        raise InvalidRequestError(
            f"prompt of {len(ids)} tokens + max_new_tokens={params.max_new_tokens} = "
            f"{len(ids) + params.max_new_tokens} exceeds max_seq_len={max_seq_len}; {advice}")
    if params.stop and tokenizer is None:
        raise InvalidRequestError("stop strings need a tokenizer; this engine has none")
    if params.constraint is not None and tokenizer is None:
        raise InvalidRequestError("structured output (json_schema, json_object, regex, grammar, "
                                  "choice) needs a tokenizer; this engine has none")
