"""Decode under CUDA graphs: one graph per batch-size bucket, replayed every step.

A decode step launches hundreds of small kernels; replaying a captured graph removes
the CPU launch cost between them. The cache supplies static metadata tensors for each
bucket (positions, write slots, block tables, context lengths: the graph's inputs) and
fills them in place before each replay; rows past the live batch are padding that the
cache fills by repeating the last live row (identical writes to the same slot).

``launch`` is the asynchronous form used by greedy batches (core/runner/lookahead.py): each graph
also writes the argmax of its logits over its own input tokens (one kernel with the
float32 logits) and copies it to pinned host memory behind an event; the next replay
takes its input straight from that buffer (no copy), so the host need not wait for a
step before launching the next one.

``use_graphs=False`` runs the same static-buffer path eagerly: that is how the graph
inputs are tested on machines without CUDA.
"""
from __future__ import annotations

import contextlib
import gc

import torch

from .host_tensors import from_ints

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


@contextlib.contextmanager
def no_gc():
    """Collect now, then no garbage collection while a graph is captured: collecting
    another engine's dead graph mid-capture destroys it, which CUDA refuses, and the
    capture fails (torch no longer collects before a capture by default)."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def capture_graph(fn, pool=None):
    """Run ``fn`` twice on a side stream (Triton compiles, cuBLAS picks its kernels), then
    capture one call: returns (graph, what the captured call returned)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with no_gc(), torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out


class CudaGraphRunner:
    def __init__(self, model, cache, max_batch_size: int, buckets=DEFAULT_BUCKETS,
                 use_graphs: bool = True):
        self.model, self.cache, self.use_graphs = model, cache, use_graphs
        self.replays = 0
        self.device = next(iter(model.buffers())).device
        sizes = sorted({b for b in buckets if b < max_batch_size} | {max_batch_size})
        self.buckets = sizes
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.tokens: dict[int, torch.Tensor] = {}  # [bs] inputs; each run leaves its argmax
        self.metas: dict = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.host_tokens: dict[int, PinnedStaging] = {}  # pinned [bs] per bucket, in turn
        self.pool = None
        self.replay_timeout = None  # across ranks: PendingTokens gives up after it

    @staticmethod
    def supported(cache) -> bool:
        return bool(getattr(cache, "supports_cuda_graphs", False))

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first so smaller ones reuse its memory pool."""
        for bs in sorted(self.buckets, reverse=True):
            tokens = torch.zeros(bs, dtype=torch.long, device=self.device)
            meta = self.cache.static_decode_meta(bs)
            self.host_tokens[bs] = PinnedStaging(torch.zeros(bs, dtype=torch.long),
                                                 self.device.type == "cuda")
            if not self.use_graphs:
                self.tokens[bs], self.metas[bs] = tokens, meta
                continue

            def step(tokens=tokens, meta=meta):
                # [bs, V] float32; the argmax goes straight into the input buffer, so a
                # replay fed its own choices needs no copy (read by the embedding first)
                return self.model(tokens, self.cache, meta, greedy_out=tokens)
            graph, logits = capture_graph(step, self.pool)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs], self.tokens[bs], self.metas[bs], self.logits[bs] = \
                graph, tokens, meta, logits
        if self.use_graphs:
            torch.cuda.synchronize()

    def bucket(self, batch: int) -> int | None:
        return next((b for b in self.buckets if b >= batch), None)

    def decode(self, seq_ids: list, tokens: list[int], feed=None) -> torch.Tensor:
        """One decode token for each sequence: logits [B, V] float32 (None where this rank
        does not sample: tp's ranks but the group's first). ``feed``: rows whose token is
        on the device (async_steps.DeviceFeed; ``tokens`` holds placeholders there)."""
        bs = self._run(seq_ids, tokens, feed)
        return rows(self.logits[bs], len(seq_ids))

    def launch(self, seq_ids: list, tokens: list[int] | None) -> "PendingTokens":
        """Start one greedy decode step without waiting for it. ``tokens=None`` feeds each
        row the token the previous replay of this bucket chose; the caller guarantees that
        replay ran the same sequences in the same order."""
        bs = self._run(seq_ids, tokens)
        host = self.host_tokens[bs].next()  # the previous launch's may still be unread
        host.copy_(self.tokens[bs], non_blocking=True)  # this run's argmax
        event = None
        if self.device.type == "cuda":  # graphs or not, the copy to host is asynchronous
            event = torch.cuda.Event()
            event.record()
        return PendingTokens(host, len(seq_ids), event, self.replay_timeout)

    def _run(self, seq_ids, tokens, feed=None) -> int:
        n = len(seq_ids)
        bs = self.bucket(n)
        # Padding rows repeat the last live row (they write its slot: the same token).
        # tokens=None: on-device feedback, the last run left its argmax in the input
        # buffer; a feed writes some rows from the device after the host's copy.
        if tokens is not None:
            padded = tokens + [tokens[-1]] * (bs - n)
            self.tokens[bs].copy_(from_ints(padded), non_blocking=True)
        if feed is not None:
            feed.into(self.tokens[bs])
        if n < bs and (tokens is None or feed is not None):
            self.tokens[bs][n:].copy_(self.tokens[bs][n - 1:n].expand(bs - n))
        self.cache.prepare_decode_into(self.metas[bs], seq_ids)
        self.replays += 1
        if self.use_graphs:
            self.graphs[bs].replay()
        else:
            self.logits[bs] = self.model(self.tokens[bs], self.cache, self.metas[bs],
                                         greedy_out=self.tokens[bs])
        return bs


def rows(logits: torch.Tensor | None, n: int) -> torch.Tensor | None:
    # a graph's logits [bucket, V] -> the live rows [n, V]; None: a rank that does not sample
    return None if logits is None else logits[:n]


class PinnedStaging:
    """Two pinned host buffers used in turn for one graph input's host-to-device copies.

    With the decode look-ahead the host fills step N+1's inputs while step N's copy may
    still be queued on the GPU (behind step N-1: a busy or shared GPU makes that window
    real); one buffer would be overwritten before it is read. The buffer filled next was
    last read by step N-1's copy, which has run: step N-1's tokens were read first.
    """

    def __init__(self, like: torch.Tensor, pin: bool):
        self._buffers = [like.clone().pin_memory() if pin else like.clone() for _ in range(2)]
        self._turn = 0

    @property
    def buffers(self) -> tuple:
        """Both buffers (views of them made once stay valid: they are never replaced)."""
        return tuple(self._buffers)

    def next(self) -> torch.Tensor:
        """The buffer to fill now (its previous contents are stale: rewrite all that is
        copied from it)."""
        self._turn ^= 1
        return self._buffers[self._turn]


class PendingTokens:
    """The greedy tokens of a launched step; ``get`` waits for that step only."""

    def __init__(self, host: torch.Tensor, n: int, event, timeout=None):
        self.host, self.n, self.event, self.timeout = host, n, event, timeout

    def get(self) -> list[int]:
        if self.event is not None:
            from ..distributed.failure import wait_for_device

            wait_for_device(self.event, self.timeout)
        return self.host[:self.n].tolist()
