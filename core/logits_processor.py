"""Logits-processor contract: registered through ``infergraft_register_logits_processors``.

A logits processor constrains which tokens a request may take next: a JSON schema, a
regex, a grammar (the built-in ``grammar`` processor, ``core/structured/``), or anything
a plugin defines ("never these token ids"). A request names the processors it wants in
``SamplingParams(logits_processors={name: argument})``; the engine calls
``processor.start(argument, vocab)`` when the request is added (a bad argument is an
``InvalidRequestError`` before anything is queued) and keeps the ``ConstraintState`` it
returns on the request.

Each step the sampler asks every constrained row's states for a token bitmask, filled on
the host into one ``[R, words]`` int32 tensor (R: the constrained rows) while the device
runs the step, and masks all R rows of the logits in one kernel launch
(``kernels/token_bitmask.py``). Unconstrained rows are not touched: their tokens are the
ones they get alone, and a batch without constrained rows pays nothing. After sampling,
each state ``accept``s its row's token; a state that ``is_complete`` finishes its request
("stop"), and ``take_forced`` lets a request append the tokens its constraint forces
without a forward pass for each (jump-forward decoding).

The bitmask layout is xgrammar's and llguidance's: bit ``t % 32`` of word ``t // 32`` of
a row is set when token ``t`` is allowed.
"""
from __future__ import annotations

from typing import Any

import attrs
import torch

from .errors import InvalidRequestError

#: tokens per bitmask word (int32)
TOKENS_PER_WORD = 32


def bitmask_words(vocab_size: int) -> int:
    """int32 words of one bitmask row covering ``vocab_size`` tokens."""
    return -(-vocab_size // TOKENS_PER_WORD)


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """allowed: [V] bool -> its bitmask row [bitmask_words(V)] int32 (a helper for
    processors that decide token by token)."""
    padded = torch.zeros(bitmask_words(allowed.shape[0]) * TOKENS_PER_WORD, dtype=torch.int64)
    padded[:allowed.shape[0]] = allowed.to(torch.int64)
    words = (padded.view(-1, TOKENS_PER_WORD) << torch.arange(TOKENS_PER_WORD)).sum(-1)
    return words.to(torch.int32)  # [0, 2**32) wraps to int32's two's complement


def named_processors(named) -> tuple:
    """``SamplingParams.logits_processors`` as ((name, argument), ...): from a dict, pairs, or
    bare names (argument None)."""
    items = named.items() if isinstance(named, dict) else [named] if isinstance(named, str) \
        else named
    try:
        pairs = tuple((x, None) if isinstance(x, str) else tuple(x) for x in items or ())
    except TypeError:
        pairs = ((),)
    if any(len(p) != 2 or not isinstance(p[0], str) for p in pairs):
        raise InvalidRequestError(f"logits_processors must map registered processor names to "
                                  f"their arguments, e.g. {{'ban-tokens': [5, 7]}}, got {named!r}")
    return pairs


@attrs.frozen
class Vocabulary:
    """What a processor knows of the engine's tokens."""
    size: int  # the logits' width: token ids are 0 .. size - 1
    eos_token_ids: frozenset  # the engine's stop tokens (config and tokenizer)
    tokenizer: Any = None  # the engine's Hugging Face tokenizer (None: token ids only)
    # where the logits are: work a processor could do on a thread of its own (compiling)
    # only competes with the model for the host's cores where this is "cpu"
    device: str = "cpu"


class ConstraintState:
    """One request's progress under one processor (``LogitsProcessor.start`` makes it).

    Only ``fill_bitmask`` is required; the defaults never complete, force nothing and
    accept every token. Called from the thread stepping the engine, one request at a time.

    ``batch`` (optional): an object shared by states that can fill their masks together,
    with ``words`` (its bitmask's width: ids past it are never allowed) and
    ``fill(states, bitmask) -> {row: error}`` (row ``r`` of a contiguous host bitmask
    [len(states), words] for ``states[r]``, every word written). A step's rows whose one
    state has the same ``batch`` are filled by one call of it (the grammar processor's:
    ``core/structured/batch.py``); rows without one, row by row through ``fill_bitmask``.
    """

    batch = None

    def fill_bitmask(self, bitmask, row: int) -> None:
        """Write the tokens this request may take next into row ``row`` of ``bitmask``
        (int32 ``[R, bitmask_words(vocab.size)]`` on the host; bit ``t % 32`` of word
        ``t // 32`` set: token ``t`` allowed). The row holds all ones on entry. A row
        left with no token allowed ends the request with ``finish_reason="error"``."""
        raise NotImplementedError

    def accept(self, token: int) -> bool:
        """Advance past the token sampled for this request. False: the token was not
        allowed (the request then ends with ``finish_reason="error"``)."""
        return True

    def is_complete(self) -> bool:
        """Nothing but a stop token may follow: the request finishes with
        ``finish_reason="stop"`` now, without a step to sample that stop token."""
        return False

    def ready(self) -> bool:
        """Whether its first mask can be filled without waiting (a grammar still compiling
        on a background thread: not yet). Until it is, the request is prefilled but for
        its prompt's last token (whose logits take the first mask) and then sits out the
        steps while the others run (core/scheduler.py)."""
        return True

    def wait(self) -> None:
        """Block until ``ready`` (called only when nothing else can run)."""

    def take_forced(self, limit: int) -> list[int]:
        """Advance past the tokens (at most ``limit``) that must come next whatever the
        model says, and return them: the engine appends them as if sampled and feeds them
        in the request's next step, one forward pass for all (jump-forward decoding).
        Called only for a request with no other processor and no logprobs."""
        return []


class LogitsProcessor:
    """What ``infergraft_register_logits_processors`` registers (required: ``name``,
    ``start``)."""
    name: str = ""

    def start(self, arg: Any, vocab: Vocabulary) -> ConstraintState:
        """A new state for one request that named this processor with ``arg``. Raise
        ``InvalidRequestError`` saying what is wrong with ``arg`` and what is accepted."""
        raise NotImplementedError
