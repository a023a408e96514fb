"""Asynchronous steps: step N+1 launched before step N's tokens are read on the host
(vLLM's async scheduling), for mixed steps (prompt chunks beside decode tokens) and the
decode steps the look-ahead does not take (lookahead.py: the same greedy batch twice).

The synchronous engine schedules step N+1 while step N runs (``Scheduler.schedule_ahead``)
but launches it only once N's tokens reached the host and were appended: meanwhile the
GPU waits. Here step N's greedy tokens stay on the device (the argmax of each logits row,
beside a NaN flag a row, copied to pinned host memory behind an event); step N+1, already
scheduled, is prepared and launched at once, each of its decode rows fed its token from
that vector by index on the device (``DeviceFeed``, no host round trip), prompt-chunk rows
and the rows of sequences that sat N out from the host as before; then N's tokens are read
and appended while N+1 runs, and the next ``Engine.step`` schedules N+2 while N+1 runs.

A sequence that finishes at step N (EOS, a stop string, max_new_tokens, an abort before N+1
is read) wasted its row of N+1: its token is never appended, its cache is freed on the
host when it finishes, and the GPU's write into its slot is stream-ordered before any
later step that reuses the memory (as the look-ahead's).

Greedy rows under a constraint (a JSON schema, a regex, a grammar: their masks need
their grammars' states after N's tokens) are launched so too, their sampling (mask,
argmax) launched once N's tokens are read and accepted: ``constrained_steps.py``.

Steps stay synchronous (``Engine._step_body``) where this would not be exact or safe:
- a row that is neither ``plain_greedy`` nor greedy and constrained alone
  (``constrained_steps.on_device``): sampled rows draw on the host from their requests'
  CPU generators (a device draw would change seeded tokens); penalties, min_p and logprobs
  read the logits on the host; jump-forward on a cache that cannot roll a position back;
- speculative decoding with a drafter that does not propose on the host alone, or with
  ``speculative={"ahead": false}``; with an n-gram drafter, verify steps are launched
  ahead too, each drafted request taken to keep its whole draft
  (core/speculative/ahead.py: how its rows of the next step are fed, and dropped where it
  did not);
- samples of ``n`` > 1 waiting to fork (their parent's K/V are forked once its first token
  is known);
- tensor / pipeline parallel ranks (every rank takes the sampling rank's tokens);
- where the scheduler gives no step ahead: the cache short (pausing or preempting needs
  the step's outcome), a swapped sequence able to come back, LongRoPE's recompute due.
"""
from __future__ import annotations

import time

import attrs
import torch

from ..request import Status
from ..step import tokens_of
from . import constrained_steps
from .host_tensors import from_ints
from .sampler import failure, nan_error


class DeviceFeed:
    """The rows of a step's token buffer whose token is on the device: ``rows`` [k] of the
    buffer take ``values`` [k] (the previous step's tokens, gathered by index)."""

    def __init__(self, rows: torch.Tensor, values: torch.Tensor):
        self.rows, self.values = rows, values

    def into(self, ids: torch.Tensor) -> None:
        """Write them into ``ids`` [T] (after the host's copy into it, in stream order)."""
        ids.index_copy_(0, self.rows, self.values)


