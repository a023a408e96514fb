"""What a proposed token costs here: the engine's own step times, fitted as they come.

A step's time grows with the tokens it feeds, ``seconds ~ c0 + c1 * tokens``: on a GPU at
a small batch ``c1`` is a sliver of ``c0`` (the weights are read once for every row), on
the CPU, or at a large batch, it is not. One more proposed token costs ``c1`` and gives
a token with the chance ``p`` that it is kept; a decoding request's token costs ``(c0 + c1
* B) / B`` at batch ``B``. So the proposed token pays for itself where ``p`` exceeds
``share(B) = c1 * B / (c0 + c1 * B)``: a greedy request whose tokens are kept less often
than that stops proposing (speculator.py), and past ``SHARE_OFF`` none does. Each decode
or verify step (no prompt chunk in it) is a point of an exponentially weighted
least-squares fit, so the fit follows the machine's load and the sequences' growing
context; until the points differ in tokens a proposed token is taken to cost nothing.
"""
from __future__ import annotations

DECAY = 0.98  # the weight of a point falls by this much with each later one
WARMUP, OUTLIER = 2, 4.0
#: a share at which no greedy request proposes, nor probes (the CPU at a large batch,
#: where a step's time is in proportion to its tokens: a draft hardly ever pays)
SHARE_OFF = 0.9


class StepCost:
    def __init__(self):
        self.n = self.x = self.y = self.xx = self.xy = 0.0  # weighted sums
        self.seen = {False: 0, True: 0}  # steps observed, without drafts and with

    def observe(self, tokens: int, seconds: float, drafted: bool) -> None:
        """A step of ``tokens`` fed tokens (``drafted``: some of them proposed) took
        ``seconds`` (the host's clock). The first ``WARMUP`` steps of either kind are left
        out (allocations, kernels compiled for a new path), and so is a step ``OUTLIER``
        times slower than the fit expects (the process descheduled meanwhile)."""
        self.seen[drafted] += 1
        fit = self.fit()
        if self.seen[drafted] <= WARMUP or \
                fit is not None and seconds > OUTLIER * (fit[0] + fit[1] * tokens):
            return
        d = DECAY
        self.n, self.x, self.y = d * self.n + 1, d * self.x + tokens, d * self.y + seconds
        self.xx, self.xy = d * self.xx + tokens * tokens, d * self.xy + tokens * seconds

    def fit(self) -> tuple[float, float] | None:
        """(c0, c1) >= 0, or None while the points do not tell ``c1`` apart."""
        if self.n < 2:
            return None
        mx, my = self.x / self.n, self.y / self.n
        var = self.xx / self.n - mx * mx
        if var <= 1e-6 * max(1.0, mx * mx):
            return None
        c1 = max(0.0, (self.xy / self.n - mx * my) / var)
        return max(0.0, my - c1 * mx), c1

    def share(self, batch: int) -> float:
        """The chance of being kept a proposed token needs at ``batch`` decoding requests
        to pay for itself (0 to 1; 0 while unknown)."""
        fit = self.fit()
        if fit is None:
            return 0.0
        c0, c1 = fit
        return min(1.0, c1 * batch / (c0 + c1 * batch)) if c0 + c1 * batch > 0 else 0.0
