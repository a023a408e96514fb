"""Callers sharing one engine: what is new in one request's output since a caller last
looked (``Deltas``: ``Engine.stream``'s and the asynchronous engine's), whoever stepped
the engine meanwhile; aborting requests; ``raise_failed``."""
from __future__ import annotations

import time
from typing import Iterator

from .errors import InvalidRequestError, RequestFailedError
from .request import Sequence, Status


class Deltas:
    """What is new in one request's output since the last ``advance()``: token ids (and
    their log-probabilities, when asked for) and text. Text holds back an incomplete
    UTF-8 character and a tail that may begin a stop string until the request finishes.
    ``decode``: token ids -> text (None: no tokenizer, no text). Call ``advance`` between
    steps (under ``Engine.lock`` when other threads may step)."""

    def __init__(self, seq, decode=None):
        self.seq, self.decode = seq, decode
        self.sent_tokens, self.sent_text = 0, ""

    def advance(self) -> tuple[list[int], list | None, str, bool]:
        """(new token ids, their logprobs or None, new text, finished)."""
        seq = self.seq
        done = seq.finished  # read first: what follows is complete up to it
        start, self.sent_tokens = self.sent_tokens, len(seq.output_ids)
        new = seq.output_ids[start:self.sent_tokens]
        logprobs = getattr(seq, "logprobs", None)
        logprobs = None if logprobs is None else logprobs[start:self.sent_tokens]
        delta = ""
        if self.decode is not None:
            stops = seq.params.stop
            text = seq.text if done or stops else self.decode(seq.output_ids)
            if not done:
                text = held_back(text, stops)
            if len(text) > len(self.sent_text) and text.startswith(self.sent_text):
                delta, self.sent_text = text[len(self.sent_text):], text
        return new, logprobs, delta, done


class RequestStream:
    """What ``Engine.stream`` returns: an iterator of text deltas (token-id lists without a
    tokenizer). The request is queued on the first ``next()``; from then ``request`` is its
    ``Sequence`` (output, finish reason, metrics). ``close()`` (or leaving the loop early)
    aborts it and frees its cache."""

    def __init__(self, engine, ids: list[int], params):
        self.request = None
        self._deltas = self._run(engine, ids, params)

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._deltas)

    def close(self) -> None:
        self._deltas.close()

    def _run(self, engine, ids, params) -> Iterator:
        seq = self.request = engine.add_request(ids, params)
        deltas = Deltas(seq, None if engine.tokenizer is None else engine._decode)
        try:
            while True:
                with engine.lock:  # one step, and its result read before another steps
                    if not seq.finished:
                        engine.step()
                    new, _, text, done = deltas.advance()
                if engine.tokenizer is None:
                    if new:
                        yield new
                elif text:
                    yield text
                if done:
                    break
        finally:  # the consumer stopped early (or failed): free this request only
            if not seq.finished:
                engine.abort(seq)
        raise_failed([seq])


def abort_requests(engine, seqs_or_ids, reason: str) -> list:
    """``Engine.abort``'s body (the caller holds ``engine.lock``)."""
    items = seqs_or_ids if isinstance(seqs_or_ids, (list, tuple, set)) else [seqs_or_ids]
    bad = [x for x in items if not isinstance(x, Sequence)
           and (not isinstance(x, int) or isinstance(x, bool))]
    if bad:
        raise InvalidRequestError(f"abort takes a Sequence (what add_request returns) or its "
                                  f"integer id, or a list of them; got {bad[0]!r}")
    scheduler = engine.scheduler
    known = {s.id: s for s in (*scheduler.running, *scheduler.waiting, *scheduler.swapped)}
    seqs = [x if isinstance(x, Sequence) else known.get(x) for x in items]
    seqs = [s for s in seqs if s is not None]
    seqs += [c for s in seqs for c in engine._forks.pop(s.id, ())]  # samples not forked yet
    seqs = [s for s in seqs if s.status is not Status.FINISHED]
    scheduler.abort(seqs)
    now = time.perf_counter()
    for s in seqs:
        s.finish_reason = reason
        s.metrics.finished = now
    return seqs


def raise_failed(seqs, completions=None) -> None:
    """RequestFailedError if any of ``seqs`` finished with an error (seq.error says why);
    ``completions`` (one per sequence, in order) travel with it as ``error.completions``."""
    failed = [s for s in seqs if s.finish_reason == "error"]
    if failed:
        why = failed[0].error or "sampling failed on the rank that samples"  # pipelines
        raise RequestFailedError(f"{len(failed)} of {len(seqs)} request(s) failed after "
                                 f"{len(failed[0].output_ids)} token(s): {why}; the others "
                                 "finished (error.completions holds every completion)",
                                 completions=completions)


def held_back(text: str, stops) -> str:
    """Hold back an incomplete UTF-8 character and any tail that may start a stop string."""
    text = text.rstrip("\ufffd")
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                return text[:-k]
    return text
