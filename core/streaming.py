"""``Engine.stream``'s deltas: what is new in one request's output since the last yield,
whoever stepped the engine meanwhile (another stream, a ``generate`` call)."""
from __future__ import annotations

from typing import Iterator

from .errors import RequestFailedError


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
        sent_tokens, sent_text = 0, ""
        try:
            while True:
                if not seq.finished:
                    engine.step()
                done = seq.finished  # read before yielding: others may finish it meanwhile
                if engine.tokenizer is None:
                    new = seq.output_ids[sent_tokens:]
                    sent_tokens += len(new)
                    if new:
                        yield new
                else:
                    text = seq.text if done or params.stop else engine._decode(seq.output_ids)
                    if not done:
                        text = held_back(text, params.stop)
                    if len(text) > len(sent_text) and text.startswith(sent_text):
                        delta, sent_text = text[len(sent_text):], text
                        yield delta
                if done:
                    break
        finally:  # the consumer stopped early (or failed): free this request only
            if not seq.finished:
                engine.scheduler.abort([seq])
        raise_failed([seq])


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
