"""The engine process of ``EngineProcess`` (engine_process.py): it builds the engine and
steps it with the same ``EngineThread`` loop the AsyncEngine runs, so that the HTTP
server's Python never holds the lock that the engine's Python needs between launches.

Two threads: the main one steps (``EngineThread.run``); a reader turns the parent's
messages into the loop's ``Inbox`` entries. Outputs go back through a ``PipeSink``, which
stands in for the asyncio loop that ``engine_thread.send`` hands a step's outputs to: one
message per step, carrying the step's ``RequestOutput``s and the engine's stats.

Parent -> worker: ("submit", request id, token ids, SamplingParams, arrival),
("abort", request id), ("stop", drain). Worker -> parent: ("ready", EngineView, stats)
or ("failed", exception); ("out", [RequestOutput], stats); ("rejected", request id, why)
when ``max_waiting`` requests wait already; ("stopped", stats) last.
"""
from __future__ import annotations

import logging
import signal
import threading
import time

from .engine_thread import EngineThread, Inbox, Submission, engine_stats, refusal
from .lockstep import Lockstep

log = logging.getLogger("infergraft.serving")
STATS_S = 0.05


class EngineView:
    """What the HTTP side needs of the engine, without its model: the tokenizer, the
    model's spec and the plan (max_seq_len), and ``encode``."""

    def __init__(self, tokenizer, spec, plan):
        self.tokenizer, self.spec, self.plan = tokenizer, spec, plan

    def encode(self, prompt) -> list[int]:
        from ..prompt import encode_prompt

        return encode_prompt(prompt, self.tokenizer, self.spec.vocab_size)


class PipeSink:
    """The worker's stand-in for an asyncio loop in ``engine_thread.send``."""

    def __init__(self, conn, lock: threading.Lock, stats):
        self.conn, self.lock, self.stats = conn, lock, stats
        self.last: dict = {}
        self.last_at = 0.0

    def call_soon_threadsafe(self, _put_all, items) -> None:
        outs = [out for _, out in items]
        # the stats walk the cache's block table: at most every STATS_S, and whenever a
        # request ends (what /metrics shows of a client gone)
        now = time.monotonic()
        if now - self.last_at >= STATS_S or any(o.finished for o in outs):
            self.last, self.last_at = self.stats(), now
        self.post(("out", outs, self.last))

    def post(self, message) -> None:
        try:
            with self.lock:
                self.conn.send(message)
        except (OSError, EOFError, ValueError) as e:  # the parent is gone
            raise RuntimeError(f"the server process is gone: {e}") from e


def worker_main(conn, model, build_kwargs: dict, max_waiting: int) -> None:
    """The engine process: build, say ready (or why not), then serve until told to stop."""
    from ..build import build

    # the server process decides when this one stops (Ctrl-C and SIGTERM reach the whole
    # process group: the server drains, then tells this process to stop)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        engine = build(model, **build_kwargs)
    except BaseException as e:  # the parent raises it as the build's error
        conn.send(("failed", _sendable(e)))
        return
    inbox = Inbox()
    loop = EngineThread(engine, inbox, Lockstep(engine))
    sink = PipeSink(conn, threading.Lock(), lambda: engine_stats(engine, inbox, loop))
    sink.post(("ready", EngineView(engine.tokenizer, engine.spec, engine.plan), sink.stats()))
    reader = threading.Thread(target=_read, args=(conn, engine, inbox, sink, max_waiting),
                              daemon=True, name="infergraft-engine-reader")
    reader.start()
    loop.run()
    try:
        sink.post(("stopped", sink.stats()))
    except RuntimeError:
        pass


def _read(conn, engine, box: Inbox, sink: PipeSink, max_waiting: int) -> None:
    """The parent's messages into the inbox; a closed pipe aborts everything (the server
    process is gone: nobody reads the outputs)."""
    while True:
        try:
            message = conn.recv()
        except (OSError, EOFError):
            message = ("stop", False)
        kind = message[0]
        with box.cond:
            if kind == "submit":
                _, rid, ids, params, arrival = message
                why = refusal(engine, box, max_waiting)
                if why is None:
                    box.names.add(rid)
                    box.intake.append(Submission(rid, ids, params, sink, None, arrival))
            elif kind == "abort":
                why = None
                box.aborts.append(message[1])
            else:  # "stop"
                why = None
                box.stop = "abort" if not message[1] or box.stop == "abort" else "drain"
            box.cond.notify()
        if kind == "submit" and why is not None:
            try:
                sink.post(("rejected", message[1], why))
            except RuntimeError:
                pass
        if kind == "stop" and box.stop == "abort":
            return


def _sendable(e: BaseException) -> BaseException:
    """``e`` if it survives pickling (ours do), else a RuntimeError with its text."""
    import pickle

    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")
