"""Pipeline parallelism: each rank runs a contiguous range of layers (its stage) and
hands the residual stream to the next rank; the last stage computes the logits, samples,
and every rank takes its tokens. With one micro-batch the stages run a step one after
another (blocking send / recv): this splits a model's memory over devices, not its time.
With ``micro_batches`` > 1 the runner cuts the step into groups in flight across the
stages at once and the hand-over goes through its ``micro_batches.StepExchange``
(non-blocking, posted for the whole step). On NCCL each send / recv already runs on
NCCL's own stream for that pair of ranks, ordered after the compute that made its tensor
by an event: the next group's layers run beside the hand-over without a stream of ours.

Rank r runs stage r. The first stage holds the embeddings, the last the final norm and
the LM head (and the embeddings too when the head is tied to them); layer ``first + i``
of the model is layer ``i`` of the stage, in its module tree and its cache.
"""
from __future__ import annotations

import re

import attrs
import torch

_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_FIRST = ("embed.weight", "pos_embed.weight")
_LAST = ("final_norm.weight", "final_norm.bias", "lm_head.weight")


class PipelineStage:
    """This rank's stage and the point-to-point hand-over between stages."""

    def __init__(self, index: int, count: int, layers: tuple[int, int], tp: int = 1,
                 tp_rank: int = 0):
        self.index, self.count, self.layers = index, count, layers
        self.first, self.last = index == 0, index == count - 1
        # global ranks (stage s, tp rank r = s * tp + r): the same tp rank of the
        # neighbouring stages, and the last stage's rank 0, which samples for all
        self.prev, self.next = (index - 1) * tp + tp_rank, (index + 1) * tp + tp_rank
        self.sampler = (count - 1) * tp
        # micro_batches.StepExchange while the runner runs a step in micro-batches: the
        # model's send / recv go through it; events: a list it logs to (tests), or None
        self.exchange, self.events = None, None

    def send(self, h: torch.Tensor, residual: torch.Tensor) -> None:
        # h: the last layer's output [T, H] (split-K partials [S, T, H] summed first),
        # residual: [T, H]; the next stage's first norm adds them
        if h.dim() == 3:
            from infergraft.kernels.rms_norm import sum_partials

            h = sum_partials(h, residual.dtype)
        if self.exchange is not None:
            return self.exchange.send(h, residual)
        for t in (h, residual):
            torch.distributed.send(t.contiguous(), dst=self.next)
        return None

    def recv(self, rows: int, hidden: int, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        if self.exchange is not None:  # posted at the step's start
            return self.exchange.recv(rows)
        h = torch.empty((rows, hidden), dtype=dtype, device=device)
        residual = torch.empty_like(h)
        for t in (h, residual):
            torch.distributed.recv(t, src=self.prev)
        return h, residual

    def broadcast_sampled(self, tokens: list[int], device) -> list[int]:
        """The last stage's sampled tokens, on every rank."""
        from .collectives import broadcast_tokens

        return broadcast_tokens(tokens, device, self.sampler)

    def broadcast_logits(self, logits: torch.Tensor | None, shape, device) -> torch.Tensor:
        """The last stage's logits [rows, V] float32, on every rank."""
        if logits is None:
            logits = torch.empty(shape, dtype=torch.float32, device=device)
        torch.distributed.broadcast(logits, src=self.sampler)
        return logits


def stage_spec(spec, stage: PipelineStage):
    first, end = stage.layers  # each layer keeps its parts (LayerSpec), renumbered from 0
    return attrs.evolve(spec, num_layers=end - first, layers=spec.layers[first:end])


def _kept_outside_layers(spec, stage: PipelineStage) -> set[str]:
    keep = set(_FIRST if stage.first else ()) | set(_LAST if stage.last else ())
    if stage.last and spec.tie_embeddings:
        keep.add("embed.weight")  # the LM head reads it
    return keep


def not_held_elements(spec, stage: PipelineStage) -> int:
    """Elements of the non-layer slots (embeddings, final norm, head) this stage lacks:
    ``weight_bytes`` of its spec counts them all."""
    from ..slots import slot_layout

    keep = _kept_outside_layers(spec, stage)
    return sum(torch.Size(shape).numel() for slot, (shape, _) in slot_layout(spec).items()
               if not _LAYER.fullmatch(slot) and slot not in keep)


def stage_slot(spec, stage: PipelineStage, slot: str) -> str | None:
    """This stage's name for a whole-model slot (layer i -> i - first), or None where it
    holds none."""
    m = _LAYER.fullmatch(slot)
    if m is None:
        return slot if slot in _kept_outside_layers(spec, stage) else None
    i, (first, end) = int(m.group(1)), stage.layers
    return f"layers.{i - first}.{m.group(2)}" if first <= i < end else None
