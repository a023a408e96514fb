"""Continuous batching: admit waiting requests while the cache has room, else decode.

Each step is either a prefill of newly admitted sequences or one decode token for
running sequences; finished sequences leave (and free their cache) between steps, so
new requests join a running batch without waiting for it to drain; the running sequences'
decode tokens ride in the admission step too (one each), unless the admitted prompt
could replay a captured prefill graph (``prefill_alone``), which takes it alone. A prompt
longer than ``max_num_batched_tokens`` is prefilled in chunks of that size (its cache
reserved whole at admission), one chunk per step, and the decode tokens ride in each, so
the running sequences' tokens keep coming every step; where the cache cannot take both,
chunk steps and decode steps alternate. Waiting prompts that fit whole in what a chunk
leaves of the budget (its last, short chunk) join that step. The prompt samples its
first token after its last chunk.

When the cache runs short (a paged cache out of blocks, an offloaded one whose fast
pool cannot hold every running sequence at once) the decode step takes the running
sequences that fit, oldest first, and the others sit this step out (paused). Only when
none fits is the newest running sequence preempted by recompute: its cache is freed and
it goes back to the front of the waiting queue with its tokens so far, to be prefilled
again (prompt + output) when there is room. No request is ever dropped.
"""
from __future__ import annotations

import collections

import attrs

from .errors import InfergraftError
from .request import Sequence, Status


def default_batched_tokens(max_seq_len: int) -> int:
    """Tokens one prefill step feeds at most when ``max_num_batched_tokens`` is not given: a
    whole ``max_seq_len`` prompt, and no fewer than 2048 (the engine and the memory
    planner both use this, so the planned step is the one that runs)."""
    return max(max_seq_len, 2048)


class SchedulerError(InfergraftError, RuntimeError):
    """The cache refuses a sequence even with nothing else running (a backend bug)."""


@attrs.frozen
class Step:
    kind: str  # "prefill" | "decode"
    seqs: list
    # tokens each sequence feeds (decode: 1 each; prefill: a chunk or all, and 1 for each
    # decoding sequence riding along: one that is not ``prefilling``)
    counts: list


def tokens_of(seq: Sequence) -> list[int]:
    """What a prefill of ``seq`` feeds: its prompt, plus its output after a preemption."""
    return seq.prompt_ids + seq.output_ids


def step_tokens(step: Step) -> list[int]:
    """The token ids ``step`` feeds, sequence after sequence: a prefilling sequence's next
    ``count`` tokens, a decoding one's last sampled token."""
    tokens = []
    for s, n in zip(step.seqs, step.counts):
        if s.prefilling:
            done = s.num_computed_tokens
            tokens += tokens_of(s)[done:done + n]
        else:
            tokens.append(s.output_ids[-1])
    return tokens


