"""What a request's consumer receives from the engine's loop: ``RequestOutput``s, merged
when the consumer lags (``coalesce``), handed to each asyncio queue on its own event loop
(``send``)."""
from __future__ import annotations

from typing import Optional

import attrs

from ..metrics import RequestMetrics


@attrs.frozen
class RequestOutput:
    """What one request produced since its previous output."""

    request_id: str
    text: str  # new text (stop strings trimmed; an incomplete UTF-8 character held back)
    token_ids: list  # new token ids
    logprobs: Optional[list]  # TokenLogprob per new id, when the request asked for them
    finished: bool
    finish_reason: Optional[str]  # "stop", "length", "abort", "error" once finished
    prompt_tokens: int
    completion_tokens: int  # so far
    metrics: Optional[RequestMetrics] = None  # on the last output
    error: Optional[str] = None  # why, when finish_reason is "error"
    # prompt tokens whose K/V came from the prefix cache (known from the first output on)
    num_cached_tokens: int = 0


def coalesce(out: RequestOutput, queue) -> RequestOutput:
    """``out`` and the outputs its queue holds already, as one: a consumer that lags (the
    HTTP side streaming hundreds of requests) gets fewer, larger outputs instead of a
    backlog, as vLLM's output collector merges them."""
    while not out.finished and not queue.empty():
        nxt = queue.get_nowait()
        lp = None if out.logprobs is None and nxt.logprobs is None else \
            [*(out.logprobs or ()), *(nxt.logprobs or ())]
        out = attrs.evolve(nxt, text=out.text + nxt.text,
                           token_ids=[*out.token_ids, *nxt.token_ids], logprobs=lp)
    return out


def last_output(req, reason: str, error: str | None = None) -> RequestOutput:
    """The output that ends a request the engine never ran."""
    return RequestOutput(req.request_id, "", [], None, True, reason, len(req.ids), 0,
                         error=error)


def send(outs: list, abort) -> None:
    """(Submission, RequestOutput) pairs to their queues, one hand-over per event loop;
    ``abort(request_id)`` for a request whose event loop has closed. Anything with
    ``loop`` and ``queue`` stands for a Submission; an item may be an exception (a refusal)."""
    by_loop: dict = {}
    for req, out in outs:
        by_loop.setdefault(req.loop, []).append((req.queue, out))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # its event loop is closed: nobody reads these any more
            for _, out in items:
                if isinstance(out, RequestOutput) and not out.finished:
                    abort(out.request_id)


def _put_all(items) -> None:
    for queue, out in items:
        queue.put_nowait(out)
