"""The lock an Engine is shared under: re-entrant, and handed to waiting threads in turn."""
from __future__ import annotations

import collections
import threading


class FairRLock:
    """A re-entrant lock handed over to waiting threads in the order they asked.

    ``threading.RLock`` lets a thread that releases it and asks again at once win almost
    every time, so one caller stepping in a loop would keep every other caller from even
    adding its request until its own had finished: callers would take turns instead of
    sharing steps. Here a release with threads waiting makes the oldest the owner."""

    def __init__(self):
        self._mutex = threading.Lock()
        self._owner, self._depth = None, 0
        self._waiting: collections.deque = collections.deque()  # (thread id, gate)

    def acquire(self) -> bool:
        me = threading.get_ident()
        with self._mutex:
            if self._owner == me or (self._owner is None and not self._waiting):
                self._owner, self._depth = me, self._depth + 1
                return True
            gate = threading.Lock()
            gate.acquire()
            self._waiting.append((me, gate))
        try:
            gate.acquire()  # released by the owner that hands the lock to this thread
        except BaseException:  # interrupted (Ctrl-C): leave the line, or pass the lock on
            with self._mutex:
                handed = (me, gate) not in self._waiting
                if not handed:
                    self._waiting.remove((me, gate))
            if handed:
                self.release()
            raise
        return True

    def release(self) -> None:
        with self._mutex:
            if self._owner != threading.get_ident():
                raise RuntimeError("FairRLock.release by a thread that does not hold it")
            self._depth -= 1
            if self._depth:
                return
            self._owner = None
            if self._waiting:
                self._owner, gate = self._waiting.popleft()
                self._depth = 1
                gate.release()

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
