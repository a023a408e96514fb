"""Verify steps launched ahead: step N+1 launched before step N's tokens are read, taking
every request drafted at N to keep its whole draft (docs/bench/speculative.md,
"Overlapping verify steps with the host", option 2; the engine's loop is
``core/runner/async_steps.py``, which launches plain greedy steps so).

A synchronous verify step waits for the one before: how many tokens a request kept (its
positions, its slots), the target's token after them (the "bonus") and the next draft,
proposed from the tokens up to it, all come from that step. Here, while N runs:

1) N+1 is scheduled (``Scheduler.schedule_ahead``: the cache's room asked on lengths that
   count N's whole drafts) and each request of it whose token N gives is fed that token
   from the device (``DeviceFeed``: the argmax of its last row of N, the bonus where N
   drafted it) at the position after N's whole draft; its next draft is proposed on the
   host from its tokens, N's draft, and a guess at that token (the proposal's first
   token, dropped: ``Speculator.extend(step, ahead=...)``; only a drafter that proposes on
   the host: ``Drafter.proposes_ahead``). A wrong guess costs acceptance, never
   exactness: the rows of N+1 verify whatever they feed after the real token.
2) N is read while N+1 runs (``settle``): a request that kept its whole draft goes on with
   its rows of N+1 as they are (verified when N+1 is read). One that did not, or whose
   rows failed (NaN), or that finished, loses its rows of N+1: dropped from N+1's read,
   its K/V rolled back past the tokens it kept (``cache.truncate``: the K/V N+1 writes
   there is in no block it holds any longer past its length, and a freed block's reuse is
   stream-ordered after N+1; prefix keys are only ever made from a request's own tokens),
   and it is proposed for again at N+2 from its real tokens.

A miss costs the request a step; a hit saves the host's work around one (the proposal,
the read, the roll back, the launch). So a request drafted at N is launched ahead only
where its drafts are kept whole often enough (``AdaptiveK.whole``) for that trade, as
this engine's calls measure it (``AheadCost``); one that is not sits N+1 out and is
scheduled again at N+2 with its real tokens (alone, its step waits for N: the
synchronous engine). ``AdaptiveK`` and the metrics see a draft when it is read: one step
late for the proposal launched ahead.

Greedy requests only (``params.plain_greedy``, as asynchronous steps): a sampled one's
rejection sampling reads its rows on the host, and its steps stay synchronous.
"""
from __future__ import annotations

from ..step import Step
from .verify import accept_greedy

#: the share of a request's drafts that must be kept whole for it to be launched ahead
#: while the engine has not timed a synchronous verify step yet (it then does, sitting out)
WHOLE_UNTIMED = 0.5
DECAY = 0.9  # the weight of a timed call falls by this much with each later one
NAN_ERROR = "sampling failed: NaN logits: the model's output overflowed"


class AheadCost:
    """What a verify step's engine call lasts, synchronous (nothing launched ahead of it)
    and launched ahead (the call that launches the next and reads it, back to back: one
    step of the pipeline), each an exponentially weighted mean of the calls timed.

    A request whose drafts are kept whole with chance ``q`` gains by being launched ahead
    where ``pipelined * (2 - q) <= synchronous``: each of its verify steps costs a step
    of the pipeline, and a miss one more (its rows of the next step are wasted). Where a
    step is mostly host time (a small model) that is nearly always; where the GPU's time
    dwarfs the host's (a large model), only for drafts kept whole nearly every time."""

    def __init__(self):
        self.synchronous = self.pipelined = None  # seconds, None until timed

    def observe(self, seconds: float, pipelined: bool) -> None:
        name = "pipelined" if pipelined else "synchronous"
        old = getattr(self, name)
        setattr(self, name, seconds if old is None else DECAY * old + (1 - DECAY) * seconds)

    def gambles(self, whole: float) -> bool:
        """Whether a request whose drafts are kept whole ``whole`` of the time is launched
        ahead (always until a pipelined call was timed: that measures it)."""
        if self.pipelined is None:
            return True
        if self.synchronous is None:
            return whole >= WHOLE_UNTIMED
        return self.pipelined * (2 - whole) <= self.synchronous


class VerifyAhead:
    def __init__(self, speculator):
        self.speculator = speculator
        self.cost = AheadCost()
        self.dropped = 0  # requests' rows of a step launched ahead, wasted (drafts not kept whole)

    # -- 1) the step launched before the one in flight is read ---------------------------
    def extend(self, step, current):
        """``step`` (scheduled while ``current``, an async_steps.Launched, runs) with its
        proposals, the requests drafted at ``current`` that are not launched ahead left
        out (None: none is left)."""
        drafted = current.drafted
        keep = [i for i, s in enumerate(step.seqs)
                if s.id not in drafted or self.cost.gambles(s.speculation.whole)]
        if not keep:
            return None
        if len(keep) < len(step.seqs):
            seqs = [step.seqs[i] for i in keep]
            step = Step("prefill" if any(s.prefilling for s in seqs) else "decode", seqs,
                        [step.counts[i] for i in keep])
        ahead = {s.id: drafted[s.id][1].tokens if s.id in drafted else ()
                 for s in step.seqs if s.id in current.rows}
        return self.speculator.extend(step, ahead=ahead)

    # -- 2) a drafted request's rows read ----------------------------------------------
    def settle(self, seq, draft, start: int, targets: list[int], failed: bool, after,
               append) -> None:
        """Verify ``seq``'s ``draft`` (its rows' argmax ``targets``; ``failed``: a row held
        NaN), its length ``start`` before that step; drop its rows of ``after`` (the step
        launched since, or None) unless it kept its whole draft; ``append`` its tokens."""
        speculator, proposed = self.speculator, len(draft.tokens)
        if failed:
            seq.error, tokens = NAN_ERROR, [-1]
        else:
            tokens = accept_greedy(targets, draft.tokens)
        kept = 0 if failed else len(tokens) - 1  # the last is the target's own
        speculator.count(seq, proposed, kept)
        goes_on = not failed and kept == proposed and after is not None \
            and seq.id in after.rows
        if not goes_on:
            if after is not None and after.drop(seq.id):
                self.dropped += 1
            seq.num_computed_tokens = start + 1 + kept
            cache = speculator.engine.cache
            if not failed and cache.length(seq.id) > seq.num_computed_tokens:
                cache.truncate(seq.id, seq.num_computed_tokens)  # (a failed one's: freed)
        for token in tokens:
            append(seq, token)
            if seq.finished:
                break

    def observe(self, step, seconds: float) -> None:
        """A call that launched the next step and read ``step`` (launched by the call
        before) lasted ``seconds``: one step of the pipeline; a point of the cost fit
        (decode steps), and of ``AheadCost`` (verify steps)."""
        if step.kind == "decode":
            self.speculator.cost.observe(sum(step.counts), seconds, step.drafts is not None)
        if step.drafts is not None:
            self.cost.observe(seconds, pipelined=True)
