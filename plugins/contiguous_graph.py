"""Step metadata of the contiguous cache, and its static forms for CUDA graphs.

A captured graph reads its inputs from fixed device buffers; the mixin builds those
once per bucket and refills them in place before each replay: decode per batch-size
bucket, a fresh prompt's prefill per prompt-length bucket.
"""
from __future__ import annotations

import attrs
import torch

from infergraft.core.runner.cuda_graph import PinnedStaging
from infergraft.core.runner.prefill_graph import check_fresh_prompt


@attrs.frozen
class ContiguousMeta:
    positions: torch.Tensor  # [T] absolute positions
    rows: list[int]  # cache row of each sequence
    starts: list[int]  # tokens already cached before this step
    counts: list[int]  # new tokens this step
    row_index: torch.Tensor  # [T] row of each new token
    decode: bool  # every sequence adds exactly one token
    row_span: slice | None  # rows form one contiguous range (batched decode)
    # rolling-buffer mode only (None otherwise):
    slots: torch.Tensor | None = None  # [T] ring column of each new token (pos % W)
    keep: torch.Tensor | None = None  # [T'] new tokens to write (the last W of each sequence)
    row_ids: torch.Tensor | None = None  # [B] rows, for gathering when they are not a span


@attrs.frozen
class DeviceDecodeMeta:
    """Decode metadata as device tensors only, so a CUDA graph can capture the step.

    ``table`` is [4, B] int64 (one host-to-device copy per step): positions, rows,
    ring/sequence columns, context lengths.
    """

    table: torch.Tensor
    positions: torch.Tensor  # [B] views into table
    rows: torch.Tensor
    columns: torch.Tensor
    context_lens: torch.Tensor
    host: "PinnedStaging"  # pinned [4, B] staging buffers, used in turn
    decode: bool = True


class ContiguousGraphInputs:
    """Mixed into ContiguousCache (uses its rows, lengths and K/V store)."""

    supports_cuda_graphs = True

    def static_decode_meta(self, batch: int) -> DeviceDecodeMeta:
        """Metadata tensors for ``batch`` rows (row 0, position 0 until filled)."""
        host = torch.tensor([[0], [0], [0], [1]], dtype=torch.long).repeat(1, batch)
        table = host.to(self.device)
        return DeviceDecodeMeta(table, *table.unbind(0),
                                host=PinnedStaging(host, self.device.type == "cuda"))

    def prepare_decode_into(self, meta: DeviceDecodeMeta, seq_ids) -> None:
        """Advance each sequence by one token and fill ``meta`` in place. Padding rows
        repeat the last live row: they write the same values to the same slot (a benign
        duplicate) and their outputs are dropped, so no scratch storage is needed."""
        n = len(seq_ids)
        self._check_step(seq_ids, [1] * n)
        host = meta.host.next()  # rewritten in full below
        cols = []  # one host write per step, not four per sequence
        for s in seq_ids:
            pos = self._len[s]
            self._len[s] = pos + 1
            cols.append((pos, self._row[s], pos % self.width, pos + 1))
        host[:, :n] = torch.tensor(cols, dtype=torch.long).T
        host[:, n:] = host[:, n - 1:n]
        meta.table.copy_(host, non_blocking=True)

    def _device_decode(self, layer, q, k, v, meta):
        # cache as paged blocks [R, W, Hkv, D] (int8 scales [R, W, Hkv]): one block per
        # row, repeated along the table so that position p maps to column p % W
        self.kv.write(layer, k, v, meta.rows, meta.columns)
        kview, vview, k_scale, v_scale = self.kv.views(layer)
        blocks = -(-self.max_seq_len // self.width)
        tables = meta.rows[:, None].expand(-1, blocks)  # [B, blocks]
        a = self.layer_attn[layer]  # a ring: its one window (p % W); else the layer's own
        return self.ops.paged_attention(q, kview, vview, tables, meta.context_lens, a.scale,
                                        a.window, k_scale, v_scale, softcap=a.softcap,
                                        counters=self.counters)

    # -- prefill: one fresh prompt, padded to its length bucket -------------------------------
    @property
    def supports_prefill_graphs(self) -> bool:
        # a ring buffer keeps the last W rows of the padded prompt; int8 attends over the
        # dequantised cache: both depend on the real length, which a graph cannot
        return self.window is None and not self.kv.quant

    def static_prefill_meta(self, length: int) -> ContiguousMeta:
        """Metadata of a fresh prompt padded to ``length`` tokens; every row starts as
        padding (row -1: its K/V are written nowhere) until ``prepare_prefill_into``."""
        pin = self.device.type == "cuda"
        host = torch.full((length,), -1, dtype=torch.long, pin_memory=pin)
        row_index = host.to(self.device)
        self._prefill_buffers = getattr(self, "_prefill_buffers", {})
        self._prefill_buffers[length] = (host, row_index)
        positions = torch.arange(length, device=self.device)  # padding continues the prompt
        # causal attention keeps the real rows (which come first) blind to the padding
        return ContiguousMeta(positions, [], [0], [length], row_index, False, None)

    def prepare_prefill_into(self, meta: ContiguousMeta, seq_id, n: int) -> None:
        """Sequence ``seq_id`` (allocated, still empty) takes its first ``n`` tokens
        through ``meta``; rows ``n..`` stay padding."""
        length = check_fresh_prompt(meta, seq_id, self._len[seq_id], n)
        self._check_step([seq_id], [n])
        self._len[seq_id] = n
        host, row_index = self._prefill_buffers[length]
        host[:n] = self._row[seq_id]
        host[n:] = -1
        row_index.copy_(host, non_blocking=True)
