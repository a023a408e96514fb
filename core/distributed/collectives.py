"""The collectives the model and the engine call across ranks: the tensor-parallel
all-reduce, the vocab-parallel head's gather to the group's rank 0, and every rank taking
the tokens (or logits) of the rank that sampled them.

Both ``TensorParallelGroup`` and ``stages.PipelineStage`` offer ``broadcast_sampled``
and ``broadcast_logits``; the engine calls whichever this rank has (``RankSetup.ranks``).
"""
from __future__ import annotations

import torch


class TensorParallelGroup:
    """This process's rank in a tensor-parallel group and the collectives it needs."""

    def __init__(self, size: int, rank: int, group=None):
        self.size, self.rank, self.group = size, rank, group

    @property
    def first(self) -> int:
        """The global rank of the group's rank 0 (which samples for the group)."""
        return 0 if self.group is None else torch.distributed.get_global_rank(self.group, 0)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] (or split-K partials [S, T, H]) -> the sum over ranks, in place
        torch.distributed.all_reduce(x, group=self.group)
        return x

    def gather_to_first(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``x`` (same shape on all), in rank order, on the group's rank 0;
        None on the others (gloo and NCCL both gather: no copy lands elsewhere)."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        torch.distributed.gather(x, parts, dst=self.first, group=self.group)
        return parts

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        """The group's rank 0's ``x``, in place on every rank."""
        torch.distributed.broadcast(x, src=self.first, group=self.group)
        return x

    def broadcast_logits(self, logits, shape, device):
        """The group's rank 0's logits [rows, V] float32 (the others have None: the
        vocab-parallel head gathers them there only), on every rank."""
        if logits is None:
            logits = torch.empty(shape, dtype=torch.float32, device=device)
        torch.distributed.broadcast(logits, src=self.first, group=self.group)
        return logits

    def broadcast_sampled(self, tokens: list[int], device) -> list[int]:
        """Rank 0's sampled tokens, on every rank."""
        return broadcast_tokens(tokens, device, self.first, self.group)


def broadcast_tokens(tokens: list[int], device, src: int, group=None) -> list[int]:
    """Global rank ``src``'s token ids, on every rank of ``group``."""
    if not tokens:
        return tokens
    t = torch.tensor(tokens, dtype=torch.int64, device=device)
    torch.distributed.broadcast(t, src=src, group=group)
    return t.tolist()
