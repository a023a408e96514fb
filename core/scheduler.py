"""Continuous batching with token-budget steps (DeepSpeed-FastGen's Dynamic SplitFuse,
vLLM's chunked prefill).

Every step carries at most ``max_num_batched_tokens`` tokens: first the running
sequences, oldest first (one token for each decoding sequence, the next chunk of a prompt
still prefilling), then waiting prompts while the budget, the batch and the cache take
them. A prompt longer than what the budget leaves is split: its first chunk fills the
step and the rest follow in later steps (its cache is reserved whole at admission), so
long prompts are fed in pieces and short ones fused, and the decoding sequences' tokens
keep coming every step. A prompt samples its first token after its last chunk.

Running sequences left out of a step (for the budget or for the cache) go first in the
next one (those that ran longest ago first), so none waits behind the others for long.
When the cache runs short (a paged cache out of blocks, an offloaded one whose fast pool
cannot hold every running sequence at once) the step takes the running sequences that fit
and the others sit it out (paused), and no prompt is admitted. Only when none fits is the
newest one preempted, the cheaper way (``preemption.py``): swapped out (its K/V to host
memory, back before any prompt is admitted: ``swap_schedule.py``) or recomputed (its cache
freed, requeued first with its tokens so far, to be prefilled again). No request is dropped.

A request whose grammar compiles (``ready``) is prefilled but for its last prompt token
(whose logits take the grammar's first mask), then sits out the steps until it is ready:
a compile hides behind the prefill; it is waited for only when nothing else can run.
"""
from __future__ import annotations

import collections
import itertools

from .cache import CacheFullError, KVCache
from .errors import InfergraftError
from .long_rope import recompute_at_boundary, recompute_due
from .request import Sequence, Status
# (Step, step_tokens: imported from here too)
from .step import Step, counts_needed, step_of, step_tokens, tokens_of  # noqa: F401
from .swap_schedule import RECOMPUTE, can_swap_in_now, drop_waiting, preempt_newest, swap_in_ready

#: tokens one step carries at most when ``max_num_batched_tokens`` is not given (the
#: engine and the memory planner both use it, so the planned step is the one that runs;
#: a longer prompt is chunked). Not yet chosen from an H200 sweep: the old default's floor.
DEFAULT_BATCHED_TOKENS = 2048


class SchedulerError(InfergraftError, RuntimeError):
    """The cache refuses a sequence even with nothing else running (a backend bug)."""


