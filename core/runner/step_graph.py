"""Mixed steps under CUDA graphs: one graph per token-count bucket, over the whole step.

A token-budget step (decode tokens and prompt chunks together) launches a dozen kernels
per layer from Python; replaying a captured graph removes that host work, which at a few
hundred tokens can exceed the GPU's. A step of ``t`` tokens over ``n`` sequences runs in
the smallest bucket ``T >= t``, captured for ``T`` rows and ``min(T, max_batch_size)``
sequences: rows ``t..T-1`` are padding (token 0, written nowhere, attending to nothing)
and sequences ``n..`` feed no row; only each sequence's last row goes through the LM head,
or the rows a step asks for: a speculative verify step's, every row of a sequence with a
draft (``extra_rows`` beyond the batch: ``min(T, max_batch_size + extra_rows)`` in all).
The attention of the whole step is one varlen kernel launch, whose grid depends on the
bucket's shapes alone, so the graph replays any mix of lengths.

Needs a cache with ``supports_step_graphs`` (``static_step_meta``, ``prepare_step_into``);
captured at build (model_runner.step_graphs_for), largest bucket first, into the decode
graphs' memory pool.
"""
from __future__ import annotations

import itertools

import torch

from .cuda_graph import PinnedStaging, capture_graph, rows as rows_of
from .host_tensors import from_ints

STEP_BUCKETS = (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144,
                8192, 12288, 16384)


class StepGraphRunner:
    def __init__(self, model, cache, max_tokens: int, max_batch_size: int,
                 buckets=STEP_BUCKETS, use_graphs: bool = True, share_pool_with=None,
                 extra_rows: int = 0):
        self.model, self.cache, self.use_graphs = model, cache, use_graphs
        self._pool_owner = share_pool_with  # keeps the shared pool alive (prefill_graph.py)
        self.pool = getattr(share_pool_with, "pool", None)
        self.device = next(iter(model.buffers())).device
        self.max_batch_size = max_batch_size
        self.extra_rows = extra_rows  # logits rows beyond a row a sequence (drafts')
        self.buckets = sorted({b for b in buckets if b < max_tokens} | {max_tokens})
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # T -> (pinned staging [T + R], device [T + R]: tokens, then the rows whose logits
        # the step needs; the cache's meta)
        self.inputs: dict[int, tuple] = {}
        self.logits: dict[int, torch.Tensor] = {}  # T -> [R, V] float32
        self.replays = 0

    @staticmethod
    def supported(cache) -> bool:
        return bool(getattr(cache, "supports_step_graphs", False))

    def seqs_of(self, tokens: int) -> int:
        """Sequences a bucket of ``tokens`` rows is captured for (each feeds >= 1 row)."""
        return min(tokens, self.max_batch_size)

    def rows_of(self, tokens: int) -> int:
        """Rows of logits a bucket of ``tokens`` rows computes (``R``)."""
        return min(tokens, self.max_batch_size + self.extra_rows)

    def bucket(self, counts, rows=None) -> int | None:
        """The bucket a step feeding ``counts`` tokens per sequence runs in, or None;
        ``rows``: the rows whose logits it needs (default: each sequence's last)."""
        t, n = sum(counts), len(counts) if rows is None else len(rows)
        return next((b for b in self.buckets if b >= t and self.seqs_of(b) >= len(counts)
                     and self.rows_of(b) >= n), None)

    @torch.inference_mode()
    def capture(self) -> None:
        for tokens in sorted(self.buckets, reverse=True):
            self._capture(tokens)
        if self.use_graphs:
            torch.cuda.synchronize()

    def _capture(self, tokens: int) -> None:
        seqs = self.seqs_of(tokens)
        host = torch.zeros(tokens + self.rows_of(tokens), dtype=torch.long)
        staging = PinnedStaging(host, self.device.type == "cuda")
        dev = host.to(self.device)  # [T] tokens, then [R] the rows whose logits we need
        meta = self.cache.static_step_meta(tokens, seqs)  # all rows padding until filled
        self.inputs[tokens] = (staging, dev, meta)
        if not self.use_graphs:
            return
        ids, index = dev[:tokens], dev[tokens:]
        graph, self.logits[tokens] = capture_graph(  # logits [R, V]
            lambda: self.model(ids, self.cache, meta, index), self.pool)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[tokens] = graph

    @torch.inference_mode()
    def run(self, seq_ids, counts, tokens: list[int], rows=None, feed=None) -> torch.Tensor:
        """One step: logits of each sequence's last fed row, [n, V] float32 (``rows``: of
        those rows instead, [len(rows), V]: a verify step's). ``feed``: token rows taken
        from the device (async_steps.DeviceFeed), written after the host's copy."""
        length = self.bucket(counts, rows)
        staging, dev, meta = self.inputs[length]
        host = staging.next()
        # each one's last row, or the rows asked for
        index = [r - 1 for r in itertools.accumulate(counts)] if rows is None else list(rows)
        n = len(index)
        # tokens, padding tokens, the rows, padding rows: one list, one copy
        host.copy_(from_ints(tokens + [0] * (length - len(tokens)) + index
                             + [0] * (host.shape[0] - length - n)))
        dev.copy_(host, non_blocking=True)
        if feed is not None:
            feed.into(dev)
        self.cache.prepare_step_into(meta, seq_ids, counts)
        self.replays += 1
        if self.use_graphs:
            self.graphs[length].replay()
        else:
            self.logits[length] = self.model(dev[:length], self.cache, meta, dev[length:])
        return rows_of(self.logits[length], n)
