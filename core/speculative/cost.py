"""What a proposed token costs here: the engine's own step times, fitted as they come.

A step's time grows with the tokens it feeds and is larger where it carries drafts,
``seconds ~ c0 + c1 * tokens + c2 * drafted``: on a GPU at a small batch ``c1`` is a sliver
of ``c0`` (the weights are read once for every row), on the CPU, or at a large batch, it is
not; ``c2`` is what a step with drafts costs beyond its tokens: the proposer's time, and the
decode look-ahead it gives up (a plain step is launched before the last one's tokens are
read, a verify step only after: a small model's step is mostly host time, which the
look-ahead hides). So ``D`` proposed tokens in a step of ``B`` decoding requests cost
``c1 * D + c2`` and give ``p * D`` tokens, each worth ``(c0 + c1 * B) / B`` of a plain step:
they pay where the chance ``p`` that one is kept exceeds
``share(B, D) = (c1 * D + c2) * B / (D * (c0 + c1 * B))``. A greedy request whose tokens are
kept less often than that stops proposing (speculator.py), and past ``SHARE_OFF`` none
does. Each decode or verify step (no prompt chunk in it) is a point of an exponentially
weighted least-squares fit, so the fit follows the machine's load and the sequences'
growing context. Until the points tell ``c1`` apart (steps of different sizes) it is 0,
and until steps with and without drafts were both seen ``c2`` is; before either, a
proposed token is taken to cost nothing.

A point is the engine call that ran a step, the host's work around it included. Where
steps are launched ahead (the decode look-ahead, asynchronous steps, verify steps
launched ahead: ``ahead.py``) a call launches the next step and reads this one, so back
to back it lasts one step of the pipeline, the host's work beside the GPU's: such calls
are points of the step they read, and ``c2`` is then what a drafted step costs beyond its
tokens with its host work overlapped. The calls that start a pipeline (launching two
steps, reading one) are not points.
"""
from __future__ import annotations

from typing import NamedTuple

DECAY = 0.98  # the weight of a point falls by this much with each later one
WARMUP, OUTLIER = 2, 4.0
#: a share at which no greedy request proposes, nor probes (the CPU at a large batch,
#: where a step's time is in proportion to its tokens: a draft hardly ever pays)
SHARE_OFF = 0.9
_TINY = 1e-9


class Fit(NamedTuple):
    c0: float  # seconds a plain step costs beyond its tokens
    c1: float  # seconds a fed token costs
    c2: float  # seconds a step with drafts costs beyond its tokens and c0


class StepCost:
    def __init__(self):
        # weighted sums over the points (t: tokens, d: drafted 0/1, y: seconds)
        self.n = self.t = self.d = self.tt = self.td = self.y = self.ty = self.dy = 0.0
        self.seen = {False: 0, True: 0}  # steps observed, without drafts and with
        self._fit: Fit | None = None  # ``fit()`` of the points so far, once asked
        self._fitted = True  # (no point yet: None)

    def observe(self, tokens: int, seconds: float, drafted: bool) -> None:
        """A step of ``tokens`` fed tokens (``drafted``: some of them proposed) took
        ``seconds`` (the host's clock). The first ``WARMUP`` steps of either kind are left
        out (allocations, kernels compiled for a new path), and so is a step ``OUTLIER``
        times slower than the fit expects (the process descheduled meanwhile)."""
        self.seen[drafted] += 1
        fit = self.fit()
        if self.seen[drafted] <= WARMUP or fit is not None and \
                seconds > OUTLIER * (fit.c0 + fit.c1 * tokens + fit.c2 * drafted):
            return
        k, t, d, y = DECAY, float(tokens), float(drafted), seconds
        self.n, self.t, self.d = k * self.n + 1, k * self.t + t, k * self.d + d
        self.tt, self.td = k * self.tt + t * t, k * self.td + t * d
        self.y, self.ty, self.dy = k * self.y + y, k * self.ty + t * y, k * self.dy + d * y
        self._fitted = False

    def fit(self) -> Fit | None:
        """(c0, c1, c2), each >= 0, or None while the points tell neither ``c1`` nor
        ``c2`` apart (solved once a point: every step asks it several times)."""
        if not self._fitted:
            self._fit, self._fitted = self._solve(), True
        return self._fit

    def _solve(self) -> Fit | None:
        if self.n < 2:
            return None
        n = self.n
        var_t = self.tt / n - (self.t / n) ** 2
        var_d = self.d / n - (self.d / n) ** 2  # (d * d = d)
        has_t, has_d = var_t > 1e-6 * max(1.0, (self.t / n) ** 2), var_d > 1e-3
        if has_t and has_d:
            full = self._solve3()
            if full is not None and full.c1 >= 0 and full.c2 >= 0:
                return Fit(max(0.0, full.c0), full.c1, full.c2)
            if full is not None and full.c1 >= 0:  # noise put c2 below 0: refit without it
                has_d = False
        if has_d:  # one token count a kind (batch 1, a fixed k): the difference is c2's
            return self._solve2(self.d, self.d, self.dy, lambda c0, c: Fit(c0, 0.0, c))
        if has_t:
            return self._solve2(self.t, self.tt, self.ty, lambda c0, c: Fit(c0, c, 0.0))
        return None

    def _solve2(self, sx, sxx, sxy, make) -> Fit:
        """Least squares of y on (1, x): intercept and slope, the slope at least 0."""
        n = self.n
        mx, my = sx / n, self.y / n
        slope = max(0.0, (sxy / n - mx * my) / (sxx / n - mx * mx))
        return make(max(0.0, my - slope * mx), slope)

    def _solve3(self) -> Fit | None:
        """Least squares of y on (1, tokens, drafted), unclamped, by Cramer's rule, each
        determinant written out (plain floats: every step solves it); None where the three
        are nearly collinear (every step with drafts the same size: c1 and c2 not apart)."""
        # the normal equations [[n t d] [t tt td] [d td d]] c = [y ty dy]
        n, t, d, tt, td, y, ty, dy = (self.n, self.t, self.d, self.tt, self.td, self.y,
                                      self.ty, self.dy)
        det = n * (tt * d - td * td) - t * (t * d - td * d) + d * (t * td - tt * d)
        if abs(det) <= _TINY * max(1.0, abs(n * tt * d)):
            return None
        c0 = (y * (tt * d - td * td) - t * (ty * d - td * dy) + d * (ty * td - tt * dy)) / det
        c1 = (n * (ty * d - td * dy) - y * (t * d - td * d) + d * (t * dy - ty * d)) / det
        c2 = (n * (tt * dy - ty * td) - t * (t * dy - ty * d) + y * (t * td - tt * d)) / det
        return Fit(c0, c1, c2)  # (signs checked by the caller: one below 0 is refitted)

    def share(self, batch: int, proposed: int | None = None) -> float:
        """The chance of being kept a proposed token needs, at ``batch`` decoding requests
        proposing ``proposed`` tokens together (default one each), to pay for itself (0 to
        1; 0 while unknown)."""
        fit = self.fit()
        if fit is None:
            return 0.0
        c0, c1, c2 = fit
        proposed = max(1, proposed if proposed is not None else batch)
        plain = c0 + c1 * batch
        if plain <= 0:
            return 0.0
        return min(1.0, (c1 * proposed + c2) * batch / (proposed * plain))

