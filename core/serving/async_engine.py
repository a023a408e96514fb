"""AsyncEngine: one background thread steps an ``Engine`` while any number of asyncio
callers submit requests and read their outputs as they come.

    async with AsyncEngine(engine, max_waiting=256) as aengine:
        async for out in aengine.generate("Hello", SamplingParams(max_new_tokens=8)):
            print(out.text, end="")        # a RequestOutput: the text since the last one

``AsyncEngine.build(model, ...)`` builds the engine on the thread that will step it, as
``infergraft serve`` does: on the CPU, OpenMP gives each thread that runs torch ops its own
pool of workers, and a thread that steps an engine built by another runs beside the
builder's idle pool, more threads than cores, where OpenMP's barriers stop spinning and
sleep (docs/BENCHMARKS.md, "Serving").

The thread and what it shares with the callers: ``engine_thread``; under torchrun with
tp / pp, rank 0 runs the AsyncEngine and the other ranks ``AsyncEngine.follow(engine)``
(``lockstep``: every rank's scheduler sees the same requests in the same order). A rank
that fails there ends the loop (``failed`` says why); a shutdown then waits no longer
than the collective timeout for a step stuck in a collective.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import threading
import time

from ..cpu_threads import use_cores
from ..distributed.failure import CENSUS_S, group_timeout
from ..errors import InfergraftError, InvalidRequestError
from ..prompt import check_request
from ..request import SamplingParams
from .engine_thread import EngineThread, Inbox, Submission, engine_stats, refusal
from .lockstep import Lockstep, follow
from .outputs import RequestOutput, coalesce

__all__ = ["AsyncEngine", "QueueFullError", "RequestOutput"]
_ids = itertools.count()


class QueueFullError(InfergraftError, RuntimeError):
    """``max_waiting`` requests wait already, or the engine is shutting down (HTTP 503)."""


class AsyncEngine:
    """Serve ``engine`` to asyncio callers; ``max_waiting``: requests accepted and not yet
    running at most (QueueFullError beyond). Once it is started, only its thread may
    step the engine under torchrun; in one process other threads may share it too."""

    def __init__(self, engine, max_waiting: int = 256):
        _check_max_waiting(max_waiting)
        self.engine, self.max_waiting = engine, max_waiting
        link = Lockstep(engine)
        if link.rank != 0:
            raise InvalidRequestError(f"rank {link.rank} runs AsyncEngine.follow(engine); the "
                                      "AsyncEngine runs on rank 0")
        self._inbox = Inbox()
        self._loop = EngineThread(engine, self._inbox, link)
        self._thread: threading.Thread | None = None
        # on the CPU: one core for the callers' event loop, beside the thread stepping
        use_cores(engine.plan.device, busy_threads=2)

    @classmethod
    def build(cls, model, *, max_waiting: int = 256, **build_kwargs) -> "AsyncEngine":
        """``core.build(model, **build_kwargs)`` on a new thread that then steps it: the
        started AsyncEngine (blocks until it is built; what build raises is raised here)."""
        from ..build import build

        _check_max_waiting(max_waiting)  # before the model loads
        built = concurrent.futures.Future()

        def build_then_serve():
            try:
                aengine = cls(build(model, **build_kwargs), max_waiting=max_waiting)
                aengine._thread = threading.current_thread()
            except BaseException as e:
                built.set_exception(e)
                return
            built.set_result(aengine)
            aengine._loop.run()

        threading.Thread(target=build_then_serve, daemon=True, name="infergraft-engine").start()
        return built.result()

    @property
    def failed(self) -> str | None:
        """Why the loop stopped for good (under torchrun: a rank failed, named here), or
        None while it serves."""
        with self._inbox.cond:
            return self._inbox.fatal

    @property
    def num_steps(self) -> int:
        """Engine steps taken (under torchrun: what each follower's ``follow`` returns)."""
        return self._loop.counts.num_steps

    async def start(self) -> None:
        self._start()

    async def __aenter__(self) -> "AsyncEngine":
        self._start()
        return self

    async def __aexit__(self, exc_type, *exc) -> None:
        await self.shutdown(drain=exc_type is None)

    def _start(self) -> None:
        with self._inbox.cond:
            if self._thread is None and self._inbox.stop is None:
                self._thread = threading.Thread(target=self._loop.run, daemon=True,
                                                name="infergraft-engine")
                self._thread.start()

    async def generate(self, prompt, params: SamplingParams | None = None,
                       request_id: str | None = None):
        """Outputs of one request as they come (an async generator). A bad prompt or
        parameters raise InvalidRequestError, a full queue or a shutdown QueueFullError,
        before the first output; leaving early (``break``, ``aclose()``, a cancelled
        task) aborts the request at the next step and frees its cache."""
        req = self._submit(prompt, params, request_id)
        finished = False
        try:
            while not finished:
                out = coalesce(await req.queue.get(), req.queue)
                finished = out.finished
                yield out
        finally:
            if not finished:
                self._abort(req.request_id)

    async def abort(self, request_id: str) -> None:
        """Abort a request at the next step (an unknown or finished one: nothing happens)."""
        self._abort(request_id)

    async def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop accepting requests; ``drain``: let those accepted finish (for up to
        ``timeout`` seconds), else (or after it) abort them with finish_reason "abort".
        Under torchrun the followers' ``follow`` returns too."""
        box = self._inbox
        with box.cond:
            box.stop = "abort" if not drain or box.stop == "abort" else "drain"
            box.cond.notify_all()
            thread = self._thread
        if thread is None:
            return
        await asyncio.to_thread(thread.join, timeout)
        if thread.is_alive():  # still draining after ``timeout``
            with box.cond:
                box.stop = "abort"
                box.cond.notify_all()
            # a step stuck in a collective fails by the timeout (then its census)
            timeout = group_timeout() if self._loop.link.active else None
            await asyncio.to_thread(thread.join, None if timeout is None else
                                    timeout.total_seconds() + CENSUS_S + 5)

    def stats(self) -> dict:
        """Gauges and counters for /metrics (waits for the step in progress, if any)."""
        return engine_stats(self.engine, self._inbox, self._loop)

    @staticmethod
    def follow(engine) -> int:
        """Ranks other than 0 under torchrun: step with rank 0's AsyncEngine until it shuts
        down (blocking); returns the steps taken."""
        return follow(engine)

    def _submit(self, prompt, params, request_id) -> Submission:
        box = self._inbox
        rid, ids, params = checked_request(self.engine, prompt, params, request_id)
        req = Submission(rid, ids, params, asyncio.get_running_loop(), asyncio.Queue(),
                         time.perf_counter())
        with box.cond:
            why = refusal(self.engine, box, self.max_waiting)
            if why is not None:
                raise QueueFullError(why)
            if rid in box.names:
                raise InvalidRequestError(f"request_id {rid!r} is running already: give "
                                          "each running request its own id")
            box.names.add(rid)
            box.intake.append(req)
            box.cond.notify()
        self._start()
        return req

    def _abort(self, request_id: str) -> None:
        with self._inbox.cond:
            self._inbox.aborts.append(request_id)
            self._inbox.cond.notify()


def checked_request(engine, prompt, params, request_id) -> tuple[str, list, SamplingParams]:
    """(request id, prompt ids, params) of a submission to ``engine`` (an Engine, or what
    EngineProcess has of one), or the InvalidRequestError that names what is wrong."""
    params = SamplingParams() if params is None else params
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError(f"params must be a core.SamplingParams (or None), got "
                                  f"{type(params).__name__}")
    ids = engine.encode(prompt)
    check_request(ids, params, engine.plan.max_seq_len, engine.spec, engine.tokenizer)
    rid = f"req-{next(_ids)}" if request_id is None else request_id
    if not isinstance(rid, str) or not rid:
        raise InvalidRequestError(f"request_id must be a non-empty string, got {rid!r}")
    return rid, ids, params


def _check_max_waiting(max_waiting) -> None:
    if not isinstance(max_waiting, int) or isinstance(max_waiting, bool) or max_waiting < 1:
        raise InvalidRequestError(f"max_waiting must be an integer >= 1, got {max_waiting!r}")
