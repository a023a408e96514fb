"""Pipeline micro-batches (the ``pp`` planner's ``micro_batches=M``): one step's tokens cut
into up to M groups that are in flight across the stages at once, stage s computing group
g while stage s+1 computes group g-1.

Every rank runs the same scheduler, so every rank cuts the same groups and knows each
one's size before any of them arrives: a stage posts the receives of all its groups up
front (``StepExchange``), waits for each group's just before computing it, and posts
each group's send as soon as it is computed, waiting for the sends only at the end of
the step. A group is an ordinary batch for the cache: ``cache.prepare(its ids, its
counts)`` right before it runs. A sequence cut across groups is fed as consecutive
chunked-prefill pieces, the earlier piece's K/V written by every layer of the stage
before the later one attends to it (a stage computes its groups in order).
"""
from __future__ import annotations

import itertools
import time

import attrs
import torch


@attrs.frozen
class Group:
    """One micro-batch: pieces of the step's sequences, in the step's order."""

    seqs: tuple[int, ...]  # each piece's sequence, as an index into the step's sequences
    counts: tuple[int, ...]  # each piece's tokens
    ends: tuple[bool, ...]  # the piece holds its sequence's last token of the step
    offset: int  # the group's first token in the step's token list

    @property
    def tokens(self) -> int:
        return sum(self.counts)

    def last_rows(self) -> list[int]:
        """Rows (in the group) of the last token of each sequence that ends here."""
        rows, at = [], -1
        for n, end in zip(self.counts, self.ends):
            at += n
            if end:
                rows.append(at)
        return rows


def split_step(counts, micro_batches: int) -> list[Group]:
    """Cut a step of ``counts`` tokens per sequence into at most ``micro_batches`` groups
    (never more than there are tokens) of about equal tokens: the k-th cut lies at token
    floor(k * T / n), moved to a sequence boundary when one is within an eighth of a
    group (one piece fewer), else cutting that sequence into consecutive pieces."""
    total = sum(counts)
    n = max(1, min(micro_batches, total))
    bounds = list(itertools.accumulate(counts, initial=0))  # sequence boundaries, 0 .. total
    slack = (total // n) // 8  # < half a group: the cuts stay in order and apart
    cuts = []
    for k in range(1, n):
        ideal = k * total // n
        near = min(bounds, key=lambda b: (abs(b - ideal), b))
        cuts.append(near if abs(near - ideal) <= slack else ideal)
    groups, edges = [], [0, *cuts, total]
    for lo, hi in zip(edges, edges[1:]):
        seqs, pieces, ends = [], [], []
        for i, (start, end) in enumerate(zip(bounds, bounds[1:])):
            a, b = max(start, lo), min(end, hi)
            if a < b:
                seqs.append(i)
                pieces.append(b - a)
                ends.append(b == end)
        groups.append(Group(tuple(seqs), tuple(pieces), tuple(ends), lo))
    return groups


class StepExchange:
    """One step's hand-over to and from the neighbouring stages: every group's receive
    posted at once, each group's send posted as it is computed, all sends waited at the
    end (their tensors kept alive until then). Tags tell a step's groups apart (NCCL
    ignores them: its point-to-point ops match in order, as posted here).
    ``events``: a list to append (event, group, time.monotonic()) to, or None."""

    def __init__(self, stage, sizes, hidden: int, dtype, device, events=None):
        self.stage, self.events = stage, events
        self.inbox = []  # per group: (h [T_g, H], residual [T_g, H], their works)
        self.sent = []  # per group sent: ((h, residual), their works)
        self.taken = 0
        if not stage.first:
            for g, rows in enumerate(sizes):
                pair = tuple(torch.empty((rows, hidden), dtype=dtype, device=device)
                             for _ in range(2))
                works = [torch.distributed.irecv(t, src=stage.prev, tag=2 * g + i)
                         for i, t in enumerate(pair)]
                self.inbox.append((*pair, works))
                self.log("posted", g)

    def log(self, event: str, group: int) -> None:
        if self.events is not None:
            self.events.append((event, group, time.monotonic()))

    def recv(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The next group's stream from the previous stage, once it has arrived."""
        g, self.taken = self.taken, self.taken + 1
        h, residual, works = self.inbox[g]
        assert h.shape[0] == rows, f"group {g}: {rows} rows expected, {h.shape[0]} posted"
        for w in works:
            w.wait()
        self.log("received", g)
        return h, residual

    def send(self, h: torch.Tensor, residual: torch.Tensor) -> None:
        """This group's stream ([T_g, H] x 2) on its way to the next stage."""
        g = len(self.sent)
        pair = (h.contiguous(), residual.contiguous())
        works = [torch.distributed.isend(t, dst=self.stage.next, tag=2 * g + i)
                 for i, t in enumerate(pair)]
        self.sent.append((pair, works))
        self.log("sent", g)

    def finish(self) -> None:
        for _, works in self.sent:
            for w in works:
                w.wait()
        self.log("sends done", len(self.sent))


def forward_groups(model, cache, seq_ids, counts, tokens: torch.Tensor, micro_batches: int,
                   last_rows: bool, long_rows=None):
    """The eager step of ``ModelRunner`` in micro-batches: tokens [T] of sequences
    ``seq_ids`` (``counts`` each) -> logits [B or T, V] float32 in the step's order (the
    last token's row of each sequence with ``last_rows``, else every row), or None where
    this rank has none (a stage before the last; a rank of the last stage's tp group
    that is not its rank 0). ``long_rows``: [T], LongRoPE's (``DecoderModel.forward``)."""
    stage = model.stage
    groups = split_step(counts, micro_batches)
    exchange = StepExchange(stage, [g.tokens for g in groups], model.spec.hidden_size,
                            model.dtype, tokens.device, stage.events)
    stage.exchange = exchange  # the model's stage.recv / stage.send go through it
    outs = []
    try:
        for k, g in enumerate(groups):
            meta = cache.prepare([seq_ids[i] for i in g.seqs], list(g.counts))
            rows = g.last_rows() if last_rows else None
            # a group of middle pieces only samples nothing: one row, dropped (no head
            # kernel launched over zero rows)
            index = None if rows is None else torch.tensor(
                rows or [g.tokens - 1], dtype=torch.long, device=tokens.device)
            exchange.log("compute", k)
            piece = slice(g.offset, g.offset + g.tokens)
            out = model(tokens[piece], cache, meta, index,
                        long_rows=None if long_rows is None else long_rows[piece])
            outs.append(out if out is None or rows is None or rows else out[:0])
            exchange.log("computed", k)
        exchange.finish()
    finally:
        stage.exchange = None
    if any(o is None for o in outs):
        return None
    return torch.cat(outs)  # [B or T, V]