class SampledTokens:
    """A launched step's greedy tokens: kept on the device for the next step's feed, and
    copied to the host behind an event; ``get`` waits for that step only."""

    def __init__(self, logits: torch.Tensor):
        # logits [n, V] -> [2, n]: each row's argmax (as sampler.sample takes it), and
        # whether the row holds a NaN (its argmax would be no token)
        picked = torch.stack([logits.argmax(-1), torch.isnan(logits).any(-1).long()])
        self.device, self.event = picked[0], None  # [n]
        if picked.is_cuda:
            self.host = torch.empty(picked.shape, dtype=picked.dtype, pin_memory=True)
            self.host.copy_(picked, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = picked

    def get(self) -> tuple[list[int], list[int]]:
        """(tokens, NaN flags): one of each per row of the logits."""
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


@attrs.define
class Launched:
    step: object  # scheduler.Step
    # sequence id -> its row of ``tokens`` whose token the next step is fed: those that get
    # a token at this step (a drafted one's last row: its bonus, if it keeps its draft)
    rows: dict
    logits: object  # [n, V] until sampled (a constrained step: once its masks are filled)
    tokens: SampledTokens | None = None
    # sequence id -> (its first row, its Proposal, its length before the step): verified
    drafted: dict = attrs.Factory(dict)
    failed: set = attrs.Factory(set)  # rows whose constraint failed: read as -1

    def drop(self, seq_id) -> bool:
        """Read nothing of ``seq_id`` here (its rows were fed a draft it did not keep)."""
        self.drafted.pop(seq_id, None)
        return self.rows.pop(seq_id, None) is not None


class AsyncSteps:
    def __init__(self, engine):
        self.engine = engine
        self.enabled = False  # build(async_steps=...): on CUDA in one process by default
        self.inflight: Launched | None = None  # launched, its tokens not yet read

    def takes(self, step) -> bool:
        """Whether ``step`` runs here (the module's docstring says what does not)."""
        e = self.engine
        ahead = e.speculation is None or e.speculation.ahead is not None
        return self.enabled and ahead and e.ranks is None and not e._forks \
            and all(constrained_steps.on_device(s, e.cache) for s in step.seqs)

    def stepping(self) -> list:
        """The sequences of the step in flight (recomputed if reading it fails)."""
        return list(self.inflight.step.seqs)

    def run(self, step, tokens: list[int], replay: bool) -> list:
        """A scheduled step: launch it, launch the next one where it may, read this one."""
        self.inflight = self._launch(step, tokens, replay, None)
        self._sample(self.inflight)  # (nothing before it is left to accept)
        return self.advance(pipelined=False)

    def advance(self, pipelined: bool = True) -> list:
        """Read the step in flight (launching the next one first where it may); returns
        the sequences that got a token. ``pipelined``: the step in flight was launched by
        the call before (this call lasts one step of the pipeline: timed for speculation)."""
        e, current, start = self.engine, self.inflight, time.perf_counter()
        self.inflight = None
        # 1) the next step, scheduled now that this one's lengths are counted (as the
        # synchronous engine does while the GPU runs it)
        ahead = e.scheduler.schedule_ahead() if e.schedule_ahead else None
        # (nothing finished since it was scheduled: resume gives the same step)
        step = e.scheduler.resume(ahead) if ahead is not None and self._launches(ahead) \
            else None
        if step is not None and e.speculation is not None:  # its drafts (ahead.py)
            step = e.speculation.ahead.extend(step, current)
        inputs = None if step is None else self._inputs(step, current)
        # 2) launched before this one is read, or left to the next step() (which runs it
        # without the sequences that finish now: Scheduler.resume)
        if inputs is None:
            e._ahead = ahead
        else:
            e._stepping = list(current.step.seqs) + list(step.seqs)  # (recomputed on errors)
            self.inflight = self._launch(step, *inputs)
            if not constrained_steps.constrained(self.inflight):  # else its masks wait for 3)
                self._sample(self.inflight)
        # 3) this step's tokens, appended while the next one runs; a next step whose
        # every sequence finished now has nothing to read (its writes are stream-ordered)
        got = self._read(current)
        launched = self.inflight
        if launched is not None and launched.tokens is None:  # rows forced tokens meanwhile
            constrained_steps.drop_forced(e, launched)
        if launched is not None and all(s.status is Status.FINISHED for s in launched.step.seqs):
            self.inflight = None
        elif launched is not None and launched.tokens is None:  # its masks, now filled
            self._sample(launched)
        if pipelined and e.speculation is not None:
            e.speculation.ahead.observe(current.step, time.perf_counter() - start)
        return got

    def _sample(self, launched: Launched) -> None:
        """Launch ``launched``'s sampling: its constrained rows masked, every row's argmax."""
        if constrained_steps.constrained(launched):
            constrained_steps.masks(self.engine, launched)
        launched.tokens, launched.logits = SampledTokens(launched.logits), None

    def _launches(self, step) -> bool:
        e = self.engine
        # a fresh prompt alone may replay a prefill graph, whose single host buffer the
        # step before may still be copying from (it cannot be alone after a step anyway)
        prefill_graph = e.runner.prefill_graphs is not None and len(step.seqs) == 1
        # the same greedy decode batch again: the look-ahead's (its graphs' own argmax)
        lookahead = e.runner.replays_decode(step) and e.lookahead.keeps_up(step.seqs)
        return self.takes(step) and not prefill_graph and not lookahead

    def _launch(self, step, tokens, replay, feed) -> Launched:
        logits = self.engine.runner.forward(step, tokens, replay, feed)
        rows, drafted, row = {}, {}, 0  # (row: of the logits, step.logit_rows')
        for i, (s, n) in enumerate(zip(step.seqs, step.counts)):
            draft = None if step.drafts is None else step.drafts[i]
            if draft is not None:
                drafted[s.id] = (row, draft, s.num_computed_tokens)
            row += 1 if draft is None else n
            s.num_computed_tokens += n
            if not s.prefilling:  # a sequence still prefilling after its chunk: no token yet
                rows[s.id] = row - 1
        return Launched(step, rows, logits, drafted=drafted)

    def _inputs(self, step, current: Launched):
        """(tokens, replay, feed) of ``step``: a placeholder for each sequence whose token
        ``current`` samples, fed from the device; None where one of those would feed
        anything but that token (not the case of a step scheduled ahead)."""
        tokens, rows, sources = [], [], []
        for i, (s, n) in enumerate(zip(step.seqs, step.counts)):
            row = current.rows.get(s.id)
            draft = () if step.drafts is None or step.drafts[i] is None \
                else step.drafts[i].tokens  # proposed after the token it is fed
            if row is not None:
                if s.prefilling or n != 1 + len(draft):
                    return None
                rows.append(len(tokens))
                sources.append(row)
                tokens.append(0)
            elif s.prefilling:  # a prompt's next chunk
                done = s.num_computed_tokens
                tokens += tokens_of(s)[done:done + n]
            else:  # sat the current step out: its token was read before
                tokens.append(s.output_ids[-1])
            tokens += draft
        replay = self.engine.runner.replays_decode(step)
        if not rows:
            return tokens, replay, None
        index = from_ints(rows + sources).to(self.engine.device, non_blocking=True)
        k = len(rows)
        return tokens, replay, DeviceFeed(index[:k], current.tokens.device[index[k:]])

    def _read(self, launched: Launched) -> list:
        e = self.engine
        tokens, nan = launched.tokens.get()
        now = time.perf_counter()
        got = []
        for s in launched.step.seqs:
            row = launched.rows.get(s.id)
            # a chunk; aborted meanwhile; rows dropped (fed a draft before it not kept)
            if row is None or s.status is Status.FINISHED:
                continue
            if s.id in launched.drafted:  # verified (the next step's rows kept or dropped)
                first, draft, start = launched.drafted[s.id]
                e.speculation.ahead.settle(
                    s, draft, start, tokens[first:row + 1], any(nan[first:row + 1]),
                    self.inflight, lambda seq, token: e._append(seq, token, now))
                got.append(s)
                continue
            token = tokens[row]
            if nan[row]:  # as sampler.sample_each: this row fails, the others do not
                s.error, token = failure(nan_error([0])), -1
            elif row in launched.failed:  # its constraint failed (seq.error says why)
                token = -1
            e._append(s, token, now)
            got.append(s)
        return got
