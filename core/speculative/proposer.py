"""Proposer contract: registered through ``infergraft_register_proposers``.

Speculative decoding verifies several tokens per weight read: a proposer guesses the next
``k`` tokens of a request (from its own text: n-gram prompt lookup; from a smaller model:
a draft), the engine feeds them after the request's last token in one step, and keeps the
longest prefix the target model agrees with, plus the target's own next token
(``core/speculative/verify.py``). The output is the target's whatever is proposed: a bad
guess costs a step's extra tokens, never a different answer.

A ``Proposer`` is registered once; ``create(context, **options)`` makes the ``Drafter``
one engine uses (the options: the ``speculative`` config's keys beyond ``method``, ``k``
and ``disable_by_batch_size``, as the proposer declares them in ``options``). The engine
asks it, once a step, for drafts of the requests that speculate (``propose``), and tells
it which requests it no longer needs to remember (``release``: finished, preempted,
aborted). Proposing is on the step's critical path: the host work should stay small.

A drafter that proposes on the host alone (no device work, no wait for the step in flight)
sets ``proposes_ahead``: the engine then also asks it while the step before runs, for
requests whose last tokens are not known yet (``DraftRequest.ahead``: the draft that step
verifies, taken as kept; the proposal's first token is a guess at the token the step
gives after it, which the engine drops: ``core/speculative/ahead.py``).
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, Callable, Optional

import attrs
import torch


@attrs.frozen
class ProposerContext:
    """What a proposer knows of the engine it proposes for."""
    spec: Any  # the target's ModelSpec
    vocab_size: int  # the target's logits' width: proposed ids are below it
    tokenizer: Any  # the target's Hugging Face tokenizer (None: an engine of token ids)
    device: torch.device
    dtype: torch.dtype
    max_seq_len: int  # prompt + output tokens of a request, at most
    max_batch_size: int  # requests at once, at most
    # ``core.build`` (a proposer with a model of its own builds it with this: its own cache)
    build: Optional[Callable] = None


@attrs.frozen
class DraftRequest:
    """One request to propose for: its tokens so far (prompt, then output) and how many
    tokens the engine verifies at most (``k`` >= 1; fewer, or none, may be proposed).
    The engine's ``token_ids`` is a ``TokensSoFar``: the request's own lists, read in
    place, which grow after ``propose`` returns (copy what is kept). ``ahead``: tokens
    taken to follow ``token_ids`` that are not the request's yet (a draft being verified;
    only a drafter with ``proposes_ahead`` is given any): propose what follows them."""
    seq_id: Any
    token_ids: Sequence[int]
    k: int
    ahead: tuple = ()


class TokensSoFar(Sequence):
    """A request's prompt then its output as one sequence, without copying them (a long
    prompt would be copied at every step); a slice past the prompt is the output's."""
    __slots__ = ("prompt", "output")

    def __init__(self, prompt: list, output: list):
        self.prompt, self.output = prompt, output

    def __len__(self) -> int:
        return len(self.prompt) + len(self.output)

    def __iter__(self):
        return itertools.chain(self.prompt, self.output)

    def __getitem__(self, i):
        n = len(self.prompt)
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step == 1 and start >= n:
                return self.output[start - n:max(start, stop) - n]
            return (self.prompt + self.output)[i]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"token {i} of a request holding {len(self)}")
        return self.prompt[i] if i < n else self.output[i - n]


@attrs.frozen
class Proposal:
    """Up to ``k`` token ids that may follow the request, in order; ``probs``: the
    distribution each was drawn from ([len(tokens), V] float32), or None for a point mass
    on each (greedy drafts, n-gram lookup). Sampled requests stay exact either way: the
    engine's rejection sampling reads ``probs``."""
    tokens: tuple[int, ...] = ()
    probs: Optional[torch.Tensor] = None


NO_PROPOSAL = Proposal()


class Drafter:
    """One engine's proposer (``Proposer.create`` makes it)."""

    #: proposes on the host alone, for requests with ``ahead`` tokens too (the module's
    #: docstring); a drafter with a model of its own waits for the device: False
    proposes_ahead: bool = False

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        """One Proposal per request, in order (``NO_PROPOSAL`` where there is none)."""
        raise NotImplementedError

    def release(self, seq_id) -> None:
        """``seq_id`` is no longer proposed for (finished, preempted or aborted): what is
        kept for it (a draft model's K/V) may go. It may come back (a preempted request
        resumes): then it is proposed for as if new."""


class Proposer:
    """Registered through ``infergraft_register_proposers``; a request's engine picks it by
    ``name`` (``core.build(speculative={"method": name, ...})``)."""

    name: str = ""
    #: its own keys of the ``speculative`` config, with their defaults
    options: dict[str, Any] = {}

    def check(self, options: dict) -> None:
        """Raise ``PlanError`` (what is wrong, what is accepted) for a bad value among
        ``options`` (its own keys, defaults filled): called before any weight loads."""

    def create(self, context: ProposerContext, **options) -> Drafter:
        raise NotImplementedError
