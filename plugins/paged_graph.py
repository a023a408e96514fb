"""Static metadata that lets CUDA graphs capture paged-cache steps.

A captured graph reads its inputs from fixed device buffers; these methods build those
buffers once per bucket and refill them in place before each replay: decode per
batch-size bucket, any mixed step (prompt chunks and decode tokens) per token-count
bucket.

The block tables are as wide as ``max_seq_len`` allows, but a step gathers only the entries
its longest sequence uses (columns past them keep stale ids nobody reads), so the host's
work on them grows with the sequences' lengths, not with ``max_seq_len``. Each step copies
one prefix of its flat buffer: the live rows (and a decode bucket's padding rows, which
repeat the last one and must attend as it does).
"""
from __future__ import annotations

import itertools

import attrs
import torch

from infergraft.core.runner.cuda_graph import PinnedStaging
from infergraft.core.runner.host_tensors import from_ints

from .block_allocator import blocks_for

#: the largest token bucket whose rows' inputs are built as Python lists, written in one
#: copy (decode and verify steps: a tensor op costs more host time than the whole list);
#: above it, by tensor ops (prompt chunks: a list's cost grows with the bucket's rows)
LIST_ROWS = 512


@attrs.frozen
class PagedMeta:
    positions: torch.Tensor  # [T] absolute positions
    slot_block: torch.Tensor  # [T] storage block of each new token (-1: padding, not written)
    slot_offset: torch.Tensor  # [T] offset inside it
    # [B, max_blocks] int32, padded with 0; in the graph buffers, ids past the step's
    # longest sequence are stale
    block_tables: torch.Tensor
    context_lens: torch.Tensor  # [B] int32, tokens after this step
    decode: bool  # every sequence adds exactly one token
    # other steps: each sequence's first row in the step's token dimension, [B + 1] int32
    cu_seqlens_q: torch.Tensor | None = None

    @classmethod
    def of(cls, phys: list, starts: list, counts: list, block_size: int, device) -> "PagedMeta":
        """An eager step's metadata: sequence b's storage blocks ``phys[b]``, its tokens
        before the step ``starts[b]``, its new ones ``counts[b]``."""
        bs, width = block_size, max(map(len, phys))
        tables = torch.tensor([p + [0] * (width - len(p)) for p in phys], dtype=torch.int32)
        positions = torch.cat([torch.arange(st, st + n) for st, n in zip(starts, counts)])
        rows = torch.repeat_interleave(torch.arange(len(phys)), torch.tensor(counts))  # [T]
        decode = all(n == 1 for n in counts)
        cu = None if decode else torch.tensor([0, *itertools.accumulate(counts)],
                                              dtype=torch.int32)  # [B + 1]
        dev = device
        return cls(positions.to(dev), tables[rows, positions // bs].to(dev),
                   (positions % bs).to(dev), tables.to(dev),  # [B, max_blocks]
                   torch.tensor([st + n for st, n in zip(starts, counts)],
                                dtype=torch.int32).to(dev),  # [B]
                   decode, None if cu is None else cu.to(dev))


class PagedGraphInputs:
    """Mixed into PagedCache (uses its `_advance`, tables and lengths)."""

    supports_cuda_graphs = True
    supports_step_graphs = True
    supports_prefill_graphs = False  # a fresh prompt is one more mixed step

    # -- decode: one token for each of B sequences ------------------------------------------
    def static_decode_meta(self, batch: int) -> PagedMeta:
        """Decode metadata for ``batch`` rows; ``prepare_decode_into`` refills it."""
        width = blocks_for(self.max_seq_len, self.block_size)
        pin = self.device.type == "cuda"
        # one flat int64 buffer holds every input, so each step copies it in one go
        host = torch.zeros(4 * batch + -(-batch * width // 2), dtype=torch.long)
        flat = host.to(self.device)
        self._graph_buffers = getattr(self, "_graph_buffers", {})
        self._graph_buffers[batch] = (PinnedStaging(host, pin), flat, width)
        scalars, tables = _decode_views(flat, batch, width)
        positions, blocks, offsets, lens = scalars.unbind(0)  # views of one [4, B] tensor
        return PagedMeta(positions, blocks, offsets, tables, lens, True)

    def prepare_decode_into(self, meta: PagedMeta, seq_ids) -> None:
        """One more token for each sequence (blocks grow as in ``prepare``); rows past
        the live batch repeat the last one (same slot, same values: benign)."""
        batch = meta.positions.shape[0]
        staging, flat, width = self._graph_buffers[batch]
        bs, n = self.block_size, len(seq_ids)
        pos = torch.tensor(self._advance(seq_ids, [1] * n))  # [n]
        used = blocks_for(int(pos.max()) + 1, bs)  # table entries the longest one reads
        host = staging.next()  # rewritten below, but for the columns no sequence uses
        scalars, tables = _decode_views(host, batch, width)
        tables[:n, :used] = self._rows.gather(seq_ids, used)  # [n, used]
        scalars[0, :n], scalars[2, :n], scalars[3, :n] = pos, pos % bs, pos + 1
        scalars[1, :n] = tables[:n, :used].gather(1, (pos // bs)[:, None])[:, 0]
        scalars[:, n:] = scalars[:, n - 1:n]
        tables[n:, :used] = tables[n - 1, :used]
        flat.copy_(host, non_blocking=True)  # positions, slots, lengths and tables at once

    # -- any step of up to T tokens over up to S sequences ----------------------------------
    def static_step_meta(self, tokens: int, seqs: int) -> PagedMeta:
        """Metadata of a mixed step padded to ``tokens`` rows and ``seqs`` sequences;
        ``prepare_step_into`` refills it. Padding rows are written nowhere (block -1) and
        belong to no sequence; padding sequences feed no row and hold no key."""
        width = blocks_for(self.max_seq_len, self.block_size)
        host = torch.zeros(_step_slots(tokens, seqs, width), dtype=torch.long)
        host[tokens:2 * tokens] = -1  # every row padding (the capture writes no K/V)
        flat = host.to(self.device)
        staging = PinnedStaging(host, self.device.type == "cuda")
        self._step_buffers = getattr(self, "_step_buffers", {})
        self._step_buffers[tokens, seqs] = (staging, flat, width)
        # each staging buffer's views, made once (a view is a tensor op: a step's host time)
        self._host_views = getattr(self, "_host_views", {})
        self._host_views[tokens, seqs] = {id(b): _step_host_views(b, tokens, seqs, width)
                                          for b in staging.buffers}
        rows, cu, lens, tables = _step_views(flat, tokens, seqs, width)
        positions, blocks, offsets = rows.unbind(0)
        return PagedMeta(positions, blocks, offsets, tables, lens, False, cu)

    def prepare_step_into(self, meta: PagedMeta, seq_ids, counts) -> None:
        """Place ``counts[j]`` new tokens after each sequence (as ``prepare``) and write
        where they go into ``meta``'s buffers."""
        tokens, seqs = meta.positions.shape[0], meta.context_lens.shape[0]
        staging, flat, width = self._step_buffers[tokens, seqs]
        n, t, bs = len(seq_ids), sum(counts), self.block_size
        if n > seqs or t > tokens:
            raise ValueError(f"a step of {n} sequences and {t} tokens does not fit graph "
                             f"buffers of {seqs} sequences and {tokens} tokens")
        starts = self._advance(seq_ids, counts)
        ends = [st + c for st, c in zip(starts, counts)]
        host = staging.next()  # rewritten below, but for the columns no sequence uses
        rows, scalars, tables = self._host_views[tokens, seqs][id(host)]
        used = blocks_for(max(ends), bs)  # table entries the longest one reads
        tables[:n, :used] = self._rows.gather(seq_ids, used)  # [n, used]
        # cu [S + 1], then lens [S] (padding sequences hold no row)
        cu = [0, *itertools.accumulate(counts)] + [t] * (seqs - n)
        scalars.copy_(from_ints(cu + ends + [0] * (seqs - n), torch.int32))
        # each row's position, storage block and offset in it; padding rows: (0, -1, 0)
        if tokens <= LIST_ROWS:
            rows.copy_(self._rows_as_lists(seq_ids, starts, ends, tokens).view(3, tokens))
        else:
            count_t = from_ints(counts)
            seq_of = torch.repeat_interleave(count_t)  # [t] row -> sequence
            pos = from_ints([st - c for st, c in zip(starts, cu)])[seq_of] + torch.arange(t)
            rows[0, :t], rows[1, :t], rows[2, :t] = pos, tables[seq_of, pos // bs], pos % bs
            rows[0, t:], rows[1, t:], rows[2, t:] = 0, -1, 0
        # the live sequences' rows (the padding ones, of length 0, attend to nothing)
        slots = _step_slots(tokens, seqs, width, rows=n)
        flat[:slots].copy_(host[:slots], non_blocking=True)

    def _rows_as_lists(self, seq_ids, starts, ends, tokens: int) -> torch.Tensor:
        """A small step's rows [3 * tokens]: positions, blocks, offsets, each padded to
        ``tokens`` (a Python iteration a sequence and a block; a row costs list copies in C)."""
        pos, blocks, offsets, bs = [], [], [], self.block_size
        for s, start, end in zip(seq_ids, starts, ends):
            table, p, (j, off) = self._tables[s], start, divmod(start, bs)
            pos += range(start, end)
            while p < end:  # block by block
                m = min(bs - off, end - p)
                blocks += [table[j]] * m
                offsets += range(off, off + m)
                p, j, off = p + m, j + 1, 0
        pad = tokens - len(pos)
        return from_ints(pos + [0] * pad + blocks + [-1] * pad + offsets + [0] * pad)


def _step_slots(tokens: int, seqs: int, width: int, rows: int | None = None) -> int:
    """int64 slots of a step's flat buffer (up to its first ``rows`` table rows): 3 rows of
    ``tokens``, then int32 values packed two to a slot: cu [seqs + 1], lens [seqs], tables
    [seqs, width]."""
    rows = seqs if rows is None else rows
    return 3 * tokens + -(-(2 * seqs + 1 + rows * width) // 2)


def _step_views(flat: torch.Tensor, tokens: int, seqs: int, width: int):
    """rows [3, T] int64 (positions, blocks, offsets), cu [S + 1], lens [S] and tables
    [S, width] (int32) inside one flat int64 buffer."""
    small = flat[3 * tokens:].view(torch.int32)
    cu, lens = small[:seqs + 1], small[seqs + 1:2 * seqs + 1]
    tables = small[2 * seqs + 1:2 * seqs + 1 + seqs * width].view(seqs, width)
    return flat[:3 * tokens].view(3, tokens), cu, lens, tables


def _step_host_views(flat: torch.Tensor, tokens: int, seqs: int, width: int):
    """``_step_views``' rows and tables, and between them cu and lens as one int32 view
    [2S + 1] (adjacent: one copy fills both)."""
    rows, _, _, tables = _step_views(flat, tokens, seqs, width)
    return rows, flat[3 * tokens:].view(torch.int32)[:2 * seqs + 1], tables


def _decode_views(flat: torch.Tensor, batch: int, width: int):
    """The decode inputs inside one flat int64 buffer: scalars [4, B] (positions, blocks,
    offsets, lengths) and the block tables [B, width] int32 packed two to a slot after them."""
    tables = flat[4 * batch:].view(torch.int32)[:batch * width].view(batch, width)
    return flat[:4 * batch].view(4, batch), tables
