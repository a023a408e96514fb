"""Paged KV cache: fixed-size blocks, a ref-counted block allocator, per-sequence tables.

Per layer K and V are ``[num_blocks, block_size, Hkv, D]`` (int8 or e4m3 K/V add float32 scales
``[num_blocks, block_size, Hkv]``). Token ``p`` of a sequence lives at
``(table[p // block_size], p % block_size)``. A sequence takes blocks as it grows and
returns them when freed, so the only waste is its last, partial block. ``fork`` shares
a parent's full blocks (ref-counted) and copies its partial one, so shared blocks are
never written (copy-on-write done eagerly, at the fork). With a sliding window W on
every layer (``spec.layer_attention``), a block no later query can see (all before
``start - W + 1`` of a step) goes back to the pool: its table entry becomes ``HOLE``
(storage block 0 in the tables the kernels get; the decode kernel starts at ``length -
W`` and never reads it); with global layers too (Gemma) none leaves every window.
"""
from __future__ import annotations

import torch

from infergraft.core.cache import CacheBackend, CacheFullError, KVCache
from infergraft.core.hookspecs import hookimpl
from infergraft.kernels.kv_write import KV_STORAGE_DTYPES

from .block_allocator import BlockAllocator, blocks_for, cache_sizes, drop_window
from .kv_swap import SwapSpace
from .paged_checks import HOLE, check_kv_quantizer, check_tables
from .paged_graph import PagedGraphInputs, PagedMeta
from .paged_prefix import PrefixCaching
from .prefix_cache import PrefixIndex
from .table_rows import TableRows

