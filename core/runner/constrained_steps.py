"""Constrained greedy rows in asynchronous steps (``async_steps.py``).

A step's forward pass does not depend on its rows' masks; only its sampling does. So a
step N+1 holding constrained rows is launched before step N's tokens are read, as any
other (its decode rows fed N's masked tokens on the device), but its sampling waits:
N's tokens are read and accepted into their grammars, then N+1's masks are filled on the
host while N+1's forward pass runs, and its masking (one launch, ``RowConstraints.mask``)
and argmax are launched behind it; step N+2 is fed from those tokens. The device idles
only where reading, accepting and filling take longer than a forward pass. The masks are
the synchronous engine's (each grammar's state after the same tokens), so the tokens are.

What differs from an unconstrained step, and how:
- jump-forward: a grammar that forces tokens after N's token makes the synchronous
  engine feed that token and the forced ones together in its next step, where N+1 fed
  the token alone. That row of N+1 is dropped (never masked, sampled nor read) and
  rolled back: the sequence's last position and its K/V (``KVCache.truncate``) are
  forgotten, so its next step feeds the token and the forced ones as one chunk, as the
  synchronous engine does. A cache that cannot truncate keeps such requests synchronous.
  (The synchronous engine schedules its next step afresh then, the forced chunk taking
  its token budget one step earlier than here: other prompts' chunks may be cut
  otherwise, the same tokens where the model's rows do not depend on their batch.)
- a grammar that completes at N ("stop"), like EOS, wastes its row of N+1 (not masked:
  a finished grammar allows nothing);
- a row whose constraint fails or allows no token is sampled as -1 when read: its
  request alone ends with "error".

Sampled (non-greedy) constrained rows, and those asking for logprobs or penalties, stay
synchronous: their tokens are drawn on the host.
"""
from __future__ import annotations

from ..request import Status


def on_device(seq, cache) -> bool:
    """Whether ``seq``'s token is the argmax of its logits (masked where it is
    constrained), which an asynchronous step computes on the device."""
    p = seq.params
    if p.plain_greedy:
        return True
    if not p.greedy or p.needs_logits_processing or not p.constrained:
        return False
    return not p.jump_forward or getattr(cache, "supports_truncate", False)


def constrained(launched) -> bool:
    """Whether a row of ``launched`` needs a mask (its sampling waits for the step
    before): a constrained sequence's that gets a token (not one still prefilling after
    its chunk, as one whose grammar compiles is: core/scheduler.py)."""
    return any(s.params.constrained and s.id in launched.rows for s in launched.step.seqs)


def masks(engine, launched) -> None:
    """Mask the constrained rows of ``launched``'s logits that still get a token (their
    states took every token before), in place; the rows that failed are kept, to be read
    as -1."""
    # each row's sequence, by its row of the logits (a drafted sequence has several)
    by_row = [None] * len(launched.logits)
    for s in launched.step.seqs:
        if s.params.constrained and s.id in launched.rows and s.status is Status.RUNNING:
            by_row[launched.rows[s.id]] = s
    rows = [row for row, s in enumerate(by_row) if s is not None]
    if rows:
        launched.failed = set(engine.constraints.mask(launched.logits, by_row, rows))


def drop_forced(engine, launched) -> None:
    """The rows of ``launched`` whose sequence was given forced tokens since it was
    launched (it is prefilling again): dropped, their last position rolled back."""
    for s in launched.step.seqs:
        if s.id in launched.rows and s.status is Status.RUNNING and s.prefilling:
            launched.drop(s.id)
            s.num_computed_tokens -= 1
            engine.cache.truncate(s.id, s.num_computed_tokens)
