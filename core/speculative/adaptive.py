"""How many tokens a request proposes next: its proposal length follows its acceptance.

A draft of which any token was kept earns one more token (up to the configured ``k``):
the tokens past the first refused one cost a few query rows of a step whose weights are
read anyway. One wholly refused costs a token. After ``MISSES_BEFORE_PAUSE`` wholly
refused drafts in a row the request stops proposing for a pause of decode steps (its steps
run as plain decode, at decode's cost), then tries again; each pause that follows without
a kept token is twice as long, up to ``MAX_PAUSE``. So a request whose text the proposer
cannot guess costs a few verify steps and then next to nothing, and one whose text turns
predictable again (a quote) comes back within a pause.

``rate`` estimates how often its proposed tokens are kept (recent drafts weigh most); where
that is below what a proposed token costs on this machine at this batch
(``cost.StepCost.share``), the speculator ``hold``s it: a pause as above, after which one
draft probes the rate again (``probing``: never held).

``whole`` estimates how often a draft is kept whole (every token of it): the chance that a
verify step launched before this one's tokens are read, taking them all as kept, is not
wasted on this request (``ahead.py``).
"""
from __future__ import annotations

MISSES_BEFORE_PAUSE = 4
FIRST_PAUSE, MAX_PAUSE = 2, 128
RATE_DECAY = 0.8  # the weight of a draft in ``rate`` falls by this much with each later one


class AdaptiveK:
    def __init__(self, k: int):
        self.k_max = self.k = k
        self.misses = 0  # drafts wholly refused in a row
        self.pause = 0  # decode steps left without proposing
        self.next_pause = FIRST_PAUSE
        self._kept = self._proposed = 0.0  # recent drafts' tokens, kept and proposed
        self._whole = self._drafts = 0.0  # recent drafts kept whole, and all of them
        self.probing = False  # a pause just ended: its next draft measures ``rate`` again

    @property
    def rate(self) -> float:
        """Recent proposed tokens kept, 0 to 1 (1 before any draft: let it try)."""
        return self._kept / self._proposed if self._proposed else 1.0

    @property
    def whole(self) -> float:
        """Recent drafts kept whole, 0 to 1 (1 before any draft)."""
        return self._whole / self._drafts if self._drafts else 1.0

    def hold(self) -> None:
        """Stop proposing for a pause (its tokens cost more than they are kept for)."""
        self.pause, self.misses = self.next_pause, 0
        self.next_pause = min(MAX_PAUSE, 2 * self.next_pause)

    @property
    def active(self) -> bool:
        """Proposing at the next decode step (not paused)."""
        return self.pause == 0

    def take(self) -> int:
        """Tokens to propose at this decode step (0 while paused; counts the pause down)."""
        if self.pause:
            self.pause -= 1
            self.probing = self.pause == 0
            return 0
        return self.k

    def update(self, proposed: int, accepted: int) -> None:
        """A draft of ``proposed`` tokens was verified and ``accepted`` of them kept."""
        self._kept = RATE_DECAY * self._kept + accepted
        self._proposed = RATE_DECAY * self._proposed + proposed
        self._whole = RATE_DECAY * self._whole + (accepted == proposed)
        self._drafts = RATE_DECAY * self._drafts + 1
        self.probing = False
        if accepted > 0:
            self.k, self.misses, self.next_pause = min(self.k_max, self.k + 1), 0, FIRST_PAUSE
            return
        self.k, self.misses = max(1, self.k - 1), self.misses + 1
        if self.misses >= MISSES_BEFORE_PAUSE:
            self.hold()
