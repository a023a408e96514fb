"""The masks of many requests' grammars filled in one call (``GrammarState.batch``).

A step of 256 constrained rows asks for 256 masks. Filled one row at a time from Python
they cost the Python calls and one core; xgrammar's ``BatchGrammarMatcher`` fills them
in one call across its own threads (C++, the GIL released), each row written whole, so
the buffer needs no reset first. ``core/runner/constraints.py`` gathers the rows whose
only state is a ``GrammarState`` of one tokenizer and hands them here together.

The bitmask is as wide as the tokenizer's vocabulary (``words``), not the logits' (a
model's vocabulary padded past its tokenizer's, or a random shape run with a smaller
tokenizer): the ids past the tokenizer are no token xgrammar could ever allow (stop
tokens aside, which the width covers), and the bitmask kernel masks every id past a
bitmask's width; xgrammar, given the logits' width instead, spends most of a mask on
clearing those ids one by one.
"""
from __future__ import annotations

import os

import torch

from ..logits_processor import TOKENS_PER_WORD, bitmask_words


def fill_threads() -> int:
    """xgrammar's threads for a step's masks: half the host's cores (as its "auto"),
    at most 16, at least 1."""
    return max(1, min(16, (os.cpu_count() or 2) // 2))


class GrammarBatch:
    """Fills the masks of one tokenizer's grammar states, ``width`` tokens wide."""

    def __init__(self, xgrammar, width: int, threads: int | None = None):
        self.width, self.words = width, bitmask_words(width)
        self._matcher = xgrammar.BatchGrammarMatcher(threads or fill_threads())
        # the ids between ``width`` and the last word's end: never allowed
        spare = self.words * TOKENS_PER_WORD - width
        self._last_word = None if spare == 0 else \
            torch.tensor((1 << (TOKENS_PER_WORD - spare)) - 1).to(torch.int32)

    def fill(self, states, bitmask: torch.Tensor) -> dict[int, Exception]:
        """Row ``r`` of ``bitmask`` [len(states), words] (contiguous, on the host): the
        tokens ``states[r]`` allows next. Returns {row: the error} for the rows that
        failed (a grammar that did not compile, a matcher that raised)."""
        failed, matchers, rows = {}, [], []
        for r, state in enumerate(states):
            try:
                matchers.append(state.matcher)  # (waits for a compilation under way)
                rows.append(r)
            except Exception as e:
                failed[r] = e
        try:
            if matchers:
                self._matcher.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        except Exception:  # one row at a time, to name the one that raised
            for r, m in zip(rows, matchers):
                try:
                    m.fill_next_token_bitmask(bitmask, r)
                except Exception as e:
                    failed[r] = e
        if self._last_word is not None:
            bitmask[:, -1] &= self._last_word
        return failed