class Scheduler:
    def __init__(self, cache, max_batch_size: int, max_num_batched_tokens: int):
        self.cache = cache
        self.max_batch_size = max_batch_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []  # in admission order (oldest first)
        self.num_preemptions = 0
        self.num_paused = 0  # sequence-steps sat out because the cache was short
        self._last_kind = None  # chunks alternate with decode steps when short of room
        # (admitted, counts) -> True where the step should run alone (set by the engine)
        self.prefill_alone = None

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def adopt(self, seq: Sequence) -> None:
        """Run a sequence whose cache is already filled (a fork of a running one)."""
        seq.status = Status.RUNNING
        self.running.append(seq)

    def has_room(self) -> bool:
        return len(self.running) < self.max_batch_size

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def last_kind(self) -> str | None:
        """The kind of the step scheduled last ("prefill", "decode"; None: nothing ran)."""
        return self._last_kind

    def schedule(self) -> Step | None:
        step = self._schedule()
        self._last_kind = step.kind if step else None
        return step

    def _schedule(self) -> Step | None:
        chunked = [s for s in self.running if s.prefilling]  # oldest first
        decoding = [s for s in self.running if not s.prefilling]
        if chunked:
            # the oldest prompt's next chunk (its cache was reserved at admission), with
            # the decode tokens riding along; when the cache cannot take both, chunk
            # steps and decode steps alternate
            seq = chunked[0]
            n = min(seq.num_prefill_tokens - seq.num_computed_tokens, self.max_num_batched_tokens)
            riders = self._riders(decoding, [seq], [n])
            alternate = not decoding or self._last_kind != "prefill"
            if riders or (alternate and self.cache.can_append([seq.id], [n])):
                return self._chunk_step(riders, seq, n)
        if not chunked:
            admitted, counts = self._admit()
            if admitted:
                self.running.extend(admitted)
                riders = self._riders(decoding, admitted, counts)
                return Step("prefill", riders + admitted, [1] * len(riders) + counts)
        if decoding:
            batch = self._decode_batch(decoding)
            if not batch:  # every decoding sequence was preempted: admit or chunk again
                return self._schedule()
            return Step("decode", batch, [1] * len(batch))
        if chunked:
            raise SchedulerError(f"the cache cannot take the next {n}-token chunk of "
                                 f"sequence {seq.id} (stats: {self.cache.stats()})")
        return None

    def _chunk_step(self, riders, seq, n) -> Step:
        """A chunk of ``seq`` (with ``riders``), and whole waiting prompts that fit in what
        the chunk leaves of ``max_num_batched_tokens`` (vLLM-style: running work first)."""
        base_ids = [s.id for s in riders] + [seq.id]
        base_counts = [1] * len(riders) + [n]
        admitted, counts = self._admit(self.max_num_batched_tokens - n, base_ids, base_counts)
        self.running.extend(admitted)
        return Step("prefill", riders + [seq] + admitted, base_counts + counts)

    def _riders(self, decoding, prefilling, counts) -> list[Sequence]:
        """The decoding sequences that feed their token in this prefill step (admitted
        prompts, or a chunk): all of them where the cache takes them too and the step
        need not run alone, else none. ``prefill_alone`` is asked about chunk steps too;
        the engine's answer for them is no (prefill graphs take fresh prompts only)."""
        solo = self.prefill_alone
        if not decoding or (solo is not None and solo(prefilling, counts)):
            return []
        ids = [s.id for s in decoding + prefilling]
        return decoding if self.cache.can_append(ids, [1] * len(decoding) + counts) else []

    def _admit(self, budget=None, base_ids=(), base_counts=()) -> tuple[list[Sequence], list[int]]:
        """Waiting prompts for a prefill step, oldest first, while the batch, the cache
        and the token budget take them; only the first of a step without ``base`` work
        (a chunk in progress) may be a chunk itself. ``budget``: tokens left for them."""
        admitted, counts = [], []
        whole_only = budget is not None
        budget = self.max_num_batched_tokens if budget is None else budget
        while self.waiting and len(self.running) + len(admitted) < self.max_batch_size:
            seq = self.waiting[0]
            n = seq.num_tokens
            if (admitted or whole_only) and sum(counts) + n > budget:
                break
            take = min(n, budget)
            if not self.cache.can_allocate(n):
                break
            self.cache.allocate(seq.id, n)
            ids = [*base_ids, *(s.id for s in admitted), seq.id]
            if not self.cache.can_append(ids, [*base_counts, *counts, take]):
                self.cache.free(seq.id)  # the step as a whole would not fit
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            seq.num_prefill_tokens, seq.num_computed_tokens = n, 0
            admitted.append(seq)
            counts.append(take)
        if whole_only:
            return admitted, counts
        # nothing runs and nothing was admitted: no later step would differ, so waiting
        # would spin forever (the cache refuses the prompt, or the step it would run)
        if not admitted and self.waiting and not self.running:
            n = self.waiting[0].num_tokens
            what = "sequence" if not self.cache.can_allocate(n) else "sequence's prefill step"
            raise SchedulerError(f"the cache cannot take a {n}-token {what} even with nothing "
                                 f"running (stats: {self.cache.stats()})")
        return admitted, counts

    def _decode_batch(self, decoding: list[Sequence]) -> list[Sequence]:
        if self.cache.can_append([s.id for s in decoding], [1] * len(decoding)):
            return decoding
        while True:
            batch = []
            for seq in decoding:  # oldest first; the rest pause for this step
                if self.cache.can_append([s.id for s in batch + [seq]], [1] * (len(batch) + 1)):
                    batch.append(seq)
            if batch:
                self.num_paused += len(decoding) - len(batch)
                return batch
            if len(self.running) == 1:
                raise SchedulerError(f"the cache cannot extend its only sequence by one token "
                                     f"(stats: {self.cache.stats()})")
            victim = self.running[-1]
            self.preempt(victim)
            decoding = [s for s in decoding if s is not victim]
            if not decoding:
                return []

    def preempt(self, seq: Sequence) -> None:
        """Recompute preemption: free the cache, requeue first, keep the tokens so far."""
        self.running.remove(seq)
        self.cache.free(seq.id)
        seq.status = Status.WAITING
        seq.num_prefill_tokens = seq.num_computed_tokens = 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        self.running.remove(seq)  # first: a sequence that is not running stays as it was
        seq.status, seq.finish_reason = Status.FINISHED, reason
        self.cache.free(seq.id)

    def abort(self, seqs) -> None:
        """Drop these requests (their caller gave up or failed); others keep running."""
        for seq in seqs:
            if seq in self.running:
                self.finish(seq, "abort")
            elif seq.status is not Status.FINISHED:
                if seq in self.waiting:
                    self.waiting.remove(seq)
                seq.status, seq.finish_reason = Status.FINISHED, "abort"
