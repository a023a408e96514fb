"""Offloaded paged KV cache: a fast pool (the device) under a budget, a slow pool (host).

The paged cache with two pools. Block ids stay logical (the allocator, tables, fork and
accounting are the paged cache's); the fast pool holds ``fast_blocks`` of them in slots,
the slow pool (pinned host memory on CUDA) has room for every block. Before a step reads
or writes a block it is made resident; to make room, the least recently used blocks that
the step does not touch (those of paused sequences, or beyond the budget) are written
back to the slow pool. On CUDA the copies run on a separate stream, one event per layer,
so layer ``l`` only waits for its own transfers; on the CPU both pools are host tensors
and the same code runs synchronously.
"""
from __future__ import annotations

import collections
import contextlib

import torch

from infergraft.core.errors import PlanError
from infergraft.core.hookspecs import hookimpl

from .block_allocator import blocks_for, cache_sizes, is_count
from .paged import HOLE, PagedBackend, PagedCache, check_kv_quantizer


class OffloadCache(PagedCache):
    supports_cuda_graphs = False  # per-layer copy-stream waits stay outside graphs
    supports_step_graphs = False
    supports_swap = False  # its blocks move between its own pools; preemption recomputes

    def __init__(self, spec, *, fast_blocks, num_blocks, device, **kw):
        super().__init__(spec, num_blocks=num_blocks, device=device, storage_blocks=fast_blocks, **kw)
        self.fast_blocks = fast_blocks
        cuda = self.device.type == "cuda"
        # slow pool: indexed by logical block id
        self.slow = self._storage(num_blocks, "cpu", pin=cuda)  # (k, v, k_scale, v_scale)
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        self._events = [None] * spec.num_layers
        self._slot: dict[int, int] = {}  # resident logical block -> fast slot
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._free_slots = list(range(fast_blocks - 1, -1, -1))
        self._in_slow: set[int] = set()  # non-resident blocks whose data is in the slow pool
        self.swapped_out = self.swapped_in = 0

    # -- residency ----------------------------------------------------------------------------
    def _working_set(self, seq_ids) -> set[int]:
        return {b for s in seq_ids for b in self._live_blocks(s)}

    def _step_problem(self, seq_ids, counts):
        problem = super()._step_problem(seq_ids, counts)
        if problem:
            return problem
        new = sum(max(0, blocks_for(self._len[s] + n, self.block_size) - len(self._tables[s]))
                  for s, n in zip(seq_ids, counts))
        touched = len(self._working_set(seq_ids)) + new
        if touched > self.fast_blocks:
            return f"the step touches {touched} blocks but the fast pool holds {self.fast_blocks}"
        return None

    def _before_step(self, seq_ids):
        need = self._working_set(seq_ids)
        out, into = [], []
        for b in need:
            if b not in self._slot:
                slot = self._take_slot(need, out)
                self._slot[b] = slot
                if b in self._in_slow:
                    into.append((b, slot))
                    self._in_slow.discard(b)
            self._lru[b] = None
            self._lru.move_to_end(b)
        self._transfer(out, into)

    def _take_slot(self, keep, out) -> int:
        if not self._free_slots:  # evict the least recently used block the step does not touch
            victim = next(b for b in self._lru if b not in keep)
            slot = self._slot.pop(victim)
            del self._lru[victim]
            self._in_slow.add(victim)
            out.append((victim, slot))
            self._free_slots.append(slot)
        return self._free_slots.pop()

    def _pools(self, pools):
        k, v, ks, vs = pools
        return (k, v, ks, vs) if self.quant else (k, v)

    def _transfer(self, out, into) -> None:
        """Copy evicted blocks fast -> slow, then loaded blocks slow -> fast, per layer."""
        if not out and not into:
            return
        self.swapped_out += len(out)
        self.swapped_in += len(into)
        fast, slow = self._pools((self.k, self.v, self.k_scale, self.v_scale)), self._pools(self.slow)
        if self.stream is not None:  # wait for the compute that wrote or read these slots
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            for layer in range(self.spec.num_layers):
                for f, s in zip(fast, slow):
                    for b, slot in out:
                        s[layer][b].copy_(f[layer][slot], non_blocking=True)
                    for b, slot in into:
                        f[layer][slot].copy_(s[layer][b], non_blocking=True)
                if self.stream is not None:
                    self._events[layer] = self.stream.record_event()

    def _wait(self, layer):
        ev = self._events[layer]
        if ev is not None:
            torch.cuda.current_stream(self.device).wait_event(ev)
            self._events[layer] = None

    def _sync(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()

    def _physical(self, blocks):
        return [self._slot[b] if b != HOLE else 0 for b in blocks]

    def _block_freed(self, block):
        self._in_slow.discard(block)
        if block in self._slot:
            self._free_slots.append(self._slot.pop(block))
            del self._lru[block]

    def _copy_block(self, src, dst, exclude=()):
        if src in self._slot and (self._free_slots or any(b not in exclude for b in self._lru)):
            out = []
            self._slot[dst] = self._take_slot(set(exclude) | {src}, out)
            self._lru[dst] = None
            self._transfer(out, [])
            for layer in range(self.spec.num_layers):
                self._wait(layer)
            super()._copy_block(src, dst)
            return
        if src in self._slot:  # no slot to spare: copy its fast data into dst's slow slot
            self._sync()
            for f, s in zip(self._pools((self.k, self.v, self.k_scale, self.v_scale)),
                            self._pools(self.slow)):
                for layer in range(self.spec.num_layers):
                    s[layer][dst].copy_(f[layer][self._slot[src]])
        else:
            self._sync()
            for s in self._pools(self.slow):
                for t in s:
                    t[dst].copy_(t[src])
        self._in_slow.add(dst)

    def pause(self, seq_id) -> None:
        """Move a sequence's resident blocks to the slow pool now (they come back when a
        step needs them); blocks shared with other sequences move too."""
        out = []
        for b in self._live_blocks(seq_id):
            if b in self._slot:
                slot = self._slot.pop(b)
                del self._lru[b]
                self._in_slow.add(b)
                out.append((b, slot))
        self._transfer(out, [])
        self._free_slots.extend(slot for _, slot in out)

    # -- inspection -----------------------------------------------------------------------------
    def read(self, seq_id, layer):
        self._sync()
        fast, hkv, d = (self.k, self.v, self.k_scale, self.v_scale), self.spec.num_kv_heads, \
            self.spec.head_dim
        kv = []
        for i in (0, 1):  # K, then V
            rows = [torch.empty(0, hkv, d, dtype=self.dtype, device=self.device)]
            for b in self._live_blocks(seq_id):
                pools, idx = (fast, self._slot[b]) if b in self._slot else (self.slow, b)
                x = pools[i][layer][idx].to(self.device)  # [BS, Hkv, D]
                if self.quant:
                    x = (x.float() * pools[2 + i][layer][idx].to(self.device)[..., None])
                rows.append(x.to(self.dtype))
            kv.append(torch.cat(rows)[:self._len[seq_id] - self._dropped_tokens(seq_id)])
        return kv[0], kv[1]

    def stats(self):
        st = super().stats()
        fast = self._pool_bytes((self.k, self.v, self.k_scale, self.v_scale))
        slow = self._pool_bytes(self.slow)
        st.update(bytes=fast + slow, bytes_fast=fast, bytes_slow=slow,
                  fast_blocks_total=self.fast_blocks, fast_blocks_used=len(self._slot),
                  slow_blocks_used=len(self._in_slow), swapped_out=self.swapped_out,
                  swapped_in=self.swapped_in)
        return st

    def check_invariants(self):
        super().check_invariants()
        refs = self.allocator.refs
        slots = list(self._slot.values())
        assert len(set(slots)) == len(slots), f"two blocks share a fast slot: {self._slot}"
        assert not set(slots) & set(self._free_slots), "a fast slot is both used and free"
        assert len(slots) + len(self._free_slots) == self.fast_blocks, "fast slots leaked"
        assert set(self._lru) == set(self._slot), "LRU order and resident set disagree"
        assert not set(self._slot) & self._in_slow, "a block is both resident and in the slow pool"
        for b in set(self._slot) | self._in_slow:
            assert refs[b] > 0, f"free block {b} still holds a fast slot or slow data"


class OffloadBackend(PagedBackend):
    name = "offload"
    options = {"block_size": 16, "num_blocks": None, "fast_blocks": None}
    quantized_kv = PagedBackend.quantized_kv

    def _sizes(self, plan, block_size, num_blocks, fast_blocks):
        bs, nb = cache_sizes(plan, block_size, num_blocks, name=self.name)
        per_seq = blocks_for(plan.max_seq_len, bs)
        fast = max(per_seq, nb // 2) if fast_blocks is None else fast_blocks
        if not is_count(fast) or not per_seq <= fast <= nb:
            raise PlanError(f"offload: fast_blocks must be an integer in [{per_seq}, {nb}] (at "
                            f"least one max_seq_len={plan.max_seq_len} sequence, at most "
                            f"num_blocks), got {fast_blocks!r}")
        return bs, nb, fast

    def create(self, spec, plan, *, device, dtype, ops, block_size=16, num_blocks=None,
               fast_blocks=None, kv_quantizer=None):
        bs, nb, fast = self._sizes(plan, block_size, num_blocks, fast_blocks)
        check_kv_quantizer(self.name, kv_quantizer)
        return OffloadCache(spec, max_seq_len=plan.max_seq_len, block_size=bs, num_blocks=nb,
                            fast_blocks=fast, device=device, dtype=dtype, ops=ops,
                            kv_quantizer=kv_quantizer, window=plan.sliding_window)

    def device_bytes(self, plan, block_size=16, num_blocks=None, fast_blocks=None, **_):
        bs, _, fast = self._sizes(plan, block_size, num_blocks, fast_blocks)
        return fast * bs * plan.kv_bytes_per_token

    def host_bytes(self, plan, block_size=16, num_blocks=None, fast_blocks=None, **_):
        """The slow pool: room for every block, in host memory."""
        bs, nb, _ = self._sizes(plan, block_size, num_blocks, fast_blocks)
        return nb * bs * plan.kv_bytes_per_token


@hookimpl
def infergraft_register_cache_backends(register):
    register(OffloadBackend())
