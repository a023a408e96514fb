"""Block bookkeeping for paged KV caches: a ref-counted allocator of block ids, and the
validated pool size (block size, block count) the paged and offload backends share."""
from __future__ import annotations

from infergraft.core.cache import CacheFullError
from infergraft.core.errors import PlanError


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


def is_count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def held_blocks(plan, block_size) -> int:
    """The most blocks one sequence holds once its prompt is in: all of max_seq_len, or
    with a sliding window W (out-of-window blocks go back to the pool at each step) the
    window's blocks, the one being filled, and one taken before the step drops one."""
    per_seq = blocks_for(plan.max_seq_len, block_size)
    window = getattr(plan, "sliding_window", None)
    return min(per_seq, blocks_for(window, block_size) + 2) if window else per_seq


def cache_sizes(plan, block_size, num_blocks, name="paged") -> tuple[int, int]:
    """Validated (block_size, num_blocks). By default one max_seq_len sequence (a prompt
    holds all its blocks until its first decode step) and ``held_blocks`` for each other
    batch slot: without a window, one max_seq_len per slot."""
    if not is_count(block_size) or block_size < 1:
        raise PlanError(f"{name}: block_size must be an integer >= 1, got {block_size!r}")
    per_seq = blocks_for(plan.max_seq_len, block_size)
    if num_blocks is None:
        return block_size, per_seq + (plan.max_batch_size - 1) * held_blocks(plan, block_size)
    if not is_count(num_blocks) or num_blocks < per_seq:
        raise PlanError(f"{name}: num_blocks must be an integer >= {per_seq} (one "
                        f"max_seq_len={plan.max_seq_len} sequence in blocks of {block_size}), "
                        f"got {num_blocks!r}")
    return block_size, num_blocks
