"""One HTTP request's engine requests (n choices, or several prompts) as one stream.

Each ``AsyncEngine.generate`` runs in a task of its own feeding one queue, so the
choices advance together whatever order their tokens come in. ``start`` waits for every
choice's first output, so that a refusal (a bad prompt, a full queue) raised before it
becomes the HTTP error of the whole request, with the other choices cancelled, before any
byte of a 200 is sent. ``close`` cancels what still runs: a cancelled ``generate`` aborts
its request at the next step and frees its cache."""
from __future__ import annotations

import asyncio

_OUT, _END, _ERR = "out", "end", "err"


class Fanout:
    def __init__(self, aengine, jobs):
        """``jobs``: (prompt ids, SamplingParams, request id) per choice, in choice order."""
        self.aengine, self.jobs = aengine, list(jobs)
        self.queue: asyncio.Queue = asyncio.Queue()
        self.tasks: list[asyncio.Task] = []
        self.buffer: list = []  # what start() read past the first items
        self.ended = 0

    async def _pump(self, index: int, ids, params, rid: str) -> None:
        gen = self.aengine.generate(ids, params, request_id=rid)
        try:
            async for out in gen:
                self.queue.put_nowait((_OUT, index, out))
        except Exception as e:  # noqa: BLE001 -- delivered to the consumer, raised there
            self.queue.put_nowait((_ERR, index, e))
            return
        finally:
            await gen.aclose()
        self.queue.put_nowait((_END, index, None))

    async def start(self) -> None:
        """Submit every choice; raise the first refusal (the others cancelled)."""
        self.tasks = [asyncio.create_task(self._pump(i, *job)) for i, job in enumerate(self.jobs)]
        seen: set[int] = set()
        try:
            while len(seen) < len(self.jobs):
                item = await self.queue.get()
                if item[0] == _ERR:
                    raise item[2]
                seen.add(item[1])
                self.buffer.append(item)
        except BaseException:
            self.close()
            raise

    async def outputs(self):
        """(choice index, RequestOutput) as they come, until every choice has ended; an
        error inside one (the engine failed) is raised here."""
        while self.ended < len(self.jobs):
            kind, index, value = self.buffer.pop(0) if self.buffer else await self.queue.get()
            if kind == _ERR:
                raise value
            if kind == _END:
                self.ended += 1
                continue
            yield index, value

    def close(self) -> None:
        """Cancel the choices still running (synchronous: safe in a cancelled scope)."""
        for t in self.tasks:
            if not t.done():
                t.cancel()
