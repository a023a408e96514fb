"""The collectives the model and the engine call across ranks: the tensor-parallel
all-reduce, and every rank taking the tokens (or logits) of the rank that sampled them.

Both ``TensorParallelGroup`` and ``stages.PipelineStage`` offer ``broadcast_sampled``
and ``broadcast_logits``; the engine calls whichever this rank has (``RankSetup.ranks``).
"""
from __future__ import annotations

import torch


class TensorParallelGroup:
    """This process's rank in a tensor-parallel group and the two collectives it needs."""

    def __init__(self, size: int, rank: int, group=None):
        self.size, self.rank, self.group = size, rank, group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] (or split-K partials [S, T, H]) -> the sum over ranks, in place
        torch.distributed.all_reduce(x, group=self.group)
        return x

    def broadcast_logits(self, logits, shape, device):
        # every rank computed them whole
        return logits

    def broadcast_sampled(self, tokens: list[int], device) -> list[int]:
        """Rank 0's sampled tokens, on every rank."""
        src = 0 if self.group is None else torch.distributed.get_global_rank(self.group, 0)
        return broadcast_tokens(tokens, device, src, self.group)


def broadcast_tokens(tokens: list[int], device, src: int, group=None) -> list[int]:
    """Global rank ``src``'s token ids, on every rank of ``group``."""
    if not tokens:
        return tokens
    t = torch.tensor(tokens, dtype=torch.int64, device=device)
    torch.distributed.broadcast(t, src=src, group=group)
    return t.tolist()
