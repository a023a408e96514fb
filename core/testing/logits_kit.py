"""Conformance kit for logits processors (``core.logits_processor``).

A processor's suite subclasses :class:`LogitsProcessorTests` and provides the fixtures
``processor`` (the object registered), ``processor_arg`` (an argument a request may give
it) and ``bad_arg`` (one ``start`` must refuse); ``vocab`` (default: the kit's byte-level
tokenizer, 256 tokens of the 260 a tiny model emits, stop token 257) may be overridden.

What it checks, on states started from ``processor_arg``: a mask fills only its own row
and allows some token; every token a mask allows is accepted, walking greedily (the
lowest allowed token that is not a stop token) until the state is complete or
``walk_steps`` tokens have passed; forced tokens (jump-forward) are within the vocabulary
and leave the state able to go on; two states of one argument do not share progress; a
bad argument is an ``InvalidRequestError``.
"""
from __future__ import annotations

import pytest
import torch

from ..errors import InvalidRequestError
from ..logits_processor import ConstraintState, Vocabulary, bitmask_words
from ..registry import _NAME


def allowed_tokens(bitmask_row: torch.Tensor, size: int) -> list[int]:
    """The token ids a bitmask row [words] int32 allows, below ``size``."""
    shifts = torch.arange(32, dtype=torch.int32)
    bits = ((bitmask_row[:, None] >> shifts) & 1).reshape(-1)[:size]
    return bits.nonzero().flatten().tolist()


def mask_of(state: ConstraintState, vocab: Vocabulary) -> list[int]:
    row = torch.full((1, bitmask_words(vocab.size)), -1, dtype=torch.int32)
    state.fill_bitmask(row, 0)
    return allowed_tokens(row[0], vocab.size)


def next_token(allowed: list[int], vocab: Vocabulary) -> int:
    """The lowest allowed token that is not a stop token (else a stop token)."""
    plain = [t for t in allowed if t not in vocab.eos_token_ids]
    return (plain or allowed)[0]


class LogitsProcessorTests:
    walk_steps = 40

    @pytest.fixture
    def vocab(self):
        from .models import byte_tokenizer
        return Vocabulary(260, frozenset({257}), byte_tokenizer())

    def test_name_is_valid(self, processor):
        assert isinstance(processor.name, str) and _NAME.match(processor.name), processor.name

    def test_start_returns_a_constraint_state(self, processor, processor_arg, vocab):
        state = processor.start(processor_arg, vocab)
        for method in ("fill_bitmask", "accept", "is_complete", "take_forced"):
            assert callable(getattr(state, method, None)), method

    def test_a_mask_fills_its_own_row_and_allows_a_token(self, processor, processor_arg, vocab):
        state = processor.start(processor_arg, vocab)
        bitmask = torch.full((3, bitmask_words(vocab.size)), -1, dtype=torch.int32)
        bitmask[0], bitmask[2] = 7, -5
        state.fill_bitmask(bitmask, 1)
        assert (bitmask[0] == 7).all() and (bitmask[2] == -5).all(), "wrote outside its row"
        assert allowed_tokens(bitmask[1], vocab.size), "its first mask allows no token"

    def test_every_allowed_token_walked_is_accepted(self, processor, processor_arg, vocab):
        state = processor.start(processor_arg, vocab)
        for _ in range(self.walk_steps):
            if state.is_complete():
                return
            allowed = mask_of(state, vocab)
            assert allowed, "the mask allows no token, yet the state is not complete"
            token = next_token(allowed, vocab)
            assert state.accept(token), f"token {token} was allowed, then refused"
            if token in vocab.eos_token_ids:
                return

    def test_forced_tokens_are_in_the_vocabulary(self, processor, processor_arg, vocab):
        state = processor.start(processor_arg, vocab)
        forced = state.take_forced(8)
        assert isinstance(forced, list) and len(forced) <= 8
        assert all(isinstance(t, int) and 0 <= t < vocab.size for t in forced), forced
        assert state.is_complete() or mask_of(state, vocab), "nothing may follow the forced tokens"

    def test_states_do_not_share_progress(self, processor, processor_arg, vocab):
        a, b = processor.start(processor_arg, vocab), processor.start(processor_arg, vocab)
        first = mask_of(b, vocab)
        token = next_token(mask_of(a, vocab), vocab)
        assert a.accept(token)
        assert mask_of(b, vocab) == first, "advancing one state changed another's mask"

    def test_a_bad_argument_is_an_invalid_request(self, processor, bad_arg, vocab):
        with pytest.raises(InvalidRequestError):
            processor.start(bad_arg, vocab)
