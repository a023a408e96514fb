"""Block bookkeeping for paged KV caches: a ref-counted allocator of block ids, the
validated pool size (block size, block count) the paged and offload backends share (the
paged one's default sized to the memory budget, ``gpu_memory_utilization``), and the
window behind which blocks go back to the pool."""
from __future__ import annotations

# blocks_for and held_blocks live with the pool's size (core/budget.py); also named here
from infergraft.core.budget import (blocks_for, check_utilization,  # noqa: F401
                                    default_blocks, held_blocks, pool_blocks)
from infergraft.core.cache import CacheFullError
from infergraft.core.errors import PlanError
from infergraft.core.units import fmt_bytes


def drop_window(spec, model_window):
    """The window behind which a block may go back to the pool: the model's (every
    layer's, ``spec.kv_window`` of the whole model: ``Plan.sliding_window``) where this
    spec's layers all have one, so that every pipeline stage drops the same blocks and
    schedules alike; never less than this spec's own. None: keep every block."""
    if spec.kv_window is None or model_window is None:
        return None
    return max(spec.kv_window, model_window)


class BlockAllocator:
    """Block ids with reference counts; a block is free exactly when its count is 0.

    With a ``PrefixIndex`` a free block the index still holds stays apart (evictable,
    least recently released first): it is given out only when no other free block is
    left, and then forgotten by the index; ``revive`` takes one back for a prefix hit."""

    def __init__(self, num_blocks: int, index=None):
        self.num_blocks, self.index = num_blocks, index
        self.refs = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._evictable: dict[int, None] = {}  # insertion order: least recently released first

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def take(self, n: int) -> list[int]:
        if n > self.num_free:
            raise CacheFullError(f"need {n} blocks, {self.num_free} of {self.num_blocks} free")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            else:  # the least recently released cached block
                b = next(iter(self._evictable))
                del self._evictable[b]
                self.index.forget(b)
            self.refs[b] = 1
            out.append(b)
        return out

    def share(self, b: int) -> None:
        assert self.refs[b] > 0, f"block {b} is free; it cannot be shared"
        self.refs[b] += 1

    def revive(self, b: int) -> None:
        """One more reference to a cached block, free (evictable) or in use."""
        if self.refs[b] == 0:
            del self._evictable[b]
        self.refs[b] += 1

    def release(self, b: int) -> bool:
        """Drop one reference; True if the block became free."""
        if self.refs[b] <= 0:
            raise AssertionError(f"block {b} released while free (double free)")
        self.refs[b] -= 1
        if self.refs[b] == 0:
            if self.index is not None and self.index.holds(b):
                self._evictable[b] = None
            else:
                self._free.append(b)
            return True
        return False

    def check(self, tables) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert not free & set(self._evictable), "a block is both free and evictable"
        free |= set(self._evictable)
        counted = [0] * self.num_blocks
        for table in tables:
            for b in table:
                counted[b] += 1
        for b, (r, c) in enumerate(zip(self.refs, counted)):
            assert r >= 0, f"block {b} has a negative ref count {r}"
            assert r == c, f"block {b}: ref count {r} but {c} table entries (leak or double free)"
            assert (b in free) == (r == 0), f"block {b}: ref count {r} but free={b in free}"
        if self.index is not None:
            self.index.check()
            assert all(self.index.holds(b) for b in self._evictable), "an evictable block is not cached"
            assert not any(self.index.holds(b) for b in self._free), "a cached block is on the free list"


def is_count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


UNSIZED = object()  # cache_sizes without a utilisation: the default pool (offload's)


def cache_sizes(plan, block_size, num_blocks, name="paged",
                gpu_memory_utilization=UNSIZED) -> tuple[int, int]:
    """Validated (block_size, num_blocks). ``num_blocks`` given: that many. By default
    what max_batch_size sequences hold (``core.budget.default_blocks``). With
    ``gpu_memory_utilization`` (the paged backend's) and a plan carrying its
    ``memory_budget`` (``core.build``), that default is cut to what the fraction of the
    budget leaves beside the weights and the activations (``core.budget.pool_blocks``) and
    to the plan's ``pool_tokens``; PlanError, with the numbers, below one sequence."""
    if not is_count(block_size) or block_size < 1:
        raise PlanError(f"{name}: block_size must be an integer >= 1, got {block_size!r}")
    sized = gpu_memory_utilization is not UNSIZED
    if sized:
        gpu_memory_utilization = check_utilization(gpu_memory_utilization,
                                                   f"{name}: gpu_memory_utilization")
    per_seq = blocks_for(plan.max_seq_len, block_size)
    if num_blocks is not None:
        if not is_count(num_blocks) or num_blocks < per_seq:
            raise PlanError(f"{name}: num_blocks must be an integer >= {per_seq} (one "
                            f"max_seq_len={plan.max_seq_len} sequence in blocks of "
                            f"{block_size}), got {num_blocks!r}")
        return block_size, num_blocks
    budget = getattr(plan, "memory_budget", None)
    if not sized or budget is None:
        return block_size, default_blocks(plan, block_size)
    n = pool_blocks(plan, budget, block_size, gpu_memory_utilization,
                    cuda=str(plan.device).startswith("cuda"))
    if getattr(plan, "pool_tokens", None) is not None:
        n = min(n, plan.pool_tokens // block_size)
    if n < per_seq:
        raise PlanError(pool_refusal(plan, name, block_size, n, per_seq,
                                     gpu_memory_utilization))
    return block_size, n


def pool_refusal(plan, name, block_size, blocks, per_seq, utilization) -> str:
    """Why a pool sized to the budget is refused: the numbers, and what to change."""
    block_bytes = block_size * plan.kv_bytes_per_token
    steps = plan.max_num_batched_tokens
    room = int(plan.memory_budget * utilization) - plan.device_weight_bytes \
        - plan.activation_bytes
    left = f"{fmt_bytes(room)}, {blocks} blocks" if room > 0 else "nothing"
    return (f"{name}: the K/V pool cannot hold one max_seq_len={plan.max_seq_len} sequence "
            f"({per_seq} blocks of {block_size} tokens, {fmt_bytes(per_seq * block_bytes)}): "
            f"gpu_memory_utilization {utilization:g} x the budget "
            f"{fmt_bytes(plan.memory_budget)} - weights on the device "
            f"{fmt_bytes(plan.device_weight_bytes)} - activations "
            f"{fmt_bytes(plan.activation_bytes)}" + (f" ({steps}-token steps)" if steps else "")
            + f" leaves {left}. Lower max_seq_len or max_num_batched_tokens, raise "
            "gpu_memory_utilization or device_memory, store K/V as int8 (plugins=['paged', "
            "'kv-int8']), or use a smaller dtype")
