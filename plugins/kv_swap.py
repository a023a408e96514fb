"""Preemption by swap for the paged cache (``KVCache.swap_out`` / ``swap_in``).

A swapped-out sequence's written blocks are copied to host blocks and its device blocks
released through ``free``, so the allocator, the tables and the prefix index account for
it as for any freed sequence; its length, its reservation (a prompt still prefilling) and
its sliding-window holes are remembered. Swapping in allocates fresh blocks through
``allocate``, puts the holes back in front and copies the K/V into the new blocks. Blocks
of int8 / e4m3 K/V carry their float32 scales.

The host pool is ``swap_space`` bytes of blocks (``swap_host.HostBlocks``), made a chunk at
a time as swapped blocks first need it (an engine that never preempts pays nothing),
pinned on CUDA. There the copies run on a stream of their own: it first waits for the
compute stream (the step that wrote the K/V, or a look-ahead step's write into a block
freed since), and the compute stream waits for its event before anything later runs, so
neither a released block's reuse nor a step's read of a block swapped in can overtake a
copy. On the CPU the copies are plain copies.
"""
from __future__ import annotations

import contextlib
import time

import attrs
import torch

from infergraft.core.cache import CacheFullError
from infergraft.core.errors import PlanError
from infergraft.core.units import parse_bytes

from .block_allocator import blocks_for
from .paged_checks import HOLE
from .swap_host import HostBlocks

#: swap_space when none is given: vLLM's 4 GiB on CUDA, a small pool on the CPU (where
#: "host" and "device" are the same memory); at most twice the device pool either way
DEFAULT_SWAP_SPACE = {"cuda": 4 << 30, "cpu": 64 << 20}


@attrs.define
class Swapped:
    """What a swapped-out sequence had: its written blocks' host copies, in table order."""
    host: list[int]
    length: int  # tokens written
    reserved: int  # tokens its table was reserved for (a prompt still prefilling)
    holes: int  # leading table entries dropped out of every later sliding window


def swap_space_bytes(value, device: torch.device, pool_bytes: int, block_bytes: int) -> int:
    """The host pool's size in bytes: ``value`` (bytes, or a size such as "4GiB"), or by
    default ``DEFAULT_SWAP_SPACE`` capped at twice the device pool."""
    if value is None:
        return min(DEFAULT_SWAP_SPACE["cuda" if device.type == "cuda" else "cpu"],
                   2 * pool_bytes)
    try:
        n = parse_bytes(value) if isinstance(value, str) else value
    except ValueError:
        n = None
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise PlanError(f"paged: swap_space must be a byte count >= 0 or a size such as "
                        f"\"4GiB\" (host memory for preempted sequences' K/V; 0: preempt by "
                        f"recompute only), got {value!r}")
    if 0 < n < block_bytes:  # vLLM counts swap_space in GiB: 4 here would be 4 bytes
        raise PlanError(f"paged: swap_space={value!r} bytes is less than one block "
                        f"({block_bytes} bytes); give bytes or a size such as \"4GiB\", or 0 "
                        "to preempt by recompute only")
    return n


