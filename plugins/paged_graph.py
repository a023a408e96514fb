"""Static metadata that lets CUDA graphs capture paged-cache steps.

A captured graph reads its inputs from fixed device buffers; these methods build those
buffers once per bucket and refill them in place before each replay: decode per
batch-size bucket, a fresh prompt's prefill per prompt-length bucket.
"""
from __future__ import annotations

import attrs
import torch

from infergraft.core.runner.cuda_graph import PinnedStaging
from infergraft.core.runner.prefill_graph import check_fresh_prompt

from .block_allocator import blocks_for


@attrs.frozen
class PagedMeta:
    positions: torch.Tensor  # [T] absolute positions
    slot_block: torch.Tensor  # [T] storage block of each new token (-1: padding, not written)
    slot_offset: torch.Tensor  # [T] offset inside it
    starts: list[int]  # tokens cached before this step
    counts: list[int]  # new tokens this step
    tables: list[torch.Tensor]  # per sequence: its storage blocks
    block_tables: torch.Tensor | None  # [B, max_blocks] int32, padded with 0 (decode)
    context_lens: torch.Tensor | None  # [B] int32, tokens after this step (decode)
    decode: bool  # every sequence adds exactly one token
    # prefill steps: decode tokens riding along (one token on a cached prefix), as
    # (their rows in the step [R], their sequences' indices [R]) on the device, or None
    riders: tuple | None = None


class PagedGraphInputs:
    """Mixed into PagedCache (uses its `_advance`, tables and lengths)."""

    supports_cuda_graphs = True

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
        return PagedMeta(positions, blocks, offsets, [], [], [], tables, lens, True)

    def prepare_decode_into(self, meta: PagedMeta, seq_ids) -> None:
        """One more token for each sequence (blocks grow as in ``prepare``); rows past
        the live batch repeat the last one (same slot, same values: benign)."""
        batch = meta.positions.shape[0]
        staging, flat, width = self._graph_buffers[batch]
        bs, n = self.block_size, len(seq_ids)
        starts = self._advance(seq_ids, [1] * n)
        host = staging.next()  # rewritten in full below
        scalars, tables = _decode_views(host, batch, width)
        cols, rows = [], []  # one host write each per step, not two per sequence
        for s, pos in zip(seq_ids, starts):
            phys = self._physical(self._tables[s])
            cols.append((pos, phys[pos // bs], pos % bs, pos + 1))
            rows.append(phys + [0] * (width - len(phys)))  # padded like prepare's tables
        scalars[:, :n] = torch.tensor(cols, dtype=torch.long).T
        tables[:n] = torch.tensor(rows, dtype=torch.int32)
        scalars[:, n:] = scalars[:, n - 1:n]
        tables[n:] = tables[n - 1]
        flat.copy_(host, non_blocking=True)  # positions, slots, lengths and tables at once

    # -- prefill: one fresh prompt, padded to its length bucket -------------------------------
    @property
    def supports_prefill_graphs(self) -> bool:
        # int8 K/V: a prefill attends over the dequantised cache (a gather sized per prompt)
        return not self.quant

    def static_prefill_meta(self, length: int) -> PagedMeta:
        """Metadata of a fresh prompt padded to ``length`` tokens; every row starts as
        padding (block -1: its K/V are written nowhere) until ``prepare_prefill_into``."""
        pin = self.device.type == "cuda"
        host = torch.full((2, length), -1, dtype=torch.long, pin_memory=pin)
        slots = host.to(self.device)
        self._prefill_buffers = getattr(self, "_prefill_buffers", {})
        self._prefill_buffers[length] = (host, slots)
        positions = torch.arange(length, device=self.device)  # padding continues the prompt
        blocks, offsets = slots.unbind(0)
        # causal attention keeps the real rows (which come first) blind to the padding
        return PagedMeta(positions, blocks, offsets, [0], [length], [], None, None, False)

    def prepare_prefill_into(self, meta: PagedMeta, seq_id, n: int) -> None:
        """Sequence ``seq_id`` (allocated, still empty) takes its first ``n`` tokens
        through ``meta``; rows ``n..`` stay padding."""
        length = check_fresh_prompt(meta, seq_id, self._len[seq_id], n)
        self._advance([seq_id], [n])
        bs, host, slots = self.block_size, *self._prefill_buffers[length]
        pos = torch.arange(n)
        host[0, :n] = torch.tensor(self._physical(self._tables[seq_id]), dtype=torch.long)[pos // bs]
        host[1, :n] = pos % bs
        host[:, n:] = -1
        slots.copy_(host, non_blocking=True)


def _decode_views(flat: torch.Tensor, batch: int, width: int):
    """The decode inputs inside one flat int64 buffer: scalars [4, B] (positions, blocks,
    offsets, lengths) and the block tables [B, width] int32 packed two to a slot after them."""
    tables = flat[4 * batch:].view(torch.int32)[:batch * width].view(batch, width)
    return flat[:4 * batch].view(4, batch), tables