class PagedCache(SwapSpace, PrefixCaching, PagedGraphInputs, KVCache):
    def __init__(self, spec, *, max_seq_len, block_size, num_blocks, device, dtype, ops,
                 kv_quantizer=None, storage_blocks=None, prefix_caching=False,
                 swap_space=None, window=None):  # window: the model's (drop_window)
        self.spec, self.ops, self.device, self.dtype = spec, ops, torch.device(device), dtype
        self.max_seq_len, self.block_size = max_seq_len, block_size
        self.window = drop_window(spec, window)
        self.layer_attn = [spec.layer_attention(i) for i in range(spec.num_layers)]
        self.quant = kv_quantizer is not None
        self.kv_dtype = KV_STORAGE_DTYPES[kv_quantizer.kv_dtype] if self.quant else dtype
        self._init_prefix(PrefixIndex(block_size) if prefix_caching else None)
        self.allocator = BlockAllocator(num_blocks, self.prefix)
        self.k, self.v, self.k_scale, self.v_scale = self._storage(storage_blocks or num_blocks,
                                                                   self.device)
        self._tables: dict = {}
        # the same tables, storage ids (a hole: block 0), for the graph steps' one gather;
        # physical = logical here (the offload cache, whose fast slots move, has no graphs)
        self._rows = TableRows(blocks_for(max_seq_len, block_size))
        self._len, self._reserved = {}, {}  # tokens held; tokens reserved by allocate (the prompt)
        self._init_swap(swap_space)  # preemption by swap (kv_swap.py)

    def _storage(self, n, device, pin=False):
        s = self.spec
        shape = (n, self.block_size, s.num_kv_heads, s.head_dim)
        new = lambda shp, dt: [torch.zeros(shp, dtype=dt, device=device, pin_memory=pin)  # noqa: E731
                               for _ in range(s.num_layers)]
        scales = (new(shape[:3], torch.float32), new(shape[:3], torch.float32)) if self.quant \
            else (None, None)
        return (new(shape, self.kv_dtype), new(shape, self.kv_dtype), *scales)

    # -- allocation ------------------------------------------------------------------------
    def can_allocate(self, num_tokens):
        return num_tokens <= self.max_seq_len and \
            blocks_for(num_tokens, self.block_size) <= self.allocator.num_free

    def allocate(self, seq_id, num_tokens, cached=()):
        """Room for ``num_tokens``; ``cached``: the prefix cache's blocks its first tokens
        already fill (``allocate_cached``), taken before any fresh block can evict them."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} is already allocated")
        if num_tokens > self.max_seq_len:
            raise CacheFullError(f"{num_tokens} tokens exceed max_seq_len={self.max_seq_len}")
        a, fresh = self.allocator, blocks_for(num_tokens, self.block_size) - len(cached)
        need = fresh + sum(a.refs[b] == 0 for b in cached)  # a free cached block counts too
        if need > a.num_free:
            raise CacheFullError(f"need {need} blocks, {a.num_free} of {a.num_blocks} free")
        for b in cached:
            a.revive(b)
        self._tables[seq_id] = list(cached) + a.take(fresh)
        self._rows.add(seq_id, self._tables[seq_id])
        self._len[seq_id], self._reserved[seq_id] = len(cached) * self.block_size, num_tokens

    def free(self, seq_id):
        for b in reversed(self._tables.pop(seq_id)):  # a chain's tail blocks evicted first
            self._release(b)
        self._rows.remove(seq_id)
        self._forget_prefix(seq_id)
        del self._len[seq_id], self._reserved[seq_id]

    def _release(self, b: int) -> None:
        if b != HOLE and self.allocator.release(b):
            self._block_freed(b)

    def _first_live(self, start: int) -> int:
        """Leading blocks of a sequence with ``start`` tokens before a step that no query of
        that step or any later one sees (the window's first key is start - W + 1)."""
        return max(0, start - self.window + 1) // self.block_size if self.window else 0

    def _drop_out_of_window(self, seq_id, start: int) -> None:
        table = self._tables[seq_id]
        for j in range(self._first_live(start) - 1, -1, -1):  # newest first: O(new holes)
            if table[j] == HOLE:
                break  # the holes are a prefix: the rest went at earlier steps
            self._release(table[j])
            table[j] = HOLE
            self._rows.put(seq_id, j, [HOLE])

    def length(self, seq_id):
        return self._len[seq_id]

    supports_truncate = True

    def truncate(self, seq_id, length):
        """Roll back to ``length`` tokens; whole blocks past it (unshared) freed."""
        assert 0 <= length <= self._len[seq_id], (seq_id, length, self._len[seq_id])
        table = self._tables[seq_id]
        keep = blocks_for(max(length, self._reserved[seq_id]), self.block_size)
        for b in reversed(table[keep:]):
            self._release(b)
        self._rows.put(seq_id, keep, [0] * (len(table) - keep))
        del table[keep:]
        self._len[seq_id] = length

    def fork(self, parent, child):
        if child in self._tables:
            raise ValueError(f"sequence {child!r} is already allocated")
        n, table = self._len[parent], self._tables[parent]
        full, partial = n // self.block_size, n % self.block_size != 0
        new = self.allocator.take(1 if partial else 0)  # raises before anything changes
        for b in table[:full]:
            if b != HOLE:
                self.allocator.share(b)
        if partial:
            self._copy_block(table[full], new[0], exclude=set(table))
        self._tables[child] = table[:full] + new
        self._rows.add(child, self._tables[child])
        self._fork_prefix(parent, child)
        self._len[child], self._reserved[child] = n, n

    # -- one forward step --------------------------------------------------------------------
    def _step_problem(self, seq_ids, counts):
        """Why ``prepare(seq_ids, counts)`` cannot run now, or None."""
        assert len(set(seq_ids)) == len(seq_ids), f"duplicate sequences in a step: {seq_ids}"
        need = 0
        for s, n in zip(seq_ids, counts):
            total = self._len[s] + n
            if total > self.max_seq_len:
                return f"sequence {s!r} would hold {total} tokens, over max_seq_len={self.max_seq_len}"
            need += max(0, blocks_for(total, self.block_size) - len(self._tables[s]))
        if need > self.allocator.num_free:
            return (f"the step needs {need} new blocks but {self.allocator.num_free} of "
                    f"{self.allocator.num_blocks} are free")
        return None

    def can_append(self, seq_ids, counts):
        return self._step_problem(seq_ids, counts) is None

    def _advance(self, seq_ids, counts) -> list[int]:
        """Make room for a step (raises CacheFullError, changing nothing, when there is
        none): tables grow, lengths advance. Returns each sequence's length before it."""
        problem = self._step_problem(seq_ids, counts)
        if problem:
            raise CacheFullError(problem)
        starts = [self._len[s] for s in seq_ids]
        for s, start, n in zip(seq_ids, starts, counts):
            grow = blocks_for(start + n, self.block_size) - len(self._tables[s])
            if grow > 0:
                new = self.allocator.take(grow)
                self._rows.put(s, len(self._tables[s]), new)
                self._tables[s] += new
            self._len[s] = start + n
            if self.window:
                self._drop_out_of_window(s, start)
            if self.prefix is not None:
                self._register_full(s)
        self._before_step(seq_ids)
        return starts

    def prepare(self, seq_ids, counts):
        starts = self._advance(seq_ids, counts)
        phys = [self._physical(self._tables[s]) for s in seq_ids]
        return PagedMeta.of(phys, starts, counts, self.block_size, self.device)

    fuses_rotary = True  # RoPE and the K/V write in one kernel

    def decode_kv_slots(self, layer, meta):
        if not meta.decode or self.quant:  # int8 / e4m3 K/V quantise on write
            return None
        self._wait(layer)
        return self.k[layer], self.v[layer], meta.slot_block, meta.slot_offset

    def attention(self, layer, q, k, v, meta, rope=None):
        self._wait(layer)
        kc, vc = self.k[layer], self.v[layer]  # [NB, BS, Hkv, D]
        ks, vs = (self.k_scale[layer], self.v_scale[layer]) if self.quant else (None, None)
        slots = (meta.slot_block, meta.slot_offset)
        if k is None:  # written by the producer (decode_kv_slots), q rotated
            assert meta.decode and not self.quant, "K/V written ahead only at decode, not quantised"
        elif rope is not None and self.quant:  # one kernel for both, quantising
            q = self.ops.rotary_kv_write_quant(q, k, v, *rope, kc, vc, ks, vs, *slots)
        elif rope is not None:
            q = self.ops.rotary_kv_write(q, k, v, *rope, kc, vc, *slots)
        elif self.quant:
            self.ops.kv_write_quant(k, v, kc, vc, ks, vs, *slots)
        else:
            self.ops.kv_write(k, v, kc, vc, *slots)
        a = self.layer_attn[layer]  # its window never reaches before the dropped blocks
        kw = dict(softcap=a.softcap, counters=self.counters)
        if meta.decode:  # q: [B, Hq, D], one token per sequence
            return self.ops.paged_attention(q, kc, vc, meta.block_tables, meta.context_lens,
                                            a.scale, a.window, ks, vs, **kw)
        # any mix of prompt chunks and decode tokens: q [T, Hq, D], one launch
        return self.ops.varlen_attention(q, kc, vc, meta.block_tables, meta.cu_seqlens_q,
                                         meta.context_lens, a.scale, a.window, ks, vs, **kw)

    # -- hooks for backends built on this one (offload) -----------------------------------
    def _physical(self, blocks: list[int]) -> list[int]:
        """Storage index of each logical block (here: the same; a hole reads block 0)."""
        return [0 if b == HOLE else b for b in blocks]

    def _before_step(self, seq_ids) -> None:
        """Called by prepare after the tables grew, before metadata is built."""

    def _wait(self, layer: int) -> None:
        """Called before a layer's storage is read or written."""

    def _block_freed(self, block: int) -> None:
        """A block's last reference is gone."""

    def _copy_block(self, src: int, dst: int, exclude=()) -> None:
        s, d = self._physical([src, dst])
        for pool in (self.k, self.v) + ((self.k_scale, self.v_scale) if self.quant else ()):
            for t in pool:
                t[d].copy_(t[s])

    # -- inspection --------------------------------------------------------------------------
    def read(self, seq_id, layer):
        """K and V of the tokens still held: all, or those after the dropped blocks."""
        live = self._live_blocks(seq_id)
        table = torch.tensor(self._physical(live), dtype=torch.long, device=self.device)
        return self._gather(layer, table, self._len[seq_id] - self._dropped_tokens(seq_id))

    def _live_blocks(self, seq_id) -> list[int]:
        return [b for b in self._tables[seq_id] if b != HOLE]

    def _gather(self, layer, table, length):
        """A sequence's K and V ([length, Hkv, D], self.dtype) from its storage blocks."""
        hkv, d = self.spec.num_kv_heads, self.spec.head_dim
        k = self.k[layer][table].reshape(-1, hkv, d)[:length]
        v = self.v[layer][table].reshape(-1, hkv, d)[:length]
        if self.quant:
            k = (k.float() * self.k_scale[layer][table].reshape(-1, hkv, 1)[:length]).to(self.dtype)
            v = (v.float() * self.v_scale[layer][table].reshape(-1, hkv, 1)[:length]).to(self.dtype)
        return k, v

    def _dropped_tokens(self, seq_id) -> int:
        return self._tables[seq_id].count(HOLE) * self.block_size

    def _pool_bytes(self, pools) -> int:
        return sum(t.numel() * t.element_size() for pool in pools if pool for t in pool)

    def stats(self):
        a = self.allocator
        return {"bytes": self._pool_bytes((self.k, self.v, self.k_scale, self.v_scale)),
                "sequences": len(self._tables), "tokens": sum(self._len.values()),
                "block_size": self.block_size, "blocks_total": a.num_blocks,
                "blocks_free": a.num_free, "blocks_used": a.num_blocks - a.num_free,
                "blocks_shared": sum(r > 1 for r in a.refs), **self.prefix_stats(),
                **self.swap_stats()}

    def check_invariants(self):
        super().check_invariants()
        check_tables(self)


class PagedBackend(CacheBackend):
    name = "paged"
    options = {"block_size": 16, "num_blocks": None, "gpu_memory_utilization": 0.9,
               "prefix_caching": True, "swap_space": None}
    quantized_kv = tuple(KV_STORAGE_DTYPES)
    attention_features = ("scale", "softcap", "layer_windows")  # all of spec.layer_attention

    def create(self, spec, plan, *, device, dtype, ops, block_size=16, num_blocks=None,
               gpu_memory_utilization=0.9, prefix_caching=True, swap_space=None,
               kv_quantizer=None):
        bs, nb = cache_sizes(plan, block_size, num_blocks, self.name, gpu_memory_utilization)
        check_kv_quantizer(self.name, kv_quantizer)
        return PagedCache(spec, max_seq_len=plan.max_seq_len, block_size=bs, num_blocks=nb,
                          device=device, dtype=dtype, ops=ops, kv_quantizer=kv_quantizer,
                          prefix_caching=prefix_caching, swap_space=swap_space,
                          window=plan.sliding_window)

    def device_bytes(self, plan, block_size=16, num_blocks=None, gpu_memory_utilization=0.9,
                     **_):  # the pool create makes: sized to the budget (cache_sizes)
        bs, nb = cache_sizes(plan, block_size, num_blocks, self.name, gpu_memory_utilization)
        return nb * bs * plan.kv_bytes_per_token


@hookimpl
def infergraft_register_cache_backends(register):
    register(PagedBackend())
