"""Failure across ranks: every collective waits at most ``collective_timeout()``, and a
step that fails on one rank ends on every rank with a ``RankFailedError`` naming it.

A rank waiting in a collective learns nothing of why a peer is not coming, so:

1) A rank whose step raises records ``"<type>: <message>"`` under ``failed/<rank>`` in
   the process group's store, then leaves the group: its peers' pending gloo operations
   fail at once ("Connection closed by peer") instead of waiting out the timeout; it
   returns once each peer has marked the records read (``seen/<rank>``) or after
   ``CENSUS_S``: rank 0 hosts the store, and its record must outlive its exit.
2) A rank whose collective failed (a peer's connection closed, or the timeout ran out)
   leaves the group too, so that the ranks waiting on it fail next, and reads the store:
   a recorded failure is named with its message. With none (a rank killed by SIGKILL,
   or stuck), each survivor posts ``alive/<rank>`` and waits ``CENSUS_S`` for the
   others; those that neither answered nor recorded a failure are named as gone. A store
   that no longer answers means the process hosting it is gone: rank 0 (the ``env://``
   store of ``init_process_group``) or torchrun's agent.

So a raise is named at once, a killed process after ``CENSUS_S``, a stuck one after the
timeout plus ``CENSUS_S``. The group is left after any failure: the ranks' collectives no
longer match in order, so nothing more may run on it (its records are keyed by rank
alone: one failure a group). On NCCL the watchdog ends a process whose collective timed
out (torch's ``TORCH_NCCL_ASYNC_ERROR_HANDLING``); a raise is still recorded and named.
"""
from __future__ import annotations

import datetime
import logging
import os
import sys
import time
import traceback

import torch

from ..errors import RankFailedError

log = logging.getLogger("infergraft.distributed")
KEY = "infergraft/failure/"
CENSUS_S = 3.0  # how long a survivor waits for the others to say they are alive
# gloo's messages for a peer that is gone, or that did not come in time
GONE = ("Connection closed", "Connection reset", "Broken pipe", "Connection refused")
TIMED_OUT = ("Timed out", "timed out", "Timeout", "timeout")

_left = None  # the RankFailedError this process left its group with (None: not left)
_store = None  # the store of the group we left: kept alive, peers may still read it


def collective_timeout() -> datetime.timedelta | None:
    """``INFERGRAFT_COLLECTIVE_TIMEOUT`` seconds (default 120; 0: torch's own, 30 min on
    gloo, 10 on NCCL). 120 s: a decode step takes milliseconds and a long prefill chunk
    seconds; a rank waits in a collective only for the others to finish the same share of
    work, or, at the first step, for the slowest to finish loading the same files and
    compiling the same kernels. Two minutes covers that skew with margin, and a dead or
    stuck rank is reported in two minutes rather than thirty."""
    from infergraft.kernels import switches  # here, not at import: kernels import triton

    seconds = switches.value("INFERGRAFT_COLLECTIVE_TIMEOUT")
    return None if seconds == 0 else datetime.timedelta(seconds=seconds)


def new_group(ranks: list[int]):
    """``torch.distributed.new_group(ranks)`` with the collective timeout (without one, a
    new group waits torch's default, not the default group's)."""
    return torch.distributed.new_group(ranks, timeout=collective_timeout())


def wait_for_device(event, timeout: datetime.timedelta | None) -> None:
    """Wait for a CUDA ``event``; with a ``timeout`` (graphs across ranks: NCCL's
    watchdog does not see a replayed graph's collectives) give up after it with the
    error a timed-out collective raises, which ``across_ranks`` turns into the census."""
    if timeout is None:
        return event.synchronize()
    deadline = time.monotonic() + timeout.total_seconds()
    while not event.query():  # spins, as synchronize() does
        if time.monotonic() > deadline:
            raise RuntimeError(f"NCCL: a CUDA graph's collectives timed out after "
                               f"{timeout.total_seconds():g} s (a rank died or stopped "
                               "during the replay)")
    return None


