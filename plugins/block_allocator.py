"""Block bookkeeping for paged KV caches: a ref-counted allocator of block ids."""
from __future__ import annotations

from infergraft.core.cache import CacheFullError


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class BlockAllocator:
    """Block ids with reference counts; a block is free exactly when its count is 0."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.refs = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[int]:
        if n > len(self._free):
            raise CacheFullError(f"need {n} blocks, {len(self._free)} of {self.num_blocks} free")
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self.refs[b] = 1
        return out

    def share(self, b: int) -> None:
        assert self.refs[b] > 0, f"block {b} is free; it cannot be shared"
        self.refs[b] += 1

    def release(self, b: int) -> bool:
        """Drop one reference; True if the block became free."""
        if self.refs[b] <= 0:
            raise AssertionError(f"block {b} released while free (double free)")
        self.refs[b] -= 1
        if self.refs[b] == 0:
            self._free.append(b)
            return True
        return False

    def check(self, tables) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        counted = [0] * self.num_blocks
        for table in tables:
            for b in table:
                counted[b] += 1
        for b, (r, c) in enumerate(zip(self.refs, counted)):
            assert r >= 0, f"block {b} has a negative ref count {r}"
            assert r == c, f"block {b}: ref count {r} but {c} table entries (leak or double free)"
            assert (b in free) == (r == 0), f"block {b}: ref count {r} but free={b in free}"
