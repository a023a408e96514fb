"""What changes the schedule, applied in the same order on every rank.

An engine under ``tp`` / ``pp`` runs one process per rank, and every rank's scheduler must
see the same requests arrive and leave in the same order, or their collectives stop
matching. The AsyncEngine on rank 0 gathers each loop iteration's ``Events`` (requests
admitted, aborted, failed, shutdown), broadcasts them (``Lockstep.exchange``, a
``broadcast_object_list``) before it steps, and ``apply`` does the same to the engine of
every rank. ``follow`` is the other ranks' loop: receive, apply, step, until shutdown.

A rank that fails (its step raised, its process died, it stopped answering) ends the loop
on every rank with a RankFailedError naming it (``distributed/failure.py``), raised by
the step or by the exchange, within the collective timeout; an idle rank 0 broadcasts
often enough (``heartbeat_s``) that the followers' wait never runs into that timeout.
"""
from __future__ import annotations

import logging

import attrs
import torch

from ..distributed.failure import across_ranks, group_timeout
from ..errors import InvalidRequestError, RankFailedError
from ..request import SamplingParams

log = logging.getLogger("infergraft.serving")


@attrs.frozen
class Events:
    """One loop iteration's changes, in the order ``apply`` makes them."""

    new: tuple = ()  # (request id, prompt token ids, SamplingParams fields), arrival order
    abort: tuple = ()  # request ids whose consumer went away (or shutdown without drain)
    fail: tuple = ()  # (request id, why): requests whose step failed on rank 0
    shutdown: bool = False


def params_fields(params: SamplingParams) -> dict:
    """The SamplingParams constructor's arguments (what a rank rebuilds it from)."""
    return {a.name: getattr(params, a.name) for a in attrs.fields(type(params)) if a.init}


def apply(engine, events: Events, seqs: dict) -> dict:
    """Admit ``events.new``, then abort and fail what it names; ``seqs``: request id ->
    Sequence of the requests this rank runs, updated. Returns request id -> Sequence (or
    the InvalidRequestError that refused it) for each new request."""
    admitted = {}
    for rid, ids, fields in events.new:
        try:
            admitted[rid] = seqs[rid] = engine.add_request(ids, SamplingParams(**fields))
        except InvalidRequestError as e:  # the same on every rank: nothing was queued
            admitted[rid] = e
    gone = [seqs[rid] for rid in events.abort if rid in seqs]
    if gone:
        engine.abort(gone)
    for rid, why in events.fail:
        if rid in seqs and not seqs[rid].finished:
            seqs[rid].error = why
            engine.abort(seqs[rid], reason="error")
    return admitted


def prune(seqs: dict) -> None:
    """Forget finished requests (their ids may be used again)."""
    for rid in [rid for rid, s in seqs.items() if s.finished]:
        del seqs[rid]


class Lockstep:
    """Rank 0's events, on every rank of the engine's process group (a no-op in one
    process)."""

    def __init__(self, engine):
        dist = torch.distributed
        self.active = (engine.ranks is not None and dist.is_available()
                       and dist.is_initialized() and dist.get_world_size() > 1)
        self.rank = dist.get_rank() if self.active else 0
        # NCCL moves the pickled events through the GPU
        self.device = engine.device if engine.device.type == "cuda" else None

    def exchange(self, events: Events | None = None) -> Events:
        if not self.active:
            return events
        box = [events]
        try:
            torch.distributed.broadcast_object_list(box, src=0, device=self.device)
        except Exception as e:  # a rank gone: RankFailedError naming it, on every rank
            raise across_ranks(e, self)
        return box[0]

    def heartbeat_s(self, longest: float) -> float:
        """How long an idle rank 0 may wait before an empty exchange: ``longest``, or a
        quarter of the group's timeout where that is less."""
        timeout = group_timeout() if self.active else None
        return longest if timeout is None else min(longest, timeout.total_seconds() / 4)


def follow(engine) -> int:
    """A rank other than 0: apply rank 0's events and step with it, until rank 0 shuts
    down. Returns the number of steps taken (rank 0's ``AsyncEngine.num_steps``)."""
    link = Lockstep(engine)
    if not link.active or link.rank == 0:
        raise InvalidRequestError(
            "AsyncEngine.follow(engine) runs on the ranks other than 0 of an engine built "
            "with tp / pp under torchrun; rank 0 (and a single process) runs the AsyncEngine"
            + ("" if link.active else ": this engine spans no process group"))
    seqs, steps = {}, 0
    while True:
        events = link.exchange()
        apply(engine, events, seqs)
        if events.shutdown:
            engine.abort(list(seqs.values()))
            return steps
        if engine.has_unfinished():
            steps += 1
            try:
                engine.step()
            except RankFailedError as e:  # the group is left: nothing can step any more
                log.error("rank %d stops following: %s", link.rank, e)
                raise
        prune(seqs)
