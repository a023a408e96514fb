"""The AsyncEngine's thread: the only one that steps the engine, and what it shares with
the callers (an ``Inbox`` under one condition).

Each loop iteration: 1) take the submissions and aborts queued since the last one, or
sleep on the condition while there is nothing to do; 2) under torchrun, broadcast them
from rank 0 (``lockstep``); 3) apply them to the engine; 4) step; 5) hand each request's
new tokens and text to its asyncio.Queue on its event loop (``call_soon_threadsafe``,
once per loop and iteration). The thread outlives any one request's failure: a request
whose sampling failed, or whose step raised, ends with finish_reason "error" and the
others go on; under torchrun a failed rank (RankFailedError) ends the loop: what runs
ends with "error" naming it, new requests are refused, ``Inbox.fatal`` says why.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Optional

import attrs
import torch

from ..errors import RankFailedError
from ..request import SamplingParams
from ..streaming import Deltas
from .lockstep import Events, apply, params_fields, prune
# (RequestOutput, coalesce and send are imported from here too)
from .outputs import RequestOutput, coalesce, last_output, send  # noqa: F401

log = logging.getLogger("infergraft.serving")
HEARTBEAT_S = 60.0  # an idle rank 0 broadcasts this often at most (Lockstep.heartbeat_s)


@attrs.define(eq=False)
class Submission:
    request_id: str
    ids: list
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float  # time.perf_counter() at submission: the wait for the loop is TTFT too
    seq: object = None  # its Sequence, once the loop has added it to the engine
    deltas: Optional[Deltas] = None


@attrs.define(eq=False)
class Inbox:
    """What the callers hand the loop, under ``cond``."""

    cond: threading.Condition = attrs.field(factory=threading.Condition)
    intake: list = attrs.field(factory=list)  # Submissions not yet taken by the loop
    aborts: list = attrs.field(factory=list)  # request ids
    taken: int = 0  # taken by the loop, not yet in the scheduler's waiting queue
    names: set = attrs.field(factory=set)  # request ids submitted and not finished
    stop: Optional[str] = None  # None, "drain" or "abort"
    fatal: Optional[str] = None  # why the loop stopped for good (a rank went away)


@attrs.define
class StepCounts:
    """Engine steps taken, the prefill steps among them, and the seconds spent in them:
    /metrics' ``infergraft_engine_*`` counters, and bench serve's offline run's."""

    num_steps: int = 0
    num_prefill_steps: int = 0
    step_seconds_total: float = 0.0

    def step(self, engine) -> None:
        """``engine.step()``, counted (a step that raises counts, untimed)."""
        self.num_steps += 1
        start = time.perf_counter()
        engine.step()
        self.step_seconds_total += time.perf_counter() - start
        self.num_prefill_steps += engine.scheduler.last_kind == "prefill"


