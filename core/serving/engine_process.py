"""EngineProcess: the AsyncEngine's interface over an engine stepping in a process of its
own (engine_worker.py), which ``infergraft serve`` uses outside torchrun.

In one process the HTTP side's Python (a few tens of microseconds a streamed token) and
the engine's (scheduling, launching the next step) take turns on one interpreter lock,
and on a GPU the step waits for it: at batch 64 the server then ran at half the engine's
speed (docs/BENCHMARKS.md, "Serving"). Here the worker's loop has its interpreter to
itself; what crosses the pipe is one message per step: that step's RequestOutputs.

    aengine = EngineProcess.launch("smollm2-135m", max_waiting=256, max_batch_size=16)
    async for out in aengine.generate("Hello", SamplingParams(max_new_tokens=8)): ...
    await aengine.shutdown()
"""
from __future__ import annotations

import asyncio
import multiprocessing
import threading
import time
from typing import NamedTuple

from ..errors import InfergraftError, InvalidRequestError
from ..request import SamplingParams
from .async_engine import QueueFullError, _check_max_waiting, checked_request
from .engine_thread import RequestOutput, coalesce, send
from .engine_worker import worker_main


class EngineProcessError(InfergraftError, RuntimeError):
    """The engine process exited before its engine was built (no error came back)."""


class Target(NamedTuple):
    """Where a request's outputs go: what engine_thread.send needs of a Submission."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class EngineProcess:
    def __init__(self, process, conn, view, stats: dict, max_waiting: int):
        self.process, self.conn, self.engine = process, conn, view
        self.max_waiting = max_waiting
        self._stats, self._send_lock = stats, threading.Lock()
        self._live: dict[str, tuple] = {}  # request id -> (its event loop, its queue)
        self._live_lock = threading.Lock()
        self._stopping = False
        self._fatal: str | None = None
        self._reader = threading.Thread(target=self._read, daemon=True,
                                        name="infergraft-engine-pipe")
        self._reader.start()

    @classmethod
    def launch(cls, model, *, max_waiting: int = 256, **build_kwargs) -> "EngineProcess":
        """Start the engine process on ``core.build(model, **build_kwargs)`` (``model``: a
        directory or an alias) and wait until it is built; what the build raises is raised
        here."""
        _check_max_waiting(max_waiting)
        ctx = multiprocessing.get_context("spawn")  # CUDA cannot cross a fork
        conn, child = ctx.Pipe()
        process = ctx.Process(target=worker_main, args=(child, model, build_kwargs, max_waiting),
                              daemon=True, name="infergraft-engine")
        process.start()
        child.close()
        try:
            message = conn.recv()
        except EOFError:
            process.join()
            raise EngineProcessError(f"the engine process exited with code "
                                     f"{process.exitcode} before it was built") from None
        if message[0] == "failed":
            process.join()
            raise message[1]
        _, view, stats = message
        return cls(process, conn, view, stats, max_waiting)

    @property
    def num_steps(self) -> int:
        return self._stats.get("num_steps", 0)

    async def start(self) -> None:
        """(It steps from its launch; AsyncEngine's interface.)"""

    async def generate(self, prompt, params: SamplingParams | None = None,
                       request_id: str | None = None):
        """As AsyncEngine.generate: outputs as they come; refusals before the first one;
        leaving early aborts the request at the next step."""
        rid, queue = self._submit(prompt, params, request_id)
        finished = False
        try:
            while not finished:
                out = await queue.get()
                if isinstance(out, Exception):  # refused: the only item its queue gets
                    finished = True
                    raise out
                out = coalesce(out, queue)
                finished = out.finished
                yield out
        finally:
            with self._live_lock:
                self._live.pop(rid, None)
            if not finished:
                self._post(("abort", rid))

    async def abort(self, request_id: str) -> None:
        self._post(("abort", request_id))

    async def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """As AsyncEngine.shutdown; then the engine process exits."""
        self._stopping = True
        self._post(("stop", drain))
        await asyncio.to_thread(self.process.join, timeout)
        if self.process.is_alive():  # still draining after ``timeout``
            self._post(("stop", False))
            await asyncio.to_thread(self.process.join, 30)
        if self.process.is_alive():
            self.process.terminate()
            await asyncio.to_thread(self.process.join)
        await asyncio.to_thread(self._reader.join, 10)

    def stats(self) -> dict:
        """The engine's gauges and counters as of its last step."""
        return dict(self._stats)

    def _submit(self, prompt, params, request_id):
        rid, ids, params = checked_request(self.engine, prompt, params, request_id)
        if self._fatal is not None or self._stopping:
            raise QueueFullError(self._fatal or "the server is shutting down")
        queue: asyncio.Queue = asyncio.Queue()
        with self._live_lock:
            if rid in self._live:
                raise InvalidRequestError(f"request_id {rid!r} is running already: give "
                                          "each running request its own id")
            self._live[rid] = Target(asyncio.get_running_loop(), queue)
        self._post(("submit", rid, ids, params, time.perf_counter()))
        return rid, queue

    def _post(self, message) -> None:
        try:
            with self._send_lock:
                self.conn.send(message)
        except (OSError, ValueError):  # the engine process is gone: _read ends its requests
            pass

    def _read(self) -> None:
        """The worker's messages to the requests' queues, one hand-over per event loop."""
        while True:
            try:
                message = self.conn.recv()
            except (OSError, EOFError):
                return self._lost()
            kind = message[0]
            if kind == "out":
                self._stats = message[2]
                self._deliver(message[1])
            elif kind == "rejected":
                self._deliver([(message[1], QueueFullError(message[2]))])
            elif kind == "stopped":
                self._stats = message[1]
                return

    def _deliver(self, outs) -> None:
        """RequestOutputs, or (request id, exception) refusals, to their requests' queues."""
        pairs = []
        with self._live_lock:
            for out in outs:
                rid, item = (out.request_id, out) if isinstance(out, RequestOutput) else out
                if rid in self._live:
                    pairs.append((self._live[rid], item))
        send(pairs, lambda rid: self._post(("abort", rid)))

    def _lost(self) -> None:
        """The pipe closed without "stopped": the process died; end what ran."""
        code = self.process.exitcode if not self.process.is_alive() else None
        self._fatal = f"the engine process exited (code {code})"
        with self._live_lock:
            rids = list(self._live)
        self._deliver([RequestOutput(rid, "", [], None, True, "error", 0, 0, error=self._fatal)
                       for rid in rids])
