"""Vocab-parallel embeddings and LM head under tensor parallelism (Megatron's
VocabParallelEmbedding and a vocab-parallel head).

The embedding matrix (and an untied LM head) is split by rows across the tp ranks, the
vocab padded with zero rows to a multiple of tp (GPT-2's 50257 at tp 2: 50258, 25129 rows
a rank). Rank r holds rows ``[r * rows, (r + 1) * rows)`` of the padded matrix.

- embedding: each rank looks up the ids in its range (others: zero rows), then one
  all-reduce (sum) of [T, H] gives every rank the whole lookup;
- LM head: each rank computes its [n, rows] slice of the logits; the slices are gathered
  to the group's rank 0 only, the padding trimmed there: [n, V] float32 on rank 0, None on
  the others (the sampling rank samples; ``broadcast_sampled`` gives the others its tokens).

The rank's spec keeps the model's ``vocab_size`` (request checks, logits shapes and the
sampler see the whole vocab); only the slot shapes (``rank_layout``) and the bytes a rank
holds (``vocab_not_held``) use the rows.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

VOCAB_SLOTS = ("embed.weight", "lm_head.weight")  # split by rows (the "vocab" style)


def padded_vocab(vocab: int, tp: int) -> int:
    """The vocab rounded up to a multiple of ``tp`` (padding rows are zeros)."""
    return -(-vocab // tp) * tp


def shard_rows(vocab: int, tp: int) -> int:
    """Rows of the embedding / head each of ``tp`` ranks holds, padding included."""
    return padded_vocab(vocab, tp) // tp


def vocab_range(vocab: int, tp: int, rank: int) -> tuple[int, int]:
    """The token ids [start, end) whose rows ``rank`` holds (end - start < rows on the
    ranks holding padding; empty on a rank of padding only)."""
    rows = shard_rows(vocab, tp)
    return min(rank * rows, vocab), min((rank + 1) * rows, vocab)


def shard_vocab(tensor: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s rows of a [V, ...] tensor, zero rows past V: [rows, ...]."""
    vocab, rows = tensor.shape[0], shard_rows(tensor.shape[0], tp)
    start, end = vocab_range(vocab, tp, rank)
    if end - start == rows:  # a copy: a view would keep the whole matrix alive
        return tensor[start:end].clone()
    piece = tensor.new_zeros((rows, *tensor.shape[1:]))
    piece[:end - start] = tensor[start:end]
    return piece


def rank_layout(layout: dict, vocab: int, tp: int) -> dict:
    """``slot_layout`` of a rank's spec with its embedding / head rows in place of the
    vocab: the shapes its placed pieces must have."""
    if tp == 1:
        return layout
    rows = shard_rows(vocab, tp)
    return {slot: ((rows, *shape[1:]), parts) if slot in VOCAB_SLOTS else (shape, parts)
            for slot, (shape, parts) in layout.items()}


def vocab_not_held(layout: dict, held, vocab: int, tp: int) -> int:
    """Elements of the vocab slots among ``held`` that one of ``tp`` ranks does not hold
    (``weight_bytes`` counts each whole): (V - rows) x H each; 0 at tp 1."""
    rows = shard_rows(vocab, tp)
    return sum((vocab - rows) * layout[slot][0][1] for slot in VOCAB_SLOTS
               if slot in layout and slot in held)


class VocabParallel:
    """The rank's rows of the vocab and the two collectives around them; ``tp``: a
    ``collectives.TensorParallelGroup``."""

    def __init__(self, vocab: int, tp):
        self.vocab, self.tp = vocab, tp
        self.rows = shard_rows(vocab, tp.size)
        self.start = tp.rank * self.rows

    def embed(self, tokens: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # tokens [T] (ids < V), weight [rows, H]: this rank's rows -> the lookup [T, H]
        local = tokens - self.start
        outside = (local < 0) | (local >= self.rows)
        h = F.embedding(local.masked_fill(outside, 0), weight)  # [T, H]
        h.masked_fill_(outside[:, None], 0)  # another rank's id: its row comes from there
        return self.tp.all_reduce(h)  # exactly one rank contributes each row

    def logits(self, y: torch.Tensor, greedy_out: torch.Tensor | None = None):
        """y: this rank's slice [n, rows] -> the whole logits [n, V] float32 on the group's
        rank 0, None elsewhere; ``greedy_out`` [n] takes each row's argmax on every rank
        (a decode graph's next input: the look-ahead feeds it without the host)."""
        parts = self.tp.gather_to_first(y)  # tp x [n, rows] on rank 0
        if parts is None:
            if greedy_out is not None:  # rank 0's argmax: every rank's graph feeds it back
                self.tp.broadcast_from_first(greedy_out)
            return None
        out = torch.empty((y.shape[0], self.vocab), dtype=torch.float32, device=y.device)
        for r, part in enumerate(parts):  # widened into place, the padding left out
            start, end = vocab_range(self.vocab, self.tp.size, r)
            out[:, start:end].copy_(part[:, :end - start])
        if greedy_out is not None:
            self.tp.broadcast_from_first(greedy_out.copy_(out.argmax(-1)))
        return out
