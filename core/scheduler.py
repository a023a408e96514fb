"""Continuous batching: admit waiting requests while the cache has room, else decode.

Each step is either a prefill of newly admitted sequences or one decode token for
every running sequence; finished sequences leave (and free their cache) between steps,
so new requests join a running batch without waiting for it to drain.
"""
from __future__ import annotations

import collections

import attrs

from .request import Sequence, Status


@attrs.frozen
class Step:
    kind: str  # "prefill" | "decode"
    seqs: list


class Scheduler:
    def __init__(self, cache, max_batch_size: int, max_prefill_tokens: int):
        self.cache = cache
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Step | None:
        admitted, tokens = [], 0
        while self.waiting and len(self.running) + len(admitted) < self.max_batch_size:
            seq = self.waiting[0]
            n = len(seq.prompt_ids)
            if admitted and tokens + n > self.max_prefill_tokens:
                break
            if not self.cache.can_allocate(n):
                break
            self.cache.allocate(seq.id, n)
            self.waiting.popleft()
            seq.status = Status.RUNNING
            admitted.append(seq)
            tokens += n
        if admitted:
            self.running.extend(admitted)
            return Step("prefill", admitted)
        if self.running:
            return Step("decode", list(self.running))
        return None

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status, seq.finish_reason = Status.FINISHED, reason
        self.running.remove(seq)
        self.cache.free(seq.id)

    def abort_all(self) -> None:
        """Drop every request (after an unexpected error) so the engine stays usable."""
        for seq in list(self.running):
            self.finish(seq, "abort")
        for seq in self.waiting:
            seq.status, seq.finish_reason = Status.FINISHED, "abort"
        self.waiting.clear()
