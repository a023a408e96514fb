"""The built-in ``draft`` proposer: a smaller model of the same tokenizer guesses the next
``k`` tokens greedily (Leviathan et al.'s speculative decoding with a greedy draft; a
quantised copy of the target is a draft too: ``{"model": same, "build": {"plugins":
["paged", "int4"]}}``).

The draft is an engine of its own (``core.build``: its own weights and paged cache),
driven here step by step without its scheduler: each request's K/V in the draft's cache
is kept as far as it agrees with the request's tokens now (what the target accepted), the
rest fed in one varlen step with every other request's, then ``k - 1`` decode steps, each
taking the argmax of the last. A request the draft's cache has no room for gets no draft
this step (its target step runs as a plain decode).
"""
from __future__ import annotations

from typing import Any

import attrs
import torch

from ..cache import CacheFullError
from ..errors import PlanError
from ..step import Step
from .proposer import NO_PROPOSAL, Drafter, Proposal, Proposer

#: build arguments the draft takes from the target (its ``build`` option may not set them)
FROM_TARGET = ("device", "max_seq_len", "max_batch_size", "speculative", "config")


@attrs.frozen
class _Request:
    """What the draft engine's model runner reads of a sequence: its cache id."""
    id: Any


class DraftDrafter(Drafter):
    def __init__(self, engine):
        self.engine = engine  # the draft's (core.build)
        self._fed: dict = {}  # seq id -> the token ids its K/V in the draft's cache are of

    def release(self, seq_id) -> None:
        if self._fed.pop(seq_id, None) is not None:
            self.engine.cache.free(seq_id)

    @torch.inference_mode()
    def propose(self, requests):
        cache, out = self.engine.cache, [NO_PROPOSAL] * len(requests)
        # 1) each request's K/V kept as far as it agrees with its tokens; the rest to feed
        rows, feeds = [], []
        for i, r in enumerate(requests):
            feed = self._catch_up(r.seq_id, list(r.token_ids))
            if feed is not None:
                rows.append(i)
                feeds.append(feed)
        if not rows:
            return out
        # no room for them all: the last ones go (fed again from the start next time)
        while rows and not cache.can_append([requests[i].seq_id for i in rows],
                                            [len(f) for f in feeds]):
            self.release(requests[rows.pop()].seq_id)
            feeds.pop()
        if not rows:
            return out
        # 2) the fed tokens in one step: each request's first draft token from its last row
        drafts = {i: [t] for i, t in zip(rows, self._forward(
            [requests[i].seq_id for i in rows], feeds))}
        for i, f in zip(rows, feeds):
            self._fed[requests[i].seq_id] += f
        # 3) decode steps while some request wants more (each feeds its last draft token)
        while True:
            more = [i for i in rows if len(drafts[i]) < requests[i].k]
            ids = [requests[i].seq_id for i in more]
            if not more or not cache.can_append(ids, [1] * len(ids)):
                break
            for i, t in zip(more, self._forward(ids, [[drafts[i][-1]] for i in more])):
                self._fed[requests[i].seq_id].append(drafts[i][-1])
                drafts[i].append(t)
        for i in rows:
            out[i] = Proposal(tuple(drafts[i][:requests[i].k]))
        return out

    def _catch_up(self, seq_id, tokens: list[int]) -> list[int] | None:
        """The tokens ``seq_id`` must feed the draft (at least its last one, whose logits
        give the first draft token), its cached K/V cut to what still agrees; None where
        the draft's cache has no room for it."""
        fed = self._fed.get(seq_id)
        if fed is None:
            try:
                self.engine.cache.allocate(seq_id, len(tokens))
            except CacheFullError:
                return None
            fed = self._fed[seq_id] = []
        same = 0
        for a, b in zip(fed, tokens):
            if a != b:
                break
            same += 1
        same = min(same, len(tokens) - 1)
        if same < len(fed):
            self.engine.cache.truncate(seq_id, same)
            del fed[same:]
        return tokens[same:]

    def _forward(self, ids, feeds: list[list[int]]) -> list[int]:
        """One step of the draft: ``feeds[j]`` tokens after request j's cached ones; the
        argmax of each one's last row."""
        counts = [len(f) for f in feeds]
        kind = "decode" if all(n == 1 for n in counts) else "prefill"
        step = Step(kind, [_Request(s) for s in ids], counts)
        runner = self.engine.runner
        tokens = [t for f in feeds for t in f]
        logits = runner.forward(step, tokens, runner.replays_decode(step))  # [B, V]
        return logits.argmax(-1).tolist()


class DraftProposer(Proposer):
    name = "draft"
    options = {"model": None, "build": {}}

    def check(self, options):
        if options["model"] is None:
            raise PlanError("speculative draft: give the draft model, {\"method\": \"draft\", "
                            "\"model\": DIRECTORY_OR_ALIAS, \"k\": 4} (a smaller model of the "
                            "same tokenizer, or a quantised copy of the target)")
        build = options["build"]
        if not isinstance(build, dict):
            raise PlanError(f"speculative draft: build must be an object of core.build "
                            f"arguments for the draft (e.g. {{\"plugins\": [\"paged\", "
                            f"\"int4\"]}}), got {build!r}")
        taken = sorted(set(build) & set(FROM_TARGET))
        if taken:
            raise PlanError(f"speculative draft: build may not set {taken}: the draft takes "
                            f"{', '.join(FROM_TARGET[:3])} from the target")

    def create(self, context, model=None, build=None):
        kw = {"plugins": ["paged"], "dtype": context.dtype, **(build or {})}
        engine = context.build(model, device=context.device, max_seq_len=context.max_seq_len,
                               max_batch_size=context.max_batch_size, **kw)
        check_same_vocabulary(engine, context)
        if not getattr(engine.cache, "supports_truncate", False):
            raise PlanError(f"speculative draft: the draft's cache backend "
                            f"{engine.plan.cache_backend!r} cannot roll back rejected tokens; "
                            "build it with plugins=[\"paged\"]")
        return DraftDrafter(engine)


def check_same_vocabulary(draft, context) -> None:
    """PlanError unless the draft's tokens are the target's: the same vocabulary size and,
    where both have a tokenizer, the same token of every id."""
    size = draft.spec.vocab_size
    if size != context.vocab_size:
        raise PlanError(f"speculative draft: the draft model has a vocabulary of {size} tokens, "
                        f"the target {context.vocab_size}; a draft must share the target's "
                        "tokenizer")
    ours, theirs = draft.tokenizer, context.tokenizer
    if ours is not None and theirs is not None and ours.get_vocab() != theirs.get_vocab():
        raise PlanError("speculative draft: the draft's tokenizer maps ids to other tokens "
                        "than the target's; a draft must share the target's tokenizer")
