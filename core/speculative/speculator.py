"""The engine's side of speculative decoding: proposed tokens added to a scheduled step,
verified from its logits, rejected ones rolled back (docs/architecture.md: "How a request
flows").

1) ``extend``: after the scheduler's step, each decoding request that speculates (its
   ``SamplingParams.speculative``, no constraint, not paused by its ``AdaptiveK``; a
   greedy one only while its tokens are kept often enough to pay for what a proposed
   token costs here: ``cost.py``) asks the proposer for up to ``k`` tokens, fed after its
   last token in the same step: more query rows of the varlen step. Not when more than
   ``disable_by_batch_size`` requests decode, nor beyond the step's token budget, nor
   where the cache cannot take the extra tokens (the step then runs as scheduled).
2) the runner computes logits at every row of a drafted request (one row for the others).
3) ``split`` parts them: the other requests are sampled as in any step (their tokens are
   the ones they get without speculation); ``accept`` verifies each drafted request
   (``verify.py``), rolls its K/V back past the last token kept (``cache.truncate``: the
   rejected tokens' blocks freed; the prefix cache keys only tokens a request holds), and
   appends its tokens one by one, so stop strings, EOS and ``max_new_tokens`` end it
   inside the run as they would one token at a time.
"""
from __future__ import annotations

import attrs
import torch

from ..errors import PlanError
from ..runner.host_tensors import from_ints
from ..runner.sampler import place_logprob
from .adaptive import AdaptiveK
from .ahead import VerifyAhead
from .cost import SHARE_OFF, StepCost
from .proposer import DraftRequest, Proposal, ProposerContext, TokensSoFar
from .verify import verify_request


