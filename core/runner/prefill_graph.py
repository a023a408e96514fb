"""A fresh prompt's prefill under CUDA graphs: one graph per prompt-length bucket.

Eager prefill launches about a dozen kernels per layer from Python; for a prompt of a few
hundred tokens on a 7B model that host work can exceed the GPU time, so time to first
token would depend on the CPU (docs/BENCHMARKS.md has the figures). Replaying a captured
graph removes it.

A prompt of ``n`` tokens runs in the smallest bucket ``L >= n``: rows ``n..L-1`` are
padding (token 0, positions continuing the prompt). They come after the real rows, so
causal attention keeps the real rows blind to them; their K/V writes are skipped (the
cache's static metadata marks them) and only row ``n-1``'s logits are computed. Graphs
are captured on first use of a bucket (warm-up included), into the decode graphs' memory
pool. Taken for one fresh sequence at a time (the batch-1 latency path); a step that
admits several prompts, and prompts longer than the largest bucket, run eagerly.
"""
from __future__ import annotations

import torch

from .cuda_graph import capture_graph

PREFILL_BUCKETS = (16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)


def check_fresh_prompt(meta, seq_id, held: int, n: int) -> int:
    """For caches' ``prepare_prefill_into``: the bucket length of ``meta``, after checking
    that the sequence is still empty and its ``n`` tokens fit the bucket."""
    length = meta.positions.shape[0]
    if held != 0 or not 0 < n <= length:
        raise ValueError(f"a captured prefill takes a fresh sequence of 1..{length} tokens; "
                         f"sequence {seq_id!r} holds {held}, adding {n}")
    return length


class PrefillGraphRunner:
    def __init__(self, model, cache, max_seq_len: int, buckets=PREFILL_BUCKETS,
                 use_graphs: bool = True, share_pool_with=None):
        self.model, self.cache, self.use_graphs = model, cache, use_graphs
        # capture into the decode graphs' memory pool; holding their runner keeps that
        # pool alive until our first capture takes its own reference (a pool whose graphs
        # were all freed is gone, and capturing into it fails inside the allocator)
        self._pool_owner = share_pool_with
        self.pool = getattr(share_pool_with, "pool", None)
        self.device = next(iter(model.buffers())).device
        sizes = {b for b in buckets if b < max_seq_len}
        if max_seq_len <= max(buckets):
            sizes.add(max_seq_len)  # prompts up to the cache's limit have a bucket
        self.buckets = sorted(sizes)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.inputs: dict[int, tuple] = {}  # L -> (pinned host [L + 1], device [L + 1], meta)
        self.logits: dict[int, torch.Tensor] = {}  # L -> [1, V] float32
        self.replays = 0

    @staticmethod
    def supported(cache) -> bool:
        return bool(getattr(cache, "supports_prefill_graphs", False))

    def bucket(self, seqs, counts) -> int | None:
        """The bucket this prefill step runs in, or None when it is not graphable."""
        if len(seqs) != 1 or self.cache.length(seqs[0].id) != 0:
            return None
        return self._bucket_of(counts[0])

    def _bucket_of(self, n: int) -> int | None:
        """The smallest bucket holding ``n`` tokens (None: longer than every bucket)."""
        return next((b for b in self.buckets if b >= n), None)

    @torch.inference_mode()
    def prefill(self, seq_id, tokens: list[int]) -> torch.Tensor:
        """Prefill one fresh sequence; logits of its last token, [1, V] float32."""
        n = len(tokens)
        length = self._bucket_of(n)
        if length not in self.inputs:
            self._capture(length)
        host, dev, meta = self.inputs[length]
        host[:n] = torch.tensor(tokens, dtype=torch.long)
        host[n:length] = 0  # padding token
        host[length] = n - 1  # the row whose logits we need
        dev.copy_(host, non_blocking=True)
        self.cache.prepare_prefill_into(meta, seq_id, n)
        self.replays += 1
        if self.use_graphs:
            self.graphs[length].replay()
        else:
            self.logits[length] = self.model(dev[:length], self.cache, meta, dev[length:])
        return self.logits[length]

    def capture(self, lengths=None) -> list[int]:
        """Capture now the buckets that prompts of ``lengths`` tokens (default: every
        bucket) run in, so no request pays a capture (~1 s for a 7B model on first use).
        Returns the buckets captured."""
        if lengths is None:
            wanted = list(self.buckets)
        else:
            bad = [n for n in lengths if not 0 < n <= self.buckets[-1]]
            if bad:
                raise ValueError(f"prompt lengths {bad} have no prefill graph bucket: "
                                 f"1..{self.buckets[-1]} tokens are captured")
            wanted = sorted({self._bucket_of(n) for n in lengths})
        for length in wanted:
            if length not in self.inputs:
                self._capture(length)
        return list(wanted)

    def _capture(self, length: int) -> None:
        pin = self.device.type == "cuda"
        host = torch.zeros(length + 1, dtype=torch.long, pin_memory=pin)
        dev = host.to(self.device)  # [L] tokens, then [1] index of the last real row
        meta = self.cache.static_prefill_meta(length)  # all rows padding: nothing is written
        self.inputs[length] = (host, dev, meta)
        if not self.use_graphs:
            return
        tokens, index = dev[:length], dev[length:]
        graph, self.logits[length] = capture_graph(  # logits [1, V]
            lambda: self.model(tokens, self.cache, meta, index), self.pool)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[length] = graph
        torch.cuda.synchronize()
