"""Every sequence's block table as one row of a host int32 tensor, kept as the tables
change, so that a step's tables are one gather and not a Python list per sequence (at
hundreds of running sequences that list cost the host more than the GPU's step)."""
from __future__ import annotations

import torch

from infergraft.core.runner.host_tensors import from_ints


class TableRows:
    """Rows of ``width`` block ids (0 past a sequence's blocks and for its holes: a
    negative id)."""

    def __init__(self, width: int):
        self.width = width
        self.rows = torch.zeros((0, width), dtype=torch.int32)
        self._slot: dict = {}  # seq id -> its row
        self._free: list[int] = []

    def add(self, seq_id, blocks: list[int]) -> None:
        if not self._free:  # double the rows (graph steps copy from them, never hold them)
            n = self.rows.shape[0]
            self.rows = torch.cat([self.rows, torch.zeros((max(16, n), self.width),
                                                          dtype=torch.int32)])
            self._free = list(range(self.rows.shape[0] - 1, n - 1, -1))
        slot = self._slot[seq_id] = self._free.pop()
        self.rows[slot] = 0
        self.put(seq_id, 0, blocks)

    def put(self, seq_id, start: int, blocks: list[int]) -> None:
        """Entries ``start..`` of ``seq_id``'s row become ``blocks`` (a hole: 0)."""
        if blocks:
            self.rows[self._slot[seq_id], start:start + len(blocks)] = \
                from_ints(blocks, torch.int32).clamp_(min=0)

    def remove(self, seq_id) -> None:
        self._free.append(self._slot.pop(seq_id))

    def gather(self, seq_ids, columns: int | None = None) -> torch.Tensor:
        """The first ``columns`` entries (all: None) of the rows of ``seq_ids``, in order:
        [n, columns] int32."""
        index = from_ints([self._slot[s] for s in seq_ids])
        return self.rows[:, :columns].index_select(0, index)

    def check(self, tables: dict) -> None:
        """AssertionError unless the rows hold exactly ``tables`` (seq id -> block ids, a
        negative id a hole), zero-padded."""
        assert set(self._slot) == set(tables), f"rows for {set(self._slot)} != {set(tables)}"
        for s, table in tables.items():
            want = [max(b, 0) for b in table] + [0] * (self.width - len(table))
            assert self.rows[self._slot[s]].tolist() == want, f"sequence {s!r}'s row"
