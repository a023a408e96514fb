"""Conformance kit for proposers (``core.speculative.proposer``).

A proposer's suite subclasses :class:`ProposerTests` and provides the fixtures
``proposer`` (the object registered), ``proposer_options`` (its own options as a
``speculative`` config would give them; its defaults are filled in) and ``bad_options``
(options ``check`` must refuse); ``context`` (default: a 256-token vocabulary on the CPU,
``core.build`` to build a model of its own with) may be overridden.

What it checks: a valid name and options with defaults; ``create`` gives a ``Drafter``;
one proposal per request, in order, each at most its request's ``k`` tokens within the
vocabulary (and ``probs``, where given, one distribution per token); a request released
and asked about again (a preempted one resuming, with other tokens) is proposed for as a
new one; releasing an unknown request changes nothing; bad options are a ``PlanError``.
"""
from __future__ import annotations

import pytest
import torch

from ..errors import PlanError
from ..registry import _NAME
from ..speculative.proposer import DraftRequest, Drafter, Proposal, ProposerContext

#: requests the kit asks about: a repeating text (a lookup finds it), a random one, and
#: one of a single token, with k from 1 to 4
REQUESTS = ((("rep", [5, 6, 7, 8] * 4), 4), (("rand", [3, 41, 9, 200, 17, 77, 12]), 2),
            (("one", [9]), 1))


class ProposerTests:
    @pytest.fixture
    def context(self):
        from .. import build
        return ProposerContext(spec=None, vocab_size=256, tokenizer=None,
                               device=torch.device("cpu"), dtype=torch.float32, max_seq_len=64,
                               max_batch_size=4, build=build)

    @pytest.fixture
    def drafter(self, proposer, proposer_options, context):
        options = {**proposer.options, **proposer_options}
        proposer.check(options)
        return proposer.create(context, **options)

    def requests(self):
        return [DraftRequest(seq_id, ids, k) for (seq_id, ids), k in REQUESTS]

    def test_name_and_options_are_valid(self, proposer):
        assert isinstance(proposer.name, str) and _NAME.match(proposer.name), proposer.name
        assert isinstance(proposer.options, dict)
        assert all(isinstance(k, str) for k in proposer.options), proposer.options
        assert not set(proposer.options) & {"method", "k", "disable_by_batch_size"}, \
            "the engine's own keys cannot be a proposer's option"

    def test_create_gives_a_drafter(self, drafter):
        assert isinstance(drafter, Drafter) or all(
            callable(getattr(drafter, m, None)) for m in ("propose", "release"))

    def test_one_proposal_per_request_within_k_and_the_vocabulary(self, drafter, context):
        requests = self.requests()
        for _ in range(2):  # a second round: state kept between steps must stay valid
            proposals = drafter.propose(requests)
            assert len(proposals) == len(requests)
            for r, p in zip(requests, proposals):
                check_proposal(p, r.k, context.vocab_size)
            requests = [DraftRequest(r.seq_id, list(r.token_ids) + list(p.tokens[:1] or [7]), r.k)
                        for r, p in zip(requests, proposals)]

    def test_a_released_request_is_proposed_for_as_new(self, drafter, context):
        first = self.requests()
        drafter.propose(first)
        drafter.release(first[0].seq_id)
        drafter.release("never-asked")  # an unknown one: nothing changes
        other = DraftRequest(first[0].seq_id, [1, 2, 1, 2, 1], 3)  # resumed, other tokens
        for p in drafter.propose([other, *first[1:]]):
            check_proposal(p, 3, context.vocab_size)

    def test_bad_options_are_a_plan_error(self, proposer, bad_options):
        with pytest.raises(PlanError):
            proposer.check({**proposer.options, **bad_options})


def check_proposal(p, k: int, vocab_size: int) -> None:
    assert isinstance(p, Proposal), p
    assert isinstance(p.tokens, tuple) and len(p.tokens) <= k, (p.tokens, k)
    assert all(isinstance(t, int) and 0 <= t < vocab_size for t in p.tokens), p.tokens
    if p.probs is not None:
        assert p.probs.shape == (len(p.tokens), vocab_size), p.probs.shape
        assert torch.allclose(p.probs.sum(-1), torch.ones(len(p.tokens)), atol=1e-4)
