"""Token selection: greedy, temperature, top-k, top-p, per-request seeded generators."""
from __future__ import annotations

import torch


def filter_logits(logits: torch.Tensor, temperature: float, top_k, top_p) -> torch.Tensor:
    """logits: [V] float32 -> scaled and masked logits (masked entries are -inf)."""
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        probs, order = torch.sort(logits.softmax(-1), descending=True)
        before = probs.cumsum(-1) - probs  # mass of strictly more likely tokens
        drop = before >= top_p  # keeps the smallest set reaching top_p (at least one)
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    return logits


def sample_each(logits: torch.Tensor, seqs) -> list[int]:
    """``sample``, but a row that fails (NaN logits, say) gets -1 and its sequence's
    ``error`` says why, instead of costing the other rows their tokens."""
    states = [None if s.generator is None else s.generator.get_state() for s in seqs]
    try:
        return sample(logits, seqs)
    except Exception:  # rows before the failing one drew already: draw again from there
        for s, state in zip(seqs, states):
            if state is not None:
                s.generator.set_state(state)
        return [_sample_row(logits[i:i + 1], s) for i, s in enumerate(seqs)]


def _sample_row(row: torch.Tensor, seq) -> int:
    try:
        return sample(row, [seq])[0]
    except Exception as e:
        seq.error = f"sampling failed: {type(e).__name__}: {e}"
        return -1


def sample(logits: torch.Tensor, seqs) -> list[int]:
    """logits: [B, V] float32, one row per sequence -> one token id per sequence. A row
    holding NaN raises (argmax would return the NaN's index as a token)."""
    # [2, B] -> host in one copy (one sync a step, as before the NaN check)
    greedy, nan = torch.stack([logits.argmax(-1), torch.isnan(logits).any(-1).long()]).tolist()
    nan_rows = [row for row, bad in enumerate(nan) if bad]
    if nan_rows:
        raise ValueError(f"NaN logits in row(s) {nan_rows}: the model's output overflowed")
    out = []
    for row, seq in enumerate(seqs):
        p = seq.params
        if p.greedy:
            out.append(greedy[row])
            continue
        masked = filter_logits(logits[row].cpu(), p.temperature, p.top_k, p.top_p)
        out.append(int(torch.multinomial(masked.softmax(-1), 1, generator=seq.generator)))
    return out
