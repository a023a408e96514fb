"""LongRoPE (Phi-3, Phi-4-mini): which of its two tables each sequence reads.

HF's rule, followed exactly: a forward over a sequence of L tokens rotates every position
with the long factors if L > ``original_max_position_embeddings`` (b), with the short
ones otherwise (``dynamic_rope_update``: the longest position of the forward decides).
Its generate never mixes the two in one cache: at the step where the sequence reaches
b + 1 tokens, ``Phi3ForCausalLM.prepare_inputs_for_generation`` drops the cache and
recomputes the whole sequence with the long factors (transformers 5.25; 5.17 feeds the
newest token alone there: docs/architecture.md, LongRoPE). So at every step the logits
are those of one forward over the whole sequence so far: what we compute.

Ours, per sequence (vLLM instead picks one table for the whole engine: the long one
whenever max_model_len > b, so its short sequences differ from HF's):
- a sequence is *long* when the tokens its prefill feeds (its prompt; after a
  recompute, its prompt and output so far) are more than b: its rows read the long
  table at every position. Any other row reads the short table below b and the long one
  from b on (``core.rope.table_rows``), which for a decode row is HF's rule already;
- a short sequence about to feed position b (its K/V below b short) is recomputed first
  (``recompute_at_boundary``, at the start of each ``Scheduler.schedule``: freed and
  requeued at the front, its tokens so far prefilled again as a long sequence), exactly
  where HF's generate drops its cache; the decode look-ahead stops short of it, and so
  does the step scheduled while a decode step runs (``Scheduler.schedule_ahead``: the
  look-ahead's step is not counted yet, ``in_flight``);
- prefill rows of a long sequence below b are the only ones whose table does not follow
  from the position: the runner passes them to the model (``long_rows``), and runs
  their steps eagerly (the step and prefill graphs are captured without them; decode
  graphs never see such a row);
- a block's K/V then depend on the length of the sequence that computed it, not on its
  tokens alone, so prefix caching is off in this mode (``long_rope_mode``, at build).

The mode is on where the engine's ``max_seq_len`` exceeds b (``long_rope_boundary``):
below it every sequence is short and the one table is the short one. (A LLaMA-class
config with rope_type "longrope" gets the same: HF's forward over the whole sequence;
its generate, lacking Phi-3's cache drop, would mix both tables in one cache.)
"""
from __future__ import annotations

from typing import Optional

import torch


class LongRopeSwitch:
    """The per-sequence choice above, for a boundary ``b`` (original_max_position)."""

    def __init__(self, boundary: int):
        self.boundary = boundary
        self.recomputes = 0  # short sequences prefilled again at the boundary

    def is_long(self, seq) -> bool:
        """Its K/V below the boundary come from the long table: its prefill feeds more
        than b tokens."""
        return seq.num_prefill_tokens > self.boundary

    def stale(self, seq, ahead: int = 0) -> bool:
        """A decoding short sequence whose row ``ahead`` steps from now is at the boundary
        or past it: its cached K/V must be recomputed with the long factors first."""
        return not seq.prefilling and not self.is_long(seq) and \
            seq.num_computed_tokens + ahead >= self.boundary

    def long_rows(self, seqs, counts, device) -> Optional[torch.Tensor]:
        """[T] bool, set on the rows of long sequences below the boundary (the rows whose
        table their position does not tell), or None where the step has none."""
        b, spans, any_set = self.boundary, [], False
        for s, n in zip(seqs, counts):
            start = s.num_computed_tokens
            set_ = s.prefilling and self.is_long(s) and start < b
            spans.append((n, set_))
            any_set |= set_
        if not any_set:
            return None
        return torch.cat([torch.full((n, ), flag) for n, flag in spans]).to(device)


def recompute_due(scheduler, ahead: int = 0) -> list:
    """The scheduler's running sequences that must be recomputed before their next row
    (``LongRopeSwitch.stale``; ``ahead``: rows already fed but not yet counted), oldest
    first; [] without LongRoPE's two tables."""
    switch = scheduler.long_rope
    return [] if switch is None else [s for s in scheduler.running if switch.stale(s, ahead)]


def recompute_at_boundary(scheduler) -> None:
    """Free and requeue those first (the oldest in front), to be prefilled again as long
    sequences; not counted as preemptions."""
    for seq in reversed(recompute_due(scheduler)):
        scheduler.preempt(seq, counted=False)
        scheduler.long_rope.recomputes += 1


def long_rope_mode(rope, max_seq_len: int, backend, cache_options: dict):
    """(the switch or None, the cache backend's options) for a build of ``max_seq_len``
    tokens: where LongRoPE's two tables are in use, prefix caching off (a backend that
    declares it), and refused where the options ask for it."""
    from .errors import PlanError
    from .rope import long_rope_boundary

    boundary = long_rope_boundary(rope, max_seq_len)
    if boundary is None:
        return None, cache_options
    if "prefix_caching" in (getattr(backend, "options", None) or {}):
        if cache_options.get("prefix_caching"):
            raise PlanError(
                f"prefix_caching=True cannot run with LongRoPE past its original length "
                f"({boundary} tokens; max_seq_len={max_seq_len}): a block's K/V depend on "
                f"whether its sequence is longer than that, not on its tokens alone "
                f"(core/long_rope.py); leave prefix_caching out, or build with "
                f"max_seq_len <= {boundary}")
        cache_options = {**cache_options, "prefix_caching": False}
    return LongRopeSwitch(boundary), cache_options
