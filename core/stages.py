"""Pipeline parallelism: each rank runs a contiguous range of layers (its stage) and
hands the residual stream to the next rank; the last stage computes the logits, samples,
and every rank takes its tokens. Stages run one after another (no micro-batches): this
splits a model's memory over devices, not its time.

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

    def __init__(self, index: int, count: int, layers: tuple[int, int]):
        self.index, self.count, self.layers = index, count, layers
        self.first, self.last = index == 0, index == count - 1

    def send(self, h: torch.Tensor, residual: torch.Tensor) -> None:
        # h: the last layer's output [T, H] (split-K partials [S, T, H] summed first),
        # residual: [T, H]; the next stage's first norm adds them
        if h.dim() == 3:
            from infergraft.kernels.rms_norm import sum_partials

            h = sum_partials(h, residual.dtype)
        for t in (h, residual):
            torch.distributed.send(t.contiguous(), dst=self.index + 1)

    def recv(self, rows: int, hidden: int, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.empty((rows, hidden), dtype=dtype, device=device)
        residual = torch.empty_like(h)
        for t in (h, residual):
            torch.distributed.recv(t, src=self.index - 1)
        return h, residual

    def agree(self, tokens: list[int], device) -> list[int]:
        """The last stage's sampled tokens, on every rank."""
        if not tokens:
            return tokens
        t = torch.tensor(tokens, dtype=torch.int64, device=device)
        torch.distributed.broadcast(t, src=self.count - 1)
        return t.tolist()

    def share(self, logits: torch.Tensor | None, shape, device) -> torch.Tensor:
        """The last stage's logits [rows, V] float32, on every rank."""
        if logits is None:
            logits = torch.empty(shape, dtype=torch.float32, device=device)
        torch.distributed.broadcast(logits, src=self.count - 1)
        return logits


def stage_spec(spec, stage: PipelineStage):
    return attrs.evolve(spec, num_layers=stage.layers[1] - stage.layers[0])


def _kept_outside_layers(spec, stage: PipelineStage) -> set[str]:
    keep = set(_FIRST if stage.first else ()) | set(_LAST if stage.last else ())
    if stage.last and spec.tie_embeddings:
        keep.add("embed.weight")  # the LM head reads it
    return keep


def unheld_elements(spec, stage: PipelineStage) -> int:
    """Elements of the non-layer slots (embeddings, final norm, head) this stage lacks:
    ``weight_bytes`` of its spec counts them all."""
    from .slots import slot_layout

    keep = _kept_outside_layers(spec, stage)
    return sum(torch.Size(shape).numel() for slot, (shape, _) in slot_layout(spec).items()
               if not _LAYER.fullmatch(slot) and slot not in keep)


def stage_placement(spec, stage: PipelineStage):
    """slot, tensor -> (this stage's slot name, tensor), or None where it holds none."""
    first, end = stage.layers
    keep = _kept_outside_layers(spec, stage)

    def place(slot: str, tensor: torch.Tensor):
        m = _LAYER.fullmatch(slot)
        if m is None:
            return (slot, tensor) if slot in keep else None
        i = int(m.group(1))
        return (f"layers.{i - first}.{m.group(2)}", tensor) if first <= i < end else None

    return place