class Scheduler:
    def __init__(self, cache, max_batch_size: int, max_num_batched_tokens: int):
        self.cache = cache
        self.max_batch_size = max_batch_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []  # in admission order (oldest first)
        self.swapped: list[Sequence] = []  # preempted by swap, the oldest request first
        self.preemption = RECOMPUTE  # how to preempt (core.build gives its own policy)
        self.num_preemptions = 0  # num_swapped_out + num_recomputed
        self.num_swapped_out = 0  # preemptions whose blocks went to host memory
        self.num_recomputed = 0  # preemptions whose cache was freed, to prefill again
        self.prefix_cache_queries = self.prefix_cache_hits = 0  # prompt tokens looked up / found
        self.num_paused = 0  # sequence-steps sat out because the cache was short
        # running sequence id -> when it last ran (a tick per sequence run: ties never)
        self._ticks = itertools.count()
        self._last_ran: dict[int, int] = {}
        self._last_kind = None
        self.long_rope = None  # core.long_rope.LongRopeSwitch: LongRoPE's two tables (build())
        # whether a waiting sequence can run now, and a wait until it can (the engine's:
        # a request whose grammar compiles is held while the others run)
        self.ready = lambda seq: True
        self.wait_ready = lambda seq: None

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def adopt(self, seq: Sequence) -> None:
        """Run a sequence whose cache is already filled (a fork of a running one)."""
        seq.status = Status.RUNNING
        self.running.append(seq)
        self._last_ran[seq.id] = next(self._ticks)

    def has_room(self) -> bool:
        return len(self.running) < self.max_batch_size

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    @property
    def last_kind(self) -> str | None:
        """The kind of the step scheduled last ("prefill", "decode"; None: nothing ran)."""
        return self._last_kind

    def schedule(self) -> Step | None:
        step = self._schedule()
        self._last_kind = step.kind if step else None
        return step

    def schedule_ahead(self, in_flight: int = 0) -> Step | None:
        """The next step, scheduled while this one runs (its tokens not yet sampled; its
        counts fed, or ``in_flight`` tokens a sequence not yet counted: the decode
        look-ahead's), or None where the cache is short, a swapped sequence could come
        back or LongRoPE's recompute is due: pausing, preempting, swapping in,
        recomputing see the step's outcome. Admits as ``schedule`` does; ``resume`` takes
        the step once this one is done."""
        if can_swap_in_now(self) or recompute_due(self, in_flight):  # ``schedule`` runs those
            return None
        seqs, counts, short = self._running_part()
        return None if short or not seqs else self._take(seqs, counts, admit=not self.swapped)

    def resume(self, step: Step) -> Step | None:
        """``step`` (from ``schedule_ahead``) without the sequences that finished since (a
        stop token, an abort): the step to run now, or None when none is left or the cache
        no longer takes it (a fork took a block meanwhile): then ``schedule`` again."""
        kept = [(s, n) for s, n in zip(step.seqs, step.counts) if s.status is Status.RUNNING]
        if not kept:
            return None
        seqs, counts = (list(x) for x in zip(*kept))
        if not self.cache.can_append([s.id for s in seqs], counts):
            return None
        step = step_of(seqs, counts)
        self._last_kind = step.kind
        return step

    def _schedule(self) -> Step | None:
        swap_in_ready(self)  # swapped sequences come back first, where there is room
        recompute_at_boundary(self)  # LongRoPE: short sequences reaching it prefilled again
        while True:
            seqs, counts, short = self._running_part()
            # a cache that refused a running sequence, or owes a swapped one, takes no prompt
            step = self._take(seqs, counts, admit=not short and not self.swapped)
            if step.seqs:
                self.num_paused += short
                return step
            held = next((s for s in self.running if self._needed(s) == 0), None)
            if held is None and not self.running:
                held = next((s for s in self.waiting if not self.ready(s)), None)
            if held is not None:  # nothing else can run: wait for its grammar
                self.wait_ready(held)
                continue
            if not self.running:
                return self._nothing_fits()
            if len(self.running) == 1:
                raise SchedulerError(f"the cache cannot extend its only sequence by "
                                     f"{counts_needed(self.running[0])} token(s) "
                                     f"(stats: {self.cache.stats()})")
            preempt_newest(self)  # none fits: the newest makes room

    def _take(self, seqs, counts, admit: bool = True) -> Step:
        """The step of these running sequences and (``admit``) the waiting prompts that
        fit beside them; every sequence of it counts as run now."""
        if admit:
            admitted, more = self._admit(seqs, counts)
            seqs, counts = seqs + admitted, counts + more
        self._last_ran.update((s.id, next(self._ticks)) for s in seqs)
        return step_of(seqs, counts)

    def _running_part(self) -> tuple[list[Sequence], list[int], int]:
        """The running sequences this step takes (those that ran longest ago first, then
        oldest first), their counts, and how many the cache refused."""
        order = sorted(self.running, key=lambda s: self._last_ran[s.id])
        needs = [(s, n) for s in order if (n := self._needed(s))]  # (0: held for a grammar)
        seqs, counts, budget = [], [], self.max_num_batched_tokens
        for s, n in needs:  # what the budget takes, asking the cache once (O(B), not O(B^2))
            if budget == 0:
                break
            seqs.append(s)
            counts.append(min(n, budget))
            budget -= counts[-1]
        if self.cache.can_append([s.id for s in seqs], counts):
            return seqs, counts, 0
        # the cache is short: sequence by sequence, those that fit
        budget, seqs, counts, short = self.max_num_batched_tokens, [], [], 0
        for s, n in needs:
            if budget == 0:
                break
            n = min(n, budget)
            if self.cache.can_append([*(x.id for x in seqs), s.id], [*counts, n]):
                seqs.append(s)
                counts.append(n)
                budget -= n
            else:
                short += 1
        return seqs, counts, short

    def _needed(self, seq: Sequence) -> int:
        """``counts_needed``, less a prompt's last token while its grammar compiles (that
        token's logits take the grammar's first mask)."""
        n = counts_needed(seq)
        return n - 1 if seq.prefilling and not self.ready(seq) else n

    def _admit(self, base: list[Sequence], base_counts: list[int]):
        """Waiting prompts, oldest first, while the batch, the cache and what ``base``
        leaves of the token budget take them; the last one may be a first chunk."""
        admitted, counts, held = [], [], []
        budget = self.max_num_batched_tokens - sum(base_counts)
        while self.waiting and budget > 0 and \
                len(self.running) + len(admitted) < self.max_batch_size:
            seq = self.waiting[0]
            compiling = not self.ready(seq)  # (its grammar: prefilled but for a token)
            if compiling and seq.num_tokens < 2:
                held.append(self.waiting.popleft())
                continue
            n = seq.num_tokens
            cached = allocate(self.cache, seq)
            if cached is None:
                break
            if compiling and cached >= n - 1:  # all but its last token cached: no work yet
                self.cache.free(seq.id)
                held.append(self.waiting.popleft())
                continue
            self.waiting.popleft()
            seq.status = Status.RUNNING
            seq.num_prefill_tokens, seq.num_computed_tokens = n, cached
            admitted.append(seq)
            counts.append(min(n - cached - compiling, budget))
            budget -= counts[-1]
        # the step as a whole must fit too: asked once, and where it does not, the newest
        # admissions go back (the same prompts as asking after each, at O(B) not O(B^2))
        ids = [s.id for s in base]
        while admitted and not self.cache.can_append([*ids, *(s.id for s in admitted)],
                                                     [*base_counts, *counts]):
            seq = admitted.pop()
            counts.pop()
            self.cache.free(seq.id)
            seq.status = Status.WAITING
            seq.num_prefill_tokens = seq.num_computed_tokens = 0
            self.waiting.appendleft(seq)
        self.waiting.extendleft(reversed(held))  # (their places kept)
        self.running.extend(admitted)
        for s in admitted:  # those that stay (the ones sent back above are not admitted)
            s.count_admission(s.num_computed_tokens)
        self.prefix_cache_queries += sum(s.num_prefill_tokens for s in admitted)
        self.prefix_cache_hits += sum(s.num_computed_tokens for s in admitted)
        return admitted, counts

    def _nothing_fits(self) -> None:
        """Nothing runs and nothing was admitted: no later step would differ, so waiting
        would spin forever (the cache refuses the prompt, or the step it would run)."""
        if not (self.waiting or self.swapped):
            return None
        n = (self.swapped or self.waiting)[0].num_tokens  # the first in line
        what = "swapped-out sequence" if self.swapped else "sequence" \
            if not self.cache.can_allocate(n) else "sequence's prefill step"
        raise SchedulerError(f"the cache cannot take a {n}-token {what} even with nothing "
                             f"running (stats: {self.cache.stats()})")

    def stats(self) -> dict:
        """Prefix-cache queries / hits (prompt tokens looked up / found), K/V blocks total
        and free, preemptions (swapped out + recomputed), requests running and waiting (or
        swapped out): what ``Engine.stats()`` returns and the server exports."""
        cache = self.cache.stats()
        return {"prefix_cache_queries": self.prefix_cache_queries,
                "prefix_cache_hits": self.prefix_cache_hits,
                "kv_blocks_total": cache.get("blocks_total", 0),
                "kv_blocks_free": cache.get("blocks_free", 0),
                "num_preemptions": self.num_preemptions,
                "num_swapped_out": self.num_swapped_out, "num_recomputed": self.num_recomputed,
                "num_running": len(self.running),
                "num_waiting": len(self.waiting) + len(self.swapped)}

    def preempt(self, seq: Sequence, failed: bool = False, counted: bool = True) -> None:
        """Recompute preemption: free the cache (``failed``: none of it reused), requeue
        (``counted`` as a preemption: LongRoPE's recompute at its boundary is none)."""
        self.running.remove(seq)
        free = getattr(self.cache, "discard", self.cache.free) if failed else self.cache.free
        free(seq.id)
        self._last_ran.pop(seq.id, None)
        seq.status = Status.WAITING
        seq.num_prefill_tokens = seq.num_computed_tokens = 0
        self.waiting.appendleft(seq)
        if counted:
            self.num_preemptions += 1
            self.num_recomputed += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        self.running.remove(seq)  # first: a sequence that is not running stays as it was
        self._last_ran.pop(seq.id, None)
        seq.status, seq.finish_reason = Status.FINISHED, reason
        if reason != "error" and hasattr(self.cache, "key_tokens"):  # the next turn's prefix
            self.cache.key_tokens(seq.id, tokens_of(seq))
        self.cache.free(seq.id)

    def abort(self, seqs) -> None:
        """Drop these requests (their caller gave up or failed); others keep running."""
        for seq in seqs:
            if seq in self.running:
                self.finish(seq, "abort")
            elif seq.status is not Status.FINISHED:
                drop_waiting(self, seq)  # from the waiting queue, or swapped out
                seq.status, seq.finish_reason = Status.FINISHED, "abort"


def allocate(cache, seq: Sequence) -> int | None:
    """Allocate ``seq`` in ``cache``: how many leading tokens it holds already (a cached
    prefix), or None when there is no room. A cache that does not derive from KVCache
    may lack ``allocate_cached``: the contract's default (no prefix cache) serves it."""
    allocate_cached = getattr(type(cache), "allocate_cached", KVCache.allocate_cached)
    try:
        return allocate_cached(cache, seq.id, tokens_of(seq))
    except CacheFullError:
        return None