class SwapSpace:
    """Mixed into PagedCache (its tables, rows, lengths, allocator, pools, ``allocate``,
    ``free`` and ``_physical``); ``_init_swap`` runs at the end of its __init__."""

    supports_swap = True

    def _init_swap(self, swap_space) -> None:
        pools = self._device_pools()
        block_bytes = sum(t[0].numel() * t.element_size() for pool in pools for t in pool)
        limit = swap_space_bytes(swap_space, self.device, block_bytes * pools[0][0].shape[0],
                                 block_bytes)
        self.swap_blocks = limit // block_bytes  # host blocks at most
        self._swap_block_bytes = block_bytes
        self._host = HostBlocks(pools, self.swap_blocks, block_bytes, self.device)
        self._swapped: dict = {}  # seq id -> Swapped, in swap-out order
        self._swap_stream = None
        self._timings: list = []  # (bytes, start, end) of copies whose events may not be done
        self._copied_bytes, self._copied_seconds = 0, 0.0  # of the copies timed so far

    def _device_pools(self) -> list:
        return [p for p in (self.k, self.v, self.k_scale, self.v_scale) if p is not None]

    # -- the contract ------------------------------------------------------------------
    def swapped_ids(self) -> list:
        return list(self._swapped)

    def _written(self, seq_id) -> list[int]:
        """The blocks holding ``seq_id``'s tokens, after its holes."""
        table = self._tables[seq_id]
        return table[table.count(HOLE):blocks_for(self._len[seq_id], self.block_size)]

    def swap_bytes(self, seq_id) -> int:
        return len(self._written(seq_id)) * self._swap_block_bytes

    def swap_seconds(self, seq_id) -> float | None:
        """Seconds swapping ``seq_id`` out and back in would take at the rate this cache's
        copies ran so far (their events on CUDA: launches, waits and the layers' many
        small copies included, which a bulk copy's rate leaves out), or None before one is
        timed."""
        rate = self._copy_rate()
        return None if rate is None else 2 * self.swap_bytes(seq_id) / rate

    def _copy_rate(self) -> float | None:
        pending = []
        for n, start, end in self._timings:
            if end.query():
                self._count_copy(n, start.elapsed_time(end) / 1e3)
            else:
                pending.append((n, start, end))
        self._timings = pending
        n, seconds = self._copied_bytes, self._copied_seconds
        return n / seconds if n and seconds > 0 else None

    def _count_copy(self, nbytes: int, seconds: float) -> None:
        self._copied_bytes += nbytes
        self._copied_seconds += seconds

    def _host_room(self) -> int:
        return len(self._host.free)

    def can_swap_out(self, seq_id) -> bool:
        return seq_id in self._tables and len(self._written(seq_id)) <= self._host_room()

    def swap_out(self, seq_id) -> None:
        if seq_id not in self._tables:
            raise ValueError(f"sequence {seq_id!r} is not allocated; it cannot be swapped out")
        blocks = self._written(seq_id)
        if len(blocks) > self._host_room():
            raise CacheFullError(f"swapping out needs {len(blocks)} host blocks, "
                                 f"{self._host_room()} of {self.swap_blocks} free")
        host = self._host.take(len(blocks))
        try:
            self._copy(self._physical(blocks), host, out=True)
        except BaseException:  # (an OOM on the copy's rows): nothing changed
            self._host.give_back(host)
            raise
        table = self._tables[seq_id]
        self._swapped[seq_id] = Swapped(host, self._len[seq_id], self._reserved[seq_id],
                                        table.count(HOLE))
        self.free(seq_id)

    def _need_in(self, rec: Swapped, next_token: bool) -> int:
        """Device blocks ``rec`` takes when swapped in (with room for its next token)."""
        tokens = max(min(rec.length + next_token, self.max_seq_len), rec.reserved)
        return blocks_for(tokens, self.block_size) - rec.holes

    def can_swap_in(self, seq_id) -> bool:
        rec = self._swapped.get(seq_id)
        return rec is not None and self._need_in(rec, True) <= self.allocator.num_free

    def swap_in(self, seq_id) -> None:
        rec = self._swapped.get(seq_id)
        if rec is None:
            raise ValueError(f"sequence {seq_id!r} is not swapped out")
        # the holes are whole blocks, so the table after them holds the tokens after them
        self.allocate(seq_id, max(rec.length, rec.reserved) - rec.holes * self.block_size)
        table = self._tables[seq_id] = [HOLE] * rec.holes + self._tables[seq_id]
        self._rows.put(seq_id, 0, table)
        self._len[seq_id], self._reserved[seq_id] = rec.length, rec.reserved
        try:
            self._copy(self._physical(table[rec.holes:rec.holes + len(rec.host)]), rec.host,
                       out=False)
        except BaseException:  # still swapped out, as it was
            self.free(seq_id)
            raise
        del self._swapped[seq_id]
        self._host.give_back(rec.host)

    def free_swapped(self, seq_id) -> None:
        self._host.give_back(self._swapped.pop(seq_id).host)

    # -- the copies ---------------------------------------------------------------------
    def _copy(self, device_blocks: list[int], host_blocks: list[int], out: bool) -> None:
        """Device blocks -> host blocks (``out``) or back, every layer and pool."""
        if not device_blocks:
            return
        with self._copy_stream(), self._timed(len(device_blocks) * self._swap_block_bytes):
            self._host.copy(self._device_pools(), device_blocks, host_blocks, out)

    @contextlib.contextmanager
    def _timed(self, nbytes: int):
        """Time the body's copies: events on the copy stream (read once done), else the
        host's clock."""
        if self.device.type != "cuda":
            start = time.perf_counter()
            yield
            self._count_copy(nbytes, time.perf_counter() - start)
            return
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        yield
        end.record()
        self._timings.append((nbytes, start, end))

    @contextlib.contextmanager
    def _copy_stream(self):
        """On CUDA: run the body on the copy stream, ordered after the compute stream's work
        so far and before its work from now on. Elsewhere: run it."""
        if self.device.type != "cuda":
            yield
            return
        compute = torch.cuda.current_stream(self.device)
        if self._swap_stream is None:
            self._swap_stream = torch.cuda.Stream(self.device)
        self._swap_stream.wait_stream(compute)
        with torch.cuda.stream(self._swap_stream):
            yield
        compute.wait_event(self._swap_stream.record_event())

    # -- inspection ----------------------------------------------------------------------
    def swap_stats(self) -> dict:
        used = sum(len(r.host) for r in self._swapped.values())
        return {"swap_blocks_total": self.swap_blocks, "swap_blocks_used": used,
                "swap_blocks_made": self._host.made, "sequences_swapped": len(self._swapped),
                "swap_bytes_per_s": self._copy_rate()}  # None before a copy is timed

    def check_invariants(self):
        super().check_invariants()
        held = [b for r in self._swapped.values() for b in r.host]
        assert len(set(held)) == len(held), "a host block holds two swapped blocks"
        assert not set(self._swapped) & set(self._tables), "a sequence both swapped and allocated"
        free = self._host.free
        assert not set(held) & set(free), "a host block both used and free"
        assert len(held) + len(free) == self.swap_blocks, "host blocks leaked"
        assert all(b < self._host.made for b in held), "a swapped block in no chunk"