class Speculator:
    def __init__(self, engine, config, drafter):
        self.engine, self.config, self.drafter = engine, config, drafter
        self.vocab_size = engine.spec.vocab_size
        # tokens verified, tokens kept, drafts verified (a request's in one step)
        self.num_draft_tokens = self.num_accepted_tokens = self.num_drafts = 0
        self._known: set = set()  # requests the drafter was asked about and not released
        self.cost = StepCost()  # what a proposed token costs, from this engine's steps
        # verify steps launched before the last one is read (asynchronous steps, a drafter
        # that proposes on the host); None: each waits for the tokens before it
        self.ahead = VerifyAhead(self) if config.ahead and drafter.proposes_ahead else None

    # -- 1) the step's proposed tokens -------------------------------------------------
    def eligible(self, seq, share: float) -> bool:
        """Whether ``seq`` may propose where a proposed token must be kept ``share`` of the
        time to pay (cost.py): no greedy request past ``SHARE_OFF``."""
        p = seq.params
        return p.speculative and not p.constrained and not seq.prefilling and \
            not (p.greedy and share >= SHARE_OFF)

    def wants(self, seqs) -> bool:
        """Whether some of ``seqs`` would propose at their next decode step (the decode
        look-ahead, which launches that step before their tokens are known, must not)."""
        if len(seqs) > self.config.disable_by_batch_size:
            return False
        share = self._share(seqs, full=True)
        return any(self.eligible(s, share) and (s.speculation is None or s.speculation.active)
                   for s in seqs)

    def launched_ahead(self, seqs) -> None:
        """The decode look-ahead launched a step of ``seqs`` (none proposes in it: it
        launches only while none would): one decode step of each paused request's pause,
        as ``extend`` counts it on a step it schedules (else a pause never ends while the
        look-ahead goes on: a lone request would not propose again)."""
        for s in seqs:
            if s.speculation is not None and not s.speculation.active:
                s.speculation.take()

    def _share(self, decoding, full: bool = False) -> float:
        """The keep rate a proposed token needs at this batch, with the tokens its requests
        would propose together (each its current ``k``; ``full``: each the configured ``k``,
        the most a step proposes) sharing a drafted step's overhead. Whether a request may
        propose at all (``SHARE_OFF``) asks the full one: a request whose ``k`` shrank, or
        paused, would otherwise price its next draft at one token and never draft again
        where a verify step's overhead is large (a small model behind the look-ahead)."""
        p = self.config.k
        speculating = [s for s in decoding if s.params.speculative and not s.params.constrained]
        proposed = p * len(speculating) if full else \
            sum(p if s.speculation is None else s.speculation.k * s.speculation.active
                for s in speculating)
        return self.cost.share(len(decoding), proposed)

    def extend(self, step, ahead=None):
        """``step`` with proposed tokens after its decoding requests' last ones (as
        ``Step.drafts``), or ``step`` itself where none are proposed. ``ahead``: seq id ->
        the tokens taken to follow a request whose last token the step in flight gives
        (its draft there; ``ahead.py``): its proposal is made after them and a guess at that
        token, the guess dropped."""
        scheduler = self.engine.scheduler
        self._release_gone(scheduler.running)
        decoding = [i for i, s in enumerate(step.seqs) if not s.prefilling]
        budget = scheduler.max_num_batched_tokens - sum(step.counts)
        if not decoding or len(decoding) > self.config.disable_by_batch_size or budget < 1 \
                or scheduler.long_rope is not None:  # (LongRoPE: recomputed at its boundary)
            return step
        where, requests = [], []
        seqs = [step.seqs[i] for i in decoding]
        share = self._share(seqs)  # the keep rate a proposed token needs here
        share_full = self._share(seqs, full=True)
        for i in decoding:
            s = step.seqs[i]
            if not self.eligible(s, share_full):
                continue
            if s.speculation is None:
                s.speculation = AdaptiveK(self.config.k)
            # the last token kept always comes with one more of the target's own (and one
            # in flight, with its draft, before it)
            pending = None if ahead is None else ahead.get(s.id)
            coming = 0 if pending is None else len(pending) + 1
            k = min(s.speculation.take(),
                    s.params.max_new_tokens - len(s.output_ids) - coming - 1)
            # drafts that cost more than they give: held (greedy requests only, whose
            # tokens do not depend on it; a sampled one's draws do, and its seed reproduces)
            state = s.speculation
            if k > 0 and s.params.greedy and state.rate < share and not state.probing:
                state.hold()
            elif k > 0:
                where.append(i)
                requests.append(DraftRequest(
                    s.id, TokensSoFar(s.prompt_ids, s.output_ids), k + (pending is not None),
                    () if pending is None else tuple(pending)))
        if not requests:
            return step
        self._known.update(r.seq_id for r in requests)
        drafts, counts = [None] * len(step.seqs), list(step.counts)
        for i, r, prop in zip(where, requests, self.drafter.propose(requests)):
            guessed = int(ahead is not None and r.seq_id in ahead)  # (the unknown token's)
            n = min(len(prop.tokens) - guessed, r.k - guessed, budget)
            if n > 0 and self._valid(prop.tokens[guessed:guessed + n]):
                probs = None if prop.probs is None else prop.probs[guessed:guessed + n]
                drafts[i] = Proposal(tuple(prop.tokens[guessed:guessed + n]), probs)
                counts[i] += n
                budget -= n
        if not any(drafts) or not self.engine.cache.can_append([s.id for s in step.seqs], counts):
            return step
        return attrs.evolve(step, counts=counts, drafts=tuple(drafts))

    def _valid(self, tokens) -> bool:
        return all(isinstance(t, int) and 0 <= t < self.vocab_size for t in tokens)

    def _release_gone(self, running) -> None:
        """The drafter forgets requests no longer running (finished, preempted, aborted)."""
        live = {s.id for s in running}
        for seq_id in self._known - live:
            self.drafter.release(seq_id)
        self._known &= live

    # -- 3) verification ---------------------------------------------------------------
    def split(self, step, logits):
        """``logits`` [rows, V] of a step with drafts -> (the undrafted requests, their
        logits [n, V] (one row each), the drafted ones' (seq, proposal, first row));
        ``logits`` None (a pipeline stage before the last) is refused at build."""
        plain, plain_rows, drafted, row = [], [], [], 0
        for s, n, proposal in zip(step.seqs, step.counts, step.drafts):
            if proposal is None:
                plain.append(s)
                plain_rows.append(row)
                row += 1
            else:
                drafted.append((s, proposal, row))
                row += n
        if not plain:  # (every request drafted: no index to build and copy)
            return plain, logits[:0], (logits, drafted)
        index = from_ints(plain_rows).to(logits.device)
        return plain, logits.index_select(0, index), (logits, drafted)

    def accept(self, verify, now: float) -> list:
        """Verify each drafted request, roll back what it did not keep, append what it
        did; returns the requests that got tokens."""
        logits, drafted = verify
        # each drafted request's rows of ``logits`` (its first, then one a proposed token)
        spans = [(r, r + len(proposal.tokens) + 1) for _, proposal, r in drafted]
        # every row's argmax to the host in one copy, -1 for a row holding NaN (its max is
        # NaN); the undrafted requests' rows too: fewer ops than picking the drafted ones
        # out. The rows requests process on the host (penalties, sampling, logprobs): in
        # another copy
        best, targets = logits.max(-1)
        targets = torch.where(best.isnan(), -1, targets).tolist()
        host = self._host_rows(logits, drafted, spans)
        for (seq, proposal, _), (a, b) in zip(drafted, spans):
            if min(targets[a:b]) < 0:
                seq.error = "sampling failed: NaN logits: the model's output overflowed"
                tokens, entries = [-1], None
            else:
                tokens, entries = self._verify_one(seq, proposal, host.get(seq.id), targets[a:b])
            self._roll_back(seq, proposal, tokens)
            for j, token in enumerate(tokens):
                if entries is not None:
                    place_logprob(seq, entries[j])
                self.engine._append(seq, token, now)
                if seq.finished:
                    break
        return [seq for seq, _, _ in drafted]

    def _host_rows(self, rows, drafted, spans) -> dict:
        """seq id -> its rows of ``rows`` (``spans``) on the host [d + 1, V], for the
        requests that are not plain greedy (one copy for them all)."""
        which = [i for i, (s, _, _) in enumerate(drafted) if not s.params.plain_greedy]
        if not which:
            return {}
        index = from_ints([r for i in which for r in range(*spans[i])]).to(rows.device)
        copied, out, at = rows.index_select(0, index).cpu(), {}, 0
        for i in which:
            n = spans[i][1] - spans[i][0]
            out[drafted[i][0].id], at = copied[at:at + n], at + n
        return out

    def _verify_one(self, seq, proposal, host_rows, targets):
        """(tokens, logprob entries or None); a request whose verification fails gets
        [-1] (it finishes with "error", its ``error`` saying why), the others go on."""
        try:
            return verify_request(host_rows, targets, seq, proposal)
        except Exception as e:
            seq.error = f"sampling failed: {type(e).__name__}: {e}"
            return [-1], None

    def _roll_back(self, seq, proposal, tokens) -> None:
        """Forget the K/V of the proposed tokens ``seq`` did not keep; count them."""
        proposed = len(proposal.tokens)
        kept = 0 if tokens[-1] < 0 else len(tokens) - 1  # the last is the target's own
        seq.num_computed_tokens -= proposed - kept
        if proposed > kept and tokens[-1] >= 0:  # (a failed one's cache is freed whole)
            self.engine.cache.truncate(seq.id, seq.num_computed_tokens)
        self.count(seq, proposed, kept)

    def count(self, seq, proposed: int, kept: int) -> None:
        """A draft of ``seq``'s was verified: ``kept`` of its ``proposed`` tokens kept."""
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += kept
        self.num_drafts += 1
        seq.metrics.on_draft(proposed, kept)
        seq.speculation.update(proposed, kept)

    def observe(self, step, seconds: float) -> None:
        """A step ran in ``seconds`` (its call, nothing launched ahead of it): a point of
        the cost fit where no prompt was fed."""
        if step.kind == "decode":
            self.cost.observe(sum(step.counts), seconds, step.drafts is not None)
        if step.drafts is not None and self.ahead is not None:
            self.ahead.cost.observe(seconds, pipelined=False)

    def stats(self) -> dict:
        """Counters for ``engine.stats()`` and /metrics (names as vLLM's spec_decode ones)."""
        rate = self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
        return {"spec_decode_num_drafts": self.num_drafts,
                "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_draft_acceptance_rate": rate}


def speculation_for(engine, config, proposers, build) -> Speculator | None:
    """The engine's Speculator for ``config`` (a SpeculativeConfig; None: none), its
    proposer's Drafter created for it; PlanError where this engine cannot speculate."""
    if config is None:
        return None
    parallel = engine.plan.parallel
    if parallel.world_size > 1:
        raise PlanError(f"speculative decoding runs on one device; this plan has "
                        f"{parallel.world_size} ranks (tp / pp): build without speculative")
    if not getattr(engine.cache, "supports_truncate", False):
        raise PlanError(f"speculative decoding needs a cache that can roll back rejected "
                        f"tokens (KVCache.truncate), which cache backend "
                        f"{engine.plan.cache_backend!r} cannot here (the contiguous one: not "
                        f"with its rolling sliding-window rows); build with plugins=[\"paged\"]")
    plan = engine.plan
    context = ProposerContext(engine.spec, engine.spec.vocab_size, engine.tokenizer,
                              engine.device, getattr(torch, plan.dtype), plan.max_seq_len,
                              plan.max_batch_size, build)
    drafter = proposers.get(config.method).create(context, **config.options)
    return Speculator(engine, config, drafter)
