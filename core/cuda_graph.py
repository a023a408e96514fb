"""Decode under CUDA graphs: one graph per batch-size bucket, replayed every step.

A decode step launches hundreds of small kernels; replaying a captured graph removes
the CPU launch cost between them. The cache supplies static metadata tensors for each
bucket (positions, write slots, block tables, context lengths: the graph's inputs) and
fills them in place before each replay; rows past the live batch are padding that the
cache fills by repeating the last live row (identical writes to the same slot).

``use_graphs=False`` runs the same static-buffer path eagerly: that is how the graph
inputs are tested on machines without CUDA.
"""
from __future__ import annotations

import torch

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class CudaGraphRunner:
    def __init__(self, model, cache, max_batch_size: int, buckets=DEFAULT_BUCKETS,
                 use_graphs: bool = True):
        self.model, self.cache, self.use_graphs = model, cache, use_graphs
        self.replays = 0
        self.device = next(iter(model.buffers())).device
        sizes = sorted({b for b in buckets if b < max_batch_size} | {max_batch_size})
        self.buckets = sizes
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.tokens: dict[int, torch.Tensor] = {}
        self.metas: dict = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None

    @staticmethod
    def supported(cache) -> bool:
        return bool(getattr(cache, "supports_cuda_graphs", False))

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first so smaller ones reuse its memory pool."""
        for bs in sorted(self.buckets, reverse=True):
            tokens = torch.zeros(bs, dtype=torch.long, device=self.device)
            meta = self.cache.static_decode_meta(bs)
            if not self.use_graphs:
                self.tokens[bs], self.metas[bs] = tokens, meta
                continue
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up: Triton compiles, cuBLAS picks kernels
                for _ in range(2):
                    self.model(tokens, self.cache, meta)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                logits = self.model(tokens, self.cache, meta)  # [bs, V] float32
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs], self.tokens[bs], self.metas[bs], self.logits[bs] = \
                graph, tokens, meta, logits
        if self.use_graphs:
            torch.cuda.synchronize()

    def bucket(self, batch: int) -> int | None:
        return next((b for b in self.buckets if b >= batch), None)

    def decode(self, seq_ids: list, tokens: list[int]) -> torch.Tensor:
        """One decode token for each sequence: logits [B, V] float32."""
        n = len(seq_ids)
        bs = self.bucket(n)
        padded = tokens + [tokens[-1]] * (bs - n)  # padding rows repeat the last live row
        self.tokens[bs].copy_(torch.tensor(padded, dtype=torch.long), non_blocking=True)
        self.cache.prepare_decode_into(self.metas[bs], seq_ids)
        self.replays += 1
        if not self.use_graphs:
            return self.model(self.tokens[bs], self.cache, self.metas[bs])[:n]
        self.graphs[bs].replay()
        return self.logits[bs][:n]
