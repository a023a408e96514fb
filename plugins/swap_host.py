"""The host side of preemption by swap (``kv_swap.py``): host blocks laid out as the device
pools (per pool, per layer ``[n, BS, Hkv(, D)]``), pinned on CUDA, and the copies between
them and device blocks.

The blocks are made in chunks of about ``CHUNK_BYTES``, each when the ids handed out first
reach it, not all at the first swap out: pinning host memory runs at a few GB/s, so a
4 GiB pool made at once stalls the step that preempts by a second or more (the H200 run
where one swap made an oversubscribed run as slow as swapping every time). Ids are handed
out lowest first, so the chunks made are those the most blocks held at once needed.
"""
from __future__ import annotations

import torch

#: host memory pinned at a time as swapped blocks first need it
CHUNK_BYTES = 256 << 20


def runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """(index in ``ids``, first id, length) of each run of consecutive ids."""
    out = []
    for i, b in enumerate(ids):
        if out and out[-1][1] + out[-1][2] == b:
            at, first, n = out[-1]
            out[-1] = (at, first, n + 1)
        else:
            out.append((i, b, 1))
    return out


def _raw(t: torch.Tensor) -> torch.Tensor:
    """``t`` as bytes where its dtype is e4m3 (index_copy_ has no float8 kernel)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


class HostBlocks:
    """``total`` host blocks shaped as ``device_pools``' (a list of pools, each a list of
    per-layer tensors ``[NB, ...]``) blocks of ``block_bytes`` each in all."""

    def __init__(self, device_pools, total: int, block_bytes: int, device: torch.device):
        self.total, self.device = total, device
        self.chunk = max(1, CHUNK_BYTES // max(1, block_bytes))  # blocks a chunk
        self._layout = [[(t.shape[1:], t.dtype) for t in pool] for pool in device_pools]
        self.chunks: list = []  # each: per pool, per layer, [chunk blocks, BS, ...]
        self.free: list[int] = list(range(total - 1, -1, -1))  # descending: pop() lowest

    @property
    def made(self) -> int:
        """Host blocks made so far."""
        return sum(c[0][0].shape[0] for c in self.chunks)

    def take(self, n: int) -> list[int]:
        """``n`` free ids, ascending, their chunks made (the caller checked ``free``)."""
        ids = sorted(self.free.pop() for _ in range(n))
        try:
            while ids and self.made <= ids[-1]:
                self._make_chunk()
        except BaseException:  # (out of host memory): nothing taken
            self.give_back(ids)
            raise
        return ids

    def give_back(self, ids: list[int]) -> None:
        # (a later copy into these blocks runs on the same stream, after the ones that read them)
        self.free.extend(ids)
        self.free.sort(reverse=True)

    def _make_chunk(self) -> None:
        """The next chunk: like the device pools, uninitialised (nothing reads a host block
        before a copy writes it); normal tensors even when made under inference mode, so
        that copies outside it may write them too."""
        n = min(self.chunk, self.total - self.made)
        pin = self.device.type == "cuda"
        with torch.inference_mode(False):
            self.chunks.append([[torch.empty((n, *shape), dtype=dtype, pin_memory=pin)
                                 for shape, dtype in pool] for pool in self._layout])

    def _spans(self, host_ids: list[int]):
        """(index in ``host_ids``, chunk, first row in it, length) of each run of
        consecutive ids inside one chunk."""
        out = []
        for at, first, n in runs(host_ids):
            while n:
                c, row = divmod(first, self.chunk)
                k = min(n, self.chunk - row)
                out.append((at, c, row, k))
                at, first, n = at + k, first + k, n - k
        return out

    def copy(self, device_pools, device_blocks: list[int], host_ids: list[int],
             out: bool) -> None:
        """Device blocks -> host blocks (``out``) or back, every pool and layer, on the
        current stream."""
        spans = self._spans(host_ids)
        used = sorted({c for _, c, _, _ in spans})  # the chunks these blocks lie in
        idx = torch.tensor(device_blocks, dtype=torch.long, device=self.device)  # [n]
        for p, dev_pool in enumerate(device_pools):
            for layer, d in enumerate(map(_raw, dev_pool)):  # [NB, BS, Hkv(, D)]
                host = {c: _raw(self.chunks[c][p][layer]) for c in used}
                if out:
                    rows = d.index_select(0, idx)  # [n, BS, Hkv(, D)]
                    for at, c, row, n in spans:
                        host[c][row:row + n].copy_(rows[at:at + n], non_blocking=True)
                else:
                    rows = torch.empty((len(idx), *d.shape[1:]), dtype=d.dtype,
                                       device=self.device)
                    for at, c, row, n in spans:
                        rows[at:at + n].copy_(host[c][row:row + n], non_blocking=True)
                    d.index_copy_(0, idx, rows)
