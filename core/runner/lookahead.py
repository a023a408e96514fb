"""Greedy decode look-ahead: launch step N+1 before reading step N's tokens.

Between two graph replays the host samples, appends, checks stop conditions and
schedules, and the GPU would sit idle meanwhile (a sizeable part of a small batch's step:
docs/bench/HISTORY.md). For a
greedy batch the next step's inputs are already on the device (each graph computes its
argmax), and its metadata (one more position per sequence) is known in advance. So
while step N runs, the engine launches step N+1 for the same sequences, then reads N's
tokens and does the host work while N+1 runs.

The look-ahead is taken only when the next step would be exactly the same batch: no
request waiting to be admitted or swapped back in, every sequence still running and
greedy, none at its token limit, and room in the cache. A sequence that stops at step N
(EOS, stop string, abort) wasted one row of step N+1: its cache is freed on the host,
and the GPU's write into its old slot is stream-ordered before any later reuse of that
memory.

Only ``params.plain_greedy`` batches qualify: the graph's argmax is over the raw logits,
which nothing else reads here, so a request with penalties, min_p or logprobs
(``params.needs_logits_processing``) or a constraint (``params.constrained``: its mask
must come first) must see the sampler. Its batch replays the graph
without the look-ahead (``CudaGraphRunner.decode``) and the engine samples the logits
that returns, feeding the sampled tokens back as the next step's inputs.
"""
from __future__ import annotations

import time

from ..request import Status
from ..swap_schedule import can_swap_in_now


class DecodeLookahead:
    def __init__(self, engine):
        self.engine = engine
        self.inflight = None  # (seqs, PendingTokens) launched but not yet read

    @staticmethod
    def eligible(seqs) -> bool:
        """Greedy with no logits processing and no logprobs, every one of them."""
        return all(s.params.plain_greedy for s in seqs)

    def keeps_up(self, seqs) -> bool:
        """Whether a greedy decode step of ``seqs`` would launch the next one from its own
        buffer (the same batch again): asynchronous steps leave such a step to it."""
        return self.eligible(seqs) and self._can_look_ahead(seqs)

    def run(self, seqs, tokens: list[int]):
        """A scheduled greedy decode step: launch it, maybe launch the next, read it."""
        graphs = self.engine.decode_graphs
        self.inflight = (seqs, graphs.launch([s.id for s in seqs], tokens))
        return self.advance()

    def advance(self):
        """Read the step in flight (launching the next one first when it may)."""
        seqs, pending = self.inflight
        self.inflight = None
        engine = self.engine
        if self._can_look_ahead(seqs):
            self.inflight = (seqs, engine.decode_graphs.launch([s.id for s in seqs], None))
            if engine.speculation is not None:  # a decode step of a pause, where one is
                engine.speculation.launched_ahead(seqs)
        elif engine.schedule_ahead:  # the next step differs: schedule it while this one runs
            # (this one's row is not counted yet: a sequence it brings to LongRoPE's
            # boundary must be recomputed, not fed its next row from the short K/V)
            engine._ahead = engine.scheduler.schedule_ahead(in_flight=1)
        new = pending.get()  # waits for that step only
        now = time.perf_counter()
        got = []
        for seq, tok in zip(seqs, new):
            if seq.status is Status.FINISHED:  # aborted while its step ran
                continue
            seq.num_computed_tokens += 1
            engine._append(seq, tok, now)
            got.append(seq)
        return got

    def _can_look_ahead(self, seqs) -> bool:
        scheduler = self.engine.scheduler
        running = scheduler.running
        # a waiting prompt would join the next step, unless a swapped sequence holds the
        # queue (no prompt before it is back) and cannot come back yet
        admits = scheduler.waiting and not scheduler.swapped
        if admits or can_swap_in_now(scheduler) or len(running) != len(seqs):
            return False
        if any(a is not b for a, b in zip(running, seqs)):
            return False
        # a request that speculates proposes after its next token, which this launch hides
        speculation = self.engine.speculation
        if speculation is not None and speculation.wants(seqs):
            return False
        # after the step in flight each has one more token; the next must stay in bounds
        if any(len(s.output_ids) + 2 > s.params.max_new_tokens for s in seqs):
            return False
        # nor reach LongRoPE's boundary while short (the scheduler recomputes it first)
        switch = scheduler.long_rope
        if switch is not None and any(switch.stale(s, ahead=1) for s in seqs):
            return False
        return self.engine.cache.can_append([s.id for s in seqs], [1] * len(seqs))