class EngineThread:
    def __init__(self, engine, inbox: Inbox, link):
        self.engine, self.inbox, self.link = engine, inbox, link
        self.live: dict[str, Submission] = {}  # in the engine, by request id
        self.seqs: dict = {}  # request id -> Sequence (lockstep.apply's view of them)
        self.fail: list = []  # (request id, why) for the next broadcast
        self.prompt_tokens_total = self.generation_tokens_total = 0
        self.counts = StepCounts()
        self.heartbeat = link.heartbeat_s(HEARTBEAT_S) if link.active else None

    def run(self) -> None:
        # the current CUDA device is the thread's own, and Triton launches on it
        if self.engine.device.type == "cuda" and self.engine.device.index is not None:
            torch.cuda.set_device(self.engine.device)
        while True:
            try:
                events, taken = self._collect()
                events = self.link.exchange(events)
            except Exception as e:  # a rank went away: nothing can step any more
                return self._die(e)
            try:
                self._admit(events, taken)
                if events.shutdown:  # (after "abort": what ran ends with "abort")
                    return self._publish()
                if self.engine.has_unfinished():
                    self._step()
                self._publish()
            except RankFailedError as e:  # the process group is left: end what runs
                return self._die(e)
            except Exception as e:  # a bug of ours: fail what runs, keep serving
                log.exception("the engine loop failed an iteration")
                self._fail_requests(list(self.live.values()), e)
                self._publish()

    def _collect(self) -> tuple[Events, dict]:
        """Wait for work, then take what the callers queued as this iteration's events."""
        box, busy = self.inbox, self.engine.scheduler.has_work
        with box.cond:
            while not (box.intake or box.aborts or box.stop or busy()):
                if not box.cond.wait(self.heartbeat):
                    break  # idle under torchrun: an empty broadcast keeps the followers
            new, aborts, stop = box.intake, box.aborts, box.stop
            box.intake, box.aborts = [], []
            if stop == "abort":  # never admitted: they end here
                box.names.difference_update(r.request_id for r in new)
            else:
                box.taken = len(new)
        if stop == "abort":
            send([(r, last_output(r, "abort")) for r in new], self._abort_later)
            new, aborts = [], [*aborts, *self.live]
        fail, self.fail = self.fail, []
        shutdown = stop == "abort" or (stop == "drain" and not new and not self.live)
        events = Events(tuple((r.request_id, r.ids, params_fields(r.params)) for r in new),
                        tuple(aborts), tuple(fail), shutdown)
        return events, {r.request_id: r for r in new}

    def _admit(self, events: Events, taken: dict) -> None:
        admitted = apply(self.engine, events, self.seqs)
        with self.inbox.cond:
            self.inbox.taken = 0
        tok = self.engine.tokenizer
        for rid, seq in admitted.items():
            req = taken[rid]
            if isinstance(seq, Exception):  # validated at submission: not expected
                self._end_unadmitted(req, str(seq))
                continue
            seq.metrics.arrival = req.arrival
            req.seq, req.deltas = seq, Deltas(seq, None if tok is None else self.engine._decode)
            self.live[rid] = req

    def _step(self) -> None:
        engine = self.engine
        try:
            self.counts.step(engine)
        # The engine preempted the step's sequences (they would be recomputed): end them
        # with "error" instead, so that a step that fails every time cannot loop forever.
        # A scheduler that raised ran no sequence: then every request ends.
        except RankFailedError:
            raise
        except Exception as e:
            log.exception("an engine step failed; its requests end with finish_reason 'error'")
            hit = set(map(id, engine._stepping))
            self._fail_requests([r for r in self.live.values()
                                 if not hit or id(r.seq) in hit], e)

    def _fail_requests(self, reqs: list, error: Exception) -> None:
        why = f"the engine step failed: {type(error).__name__}: {error}"
        for req in reqs:
            if req.seq is not None and not req.seq.finished:
                req.seq.error = why
                self.engine.abort(req.seq, reason="error")
                self.fail.append((req.request_id, why))  # the followers do the same

    def _publish(self) -> None:
        """Each request's new tokens and text (and its end) to its queue."""
        outs, done = [], []
        with self.engine.lock:  # another thread's generate may step the engine too
            for rid, req in self.live.items():
                seq = req.seq
                if not seq.finished and len(seq.output_ids) == req.deltas.sent_tokens:
                    continue
                first = req.deltas.sent_tokens == 0
                ids, logprobs, text, finished = req.deltas.advance()
                if first and ids:  # prefilled
                    self.prompt_tokens_total += len(seq.prompt_ids)
                self.generation_tokens_total += len(ids)
                reason = seq.finish_reason if finished else None
                error = (seq.error or "sampling failed on the rank that samples") \
                    if reason == "error" else None
                outs.append((req, RequestOutput(
                    rid, text, ids, logprobs, finished, reason, len(seq.prompt_ids),
                    len(seq.output_ids), seq.metrics if finished else None, error,
                    seq.num_cached_tokens)))
                if finished:
                    done.append(rid)
        for rid in done:
            del self.live[rid]
        prune(self.seqs)
        if done:
            with self.inbox.cond:
                self.inbox.names.difference_update(done)
        send(outs, self._abort_later)

    def _end_unadmitted(self, req: Submission, why: str) -> None:
        with self.inbox.cond:
            self.inbox.names.discard(req.request_id)
        send([(req, last_output(req, "error", why))], self._abort_later)

    def _abort_later(self, request_id: str) -> None:
        with self.inbox.cond:
            self.inbox.aborts.append(request_id)
            self.inbox.cond.notify()

    def _die(self, error: Exception) -> None:
        # a RankFailedError's message names the rank; anything else: its traceback too
        log.error("the engine loop stopped: %s", error,
                  exc_info=not isinstance(error, RankFailedError))
        why = f"the engine loop stopped: {type(error).__name__}: {error}"
        with self.inbox.cond:
            self.inbox.fatal = why
            reqs = [*self.inbox.intake, *self.live.values()]
            self.inbox.intake = []
        for req in reqs:
            if req.seq is not None and not req.seq.finished:
                self.engine.abort(req.seq, reason="error")
            self._end_unadmitted(req, why)


def refusal(engine, box: Inbox, max_waiting: int) -> str | None:
    """Why a new request is refused now (under ``box.cond``): a shutdown, a dead loop, or
    ``max_waiting`` requests accepted and not yet running; None if it is accepted."""
    if box.stop is not None or box.fatal is not None:
        return box.fatal or "the server is shutting down"
    waiting = len(box.intake) + box.taken + len(engine.scheduler.waiting)
    if waiting >= max_waiting:
        return f"{waiting} requests are waiting already (max_waiting={max_waiting})"
    return None


def engine_stats(engine, inbox: Inbox, loop: EngineThread) -> dict:
    """Gauges and counters for /metrics (waits for the step in progress, if any), with
    ``engine.stats()``'s K/V memory: prefix-cache queries and hits, blocks, preemptions."""
    with engine.lock:  # re-entrant: engine.stats() takes it again, in the same step
        cache, kv = engine.cache.stats(), engine.stats()
    waiting = kv.pop("num_waiting")
    with inbox.cond:
        waiting += len(inbox.intake) + inbox.taken
    if cache.get("blocks_total"):
        usage = cache["blocks_used"] / cache["blocks_total"]
    else:  # a row per sequence
        usage = cache["sequences"] / engine.plan.max_batch_size
    return {"requests_running": kv.pop("num_running"), "requests_waiting": waiting,
            "kv_cache_usage_ratio": min(1.0, float(usage)),
            "prompt_tokens_total": loop.prompt_tokens_total,
            "generation_tokens_total": loop.generation_tokens_total,
            **kv, **attrs.asdict(loop.counts)}
