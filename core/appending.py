"""A sampled token appended to its request, and whether that ends it: a stop string, EOS,
``max_new_tokens``, or the request's constraint (its logits processors: a refused token,
a complete grammar). A constraint that forces the tokens after it (jump-forward) has them
appended too, without a forward pass each: the request's next step feeds them together,
as a prompt chunk is fed (``num_prefill_tokens`` moved up to its length)."""
from __future__ import annotations


def append_token(engine, seq, token: int, now: float) -> None:
    """``Engine._append``: ``token`` (-1: its sampling failed) added to ``seq``, and
    ``seq`` finished when that ends it."""
    if token < 0:  # this sequence's sampling failed (seq.error says why)
        return engine._finish(seq, "error", now)
    reason = _take(engine, seq, token, now)
    if reason is None and seq.params.constrained and seq.params.jump_forward:
        left = seq.params.max_new_tokens - len(seq.output_ids)
        forced = engine.constraints.forced(seq, left)
        for tok in forced:  # its state took them already
            reason = _take(engine, seq, tok, now, forced=True)
            if reason is not None:
                break
        if forced and reason is None:  # fed in its next step, one forward pass for all
            seq.num_prefill_tokens = seq.num_tokens
            engine._ahead = None  # (a step scheduled ahead would feed it one token)
        if forced and reason is None and engine.constraints.complete(seq):
            reason = "stop"
    if reason is not None:
        engine._finish(seq, reason, now)


def _take(engine, seq, token: int, now: float, forced: bool = False) -> str | None:
    """Append ``token``; the finish reason it brings (None: the request goes on)."""
    seq.output_ids.append(token)
    seq.metrics.on_token(now)
    p = seq.params
    if p.stop:
        seq.text = engine._decode(seq.output_ids)
        for s in p.stop:
            at = seq.text.find(s)
            if at >= 0:
                seq.text = seq.text[:at]
                return "stop"
    if p.constrained and not forced:
        reason = engine.constraints.advance(seq, token)
        if reason is not None:
            return reason
    if token in engine.eos_token_ids and not p.ignore_eos:
        return "stop"
    if len(seq.output_ids) >= p.max_new_tokens:
        return "length"
    return None