def adopt(group=None) -> None:
    """A group someone else made (``init_process_group`` before ``core.build``) at torch's
    default timeout takes ours; one made with a timeout of its own keeps it. Gloo's
    collectives follow the change, its send / recv keep the timeout the group was made
    with (a peer that raised or died still fails them at once: only a stuck one waits)."""
    timeout, current = collective_timeout(), group_timeout(group)
    from torch.distributed import constants

    if timeout is None or current not in (constants.default_pg_timeout,
                                          getattr(constants, "default_pg_nccl_timeout", None)):
        return
    try:
        torch.distributed.distributed_c10d._set_pg_timeout(timeout, group)
    except (AttributeError, ValueError, RuntimeError) as e:  # a private API: it may move
        log.warning("could not set the process group's timeout to %s: %s", timeout, e)


def group_timeout(group=None) -> datetime.timedelta | None:
    """The timeout a group's collectives wait (None: not known)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return None
    pg = group or dist.distributed_c10d._get_default_group()
    for device in ("cpu", "cuda"):
        try:
            return pg._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError, ValueError):
            continue
    return None


def across_ranks(error: BaseException, ranks=None) -> BaseException:
    """What a step that raised ``error`` raises: ``error`` itself in one process (``ranks``
    None), for Ctrl-C (recorded, the group left) and for a RankFailedError already; else
    the RankFailedError every rank raises (``error`` recorded and the group left first,
    where it is this rank's own failure), caused by ``error``."""
    if ranks is None:
        return error
    verdict = diagnose(error)
    if verdict is None or not isinstance(error, Exception):
        return error
    verdict.__cause__ = error
    return verdict


def diagnose(error: BaseException) -> RankFailedError | None:
    """The RankFailedError that ``error`` (raised on this rank in a step or a collective)
    means, leaving the group; None for a RankFailedError already."""
    global _left, _store
    dist = torch.distributed
    if isinstance(error, RankFailedError):
        return None
    if not dist.is_initialized():  # left already: every later step fails the same way
        return _copy(_left) if _left is not None else None
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        _store = dist.distributed_c10d._get_default_store()
    except (AttributeError, ValueError, RuntimeError):
        _store = None
    if is_collective_error(error):
        timeout = group_timeout()  # (what the census reports, read while there is a group)
        traceback.clear_frames(error.__traceback__)  # their locals hold the group too
        _leave()
        _left = _census(_store, rank, world, error, timeout)
    else:
        why = f"{type(error).__name__}: {error}"
        _post(_store, f"failed/{rank}", why)  # before leaving: the peers look here then
        _leave()
        _await_readers(_store, rank, world)
        _left = RankFailedError(
            f"rank {rank} of {world} failed during a step: {why}; it left the process "
            "group, so the other ranks stop too", (rank,), {rank: why}, world)
    log.error("%s", _left)
    return _copy(_left)


def is_collective_error(error: BaseException) -> bool:
    """Whether ``error`` came from a collective whose peer failed (gloo / NCCL errors, or
    the group gone), not from this rank's own work."""
    dist_error = getattr(torch.distributed, "DistError", ())
    text = str(error)
    return (isinstance(error, dist_error) or (isinstance(error, RuntimeError) and any(
        s in text for s in ("gloo", "NCCL", "nccl", *GONE, *TIMED_OUT))))


def _census(store, rank: int, world: int, error: BaseException,
            timeout: datetime.timedelta | None) -> RankFailedError:
    """Who failed or is gone, as the store says (the group left already)."""
    timed_out = any(s in str(error) for s in TIMED_OUT)
    if store is None:  # torch moved its private API: nothing tells who
        return RankFailedError(f"a collective failed on rank {rank} of {world} (no store "
                               f"to learn which rank failed): {type(error).__name__}: "
                               f"{error}", (), {}, world)
    try:
        _post(store, f"alive/{rank}", "1", strict=True)
        deadline = time.monotonic() + CENSUS_S
        while True:
            failed, lost = _records(store, world, "failed"), _records(store, world, "lost")
            alive = {r for r in range(world) if store.check([f"{KEY}alive/{r}"])}
            if failed or lost or len(alive) == world or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        _post(store, f"seen/{rank}", "1")  # read: a failed rank hosting the store may go
    except Exception as e:  # the store does not answer: whoever hosted it is gone
        log.warning("the process group's store did not answer: %s: %s", type(e).__name__, e)
        return _store_gone(world, error, e)
    if failed:
        names = ", ".join(f"rank {r} of {world} failed during a step: {why}"
                          for r, why in failed.items())
        return RankFailedError(f"{names} (seen on rank {rank}, which left the process group)",
                               failed, failed, world)
    if not lost:
        seconds = "?" if timeout is None else f"{timeout.total_seconds():g} s"
        how = (f"did not answer within the collective timeout ({seconds})" if timed_out
               else "closed its connection (killed or crashed)")
        lost = {r: f"{how}, seen on rank {rank}" for r in range(world) if r not in alive}
        for r, why in lost.items():
            _post(store, f"lost/{r}", why)  # the survivors that come later read this
    if not lost:
        return RankFailedError(
            f"a collective failed on rank {rank} of {world} though every rank is alive and "
            f"none recorded a failure (their collectives no longer match?): "
            f"{type(error).__name__}: {error}", (), {}, world)
    names = ", ".join(f"rank {r}" for r in lost)
    this = " (this rank, as the others saw it)" if rank in lost else ""
    return RankFailedError(f"{names} of {world}{this} stopped responding during a step: it "
                           f"{next(iter(lost.values()))}", lost, lost, world)


def _await_readers(store, rank: int, world: int) -> None:
    """Wait (at most ``CENSUS_S`` and a second) until every peer has read the records: a
    rank that raised may exit next, and where it hosts the store (rank 0) its record,
    the message, would go with it."""
    if store is None:
        return
    keys = [f"{KEY}seen/{r}" for r in range(world) if r != rank]
    deadline = time.monotonic() + CENSUS_S + 1
    try:
        while not all(store.check([k]) for k in keys) and time.monotonic() < deadline:
            time.sleep(0.02)
    except Exception:  # the store's host is gone: nobody is left to read it
        return


def _store_gone(world: int, error, store_error) -> RankFailedError:
    where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return RankFailedError(f"torchrun's agent, which hosts the process group's store "
                               f"({where}), is gone; the step failed with "
                               f"{type(error).__name__}: {error}", (), {}, world)
    why = (f"the process group's store it hosted does not answer (killed or crashed; "
           f"{type(store_error).__name__}: {store_error})")
    return RankFailedError(f"rank 0 of {world} is gone: {why} ({where})", (0,), {0: why}, world)


def _records(store, world: int, kind: str) -> dict[int, str]:
    keys = {r: f"{KEY}{kind}/{r}" for r in range(world)}
    return {r: store.get(k).decode() for r, k in keys.items() if store.check([k])}


def _post(store, key: str, value: str, strict: bool = False) -> None:
    try:
        store.set(KEY + key, value)
    except Exception:
        if strict:
            raise
        log.warning("could not record %s in the process group's store", key)


def _leave() -> None:
    """Destroy the process group: the peers' pending operations on it fail now (gloo
    closes its connections once nothing holds the group any more)."""
    try:
        leave_group()
    except Exception as e:  # leaving is best effort: the error raised says what failed
        log.warning("leaving the process group failed: %s", e)


def leave_group() -> None:
    """``destroy_process_group()`` and drop the one reference torch keeps to the group:
    ``torch.distributed.nn.functional``, imported after ``init_process_group``
    (transformers does), holds it in its functions' defaults (``group=group.WORLD``).
    Left there, the gloo group outlives the call; its threads then end only at interpreter
    exit, where C++ aborts ("terminate called without an active exception")."""
    dist = torch.distributed
    pg = dist.distributed_c10d._get_default_group()
    dist.destroy_process_group()
    module = sys.modules.get("torch.distributed.nn.functional")
    for f in vars(module).values() if module is not None else ():
        if getattr(f, "__defaults__", None) and any(d is pg for d in f.__defaults__):
            f.__defaults__ = tuple(None if d is pg else d for d in f.__defaults__)


def _copy(error: RankFailedError) -> RankFailedError:
    """A fresh instance (one exception object raised twice would grow its traceback)."""
    return RankFailedError(str(error), error.ranks, error.reasons, error.world_size)
