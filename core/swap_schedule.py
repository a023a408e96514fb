"""The scheduler's side of preemption by swap (``core/preemption.py`` chooses it).

A sequence swapped out keeps everything but its place on the device: its tokens, how far
its prefill got, when it last ran. It waits in ``Scheduler.swapped`` (oldest request
first) and no waiting prompt is admitted before it is back. It comes back at the start
of a step, when the running sequences' next step fits, the batch has a slot and the cache
has room for it and its next token (``KVCache.can_swap_in``). While it cannot, the steps of
the running sequences are still scheduled ahead and looked ahead (``can_swap_in_now``): a
swapped sequence that waits for room must not cost every other step the host's overlap;
it comes back at most one step after the room appears. Like a recomputed sequence
readmitted, it rejoins the running ones as the newest (the next to be preempted), but it
keeps when it last ran, so it goes before every sequence that ran since. Aborting it
drops its host copy.
"""
from __future__ import annotations

import bisect

from .preemption import PreemptionPolicy
from .request import Sequence, Status

#: a scheduler's policy until it is given one: recompute, as before swap existed
RECOMPUTE = PreemptionPolicy("recompute")


def preempt_newest(sched) -> None:
    """Make room: the newest running sequence swapped out or recomputed, as the
    scheduler's ``preemption`` policy chooses."""
    seq = sched.running[-1]
    if sched.preemption.choose(sched.cache, seq) == "swap":
        swap_out(sched, seq)
    else:
        sched.preempt(seq)


def swap_out(sched, seq: Sequence) -> None:
    sched.cache.swap_out(seq.id)  # first: a cache that refuses leaves everything as it was
    sched.running.remove(seq)
    seq.status = Status.SWAPPED
    bisect.insort(sched.swapped, seq, key=lambda s: s.id)  # ids count up as requests arrive
    sched.num_preemptions += 1
    sched.num_swapped_out += 1


def can_swap_in_now(sched) -> bool:
    """True where the oldest swapped sequence would come back at a step's start now (room
    in the batch and in the cache); the running ones' shortage aside."""
    return bool(sched.swapped) and sched.has_room() \
        and sched.cache.can_swap_in(sched.swapped[0].id)


def swap_in_ready(sched) -> None:
    """Swapped sequences back, oldest first, while there is room (module docstring)."""
    if not sched.swapped or sched._running_part()[2]:  # the running ones come first
        return
    while can_swap_in_now(sched):
        seq = sched.swapped[0]
        sched.cache.swap_in(seq.id)
        del sched.swapped[0]
        seq.status = Status.RUNNING
        sched.running.append(seq)  # (its _last_ran entry was kept)


def drop_waiting(sched, seq: Sequence) -> None:
    """Take a request that is not running out of the waiting queue, or out of the swapped
    ones, freeing its host copy (an abort)."""
    if seq in sched.waiting:
        sched.waiting.remove(seq)
    elif seq in sched.swapped:
        sched.swapped.remove(seq)
        sched.cache.free_swapped(seq.id)
        sched._last_ran.pop(seq.id, None)
