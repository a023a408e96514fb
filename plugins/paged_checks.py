"""The paged cache's accounting checks (``PagedCache.check_invariants``; the cache kit's
state machine runs them after every step), and the K/V formats its backends accept."""
from __future__ import annotations

from infergraft.core.errors import PlanError
from infergraft.kernels.kv_write import KV_STORAGE_DTYPES

from .block_allocator import blocks_for

HOLE = -1  # a table entry whose block went back to the pool (out of every later window)


def check_tables(cache) -> None:
    """AssertionError unless the allocator's counts, the tables, their host rows and the
    lengths agree, and no sequence's next tokens would land in a shared or cached block."""
    cache.allocator.check(cache._live_blocks(s) for s in cache._tables)
    cache._rows.check(cache._tables)
    bs, window = cache.block_size, cache.window
    for s, table in cache._tables.items():
        n = cache._len[s]
        holes = table.count(HOLE)
        assert table[:holes] == [HOLE] * holes, f"sequence {s!r}: holes after live blocks {table}"
        assert holes * bs <= max(0, n - (window or n)), \
            f"sequence {s!r} dropped {holes} blocks of {n} tokens (window {window})"
        assert 0 <= n <= cache.max_seq_len, f"sequence {s!r} holds {n} tokens"
        want = blocks_for(max(n, cache._reserved[s]), bs)
        assert len(table) == want, f"sequence {s!r}: {len(table)} blocks for {n} tokens " \
                                   f"(reserved {cache._reserved[s]}), expected {want}"
        for b in table[n // bs:]:  # blocks the next tokens go to are never shared
            assert cache.allocator.refs[b] == 1, f"sequence {s!r} would write shared block {b}"
            assert cache.prefix is None or not cache.prefix.holds(b), \
                f"sequence {s!r} would write block {b}, which the prefix cache holds"


def check_kv_quantizer(name, kv_quantizer) -> None:
    """PlanError unless the block caches can store ``kv_quantizer``'s K/V format."""
    if kv_quantizer is not None and kv_quantizer.kv_dtype not in KV_STORAGE_DTYPES:
        raise PlanError(f"{name}: cannot store K/V as {kv_quantizer.kv_dtype!r} (quantizer "
                        f"{kv_quantizer.name!r}); supported: {', '.join(KV_STORAGE_DTYPES)}")
