"""Per-request latency metrics (TTFT, TPOT, ITL) and run-level percentiles."""
from __future__ import annotations

import math
import time
from typing import Optional, Sequence

import attrs


@attrs.define
class RequestMetrics:
    arrival: float = attrs.field(factory=time.perf_counter)
    first_token: Optional[float] = None
    token_times: list[float] = attrs.field(factory=list)
    finished: Optional[float] = None
    # speculative decoding: tokens proposed and verified, those kept, verify steps
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_drafts: int = 0

    def on_draft(self, proposed: int, accepted: int) -> None:
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        self.num_drafts += 1

    @property
    def acceptance_rate(self) -> Optional[float]:
        """Proposed tokens kept, 0 to 1 (None: nothing was proposed)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_accepted_length(self) -> Optional[float]:
        """Tokens a verify step gave this request on average, the target's own included
        (1 + kept tokens per draft; None: no draft was verified)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    def on_token(self, now: float) -> None:
        if self.first_token is None:
            self.first_token = now
        self.token_times.append(now)

    @property
    def ttft(self) -> Optional[float]:
        """Seconds from arrival to the first output token."""
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def itl(self) -> list[float]:
        """Inter-token latencies (seconds) after the first token."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> Optional[float]:
        """Mean seconds per output token after the first."""
        t = self.token_times
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None

    @property
    def tokens_per_s(self) -> Optional[float]:
        t = self.token_times
        return len(t) / (t[-1] - self.arrival) if t and t[-1] > self.arrival else None

    def as_dict(self) -> dict:
        return {"ttft_s": self.ttft, "tpot_s": self.tpot, "tokens_per_s": self.tokens_per_s,
                "output_tokens": len(self.token_times), "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "mean_accepted_length": self.mean_accepted_length}


def percentiles(values: Sequence[float], qs=(50, 90, 99)) -> dict[str, float]:
    """Nearest-rank percentiles, e.g. {'p50': ..., 'p90': ..., 'p99': ...}."""
    if not values:
        return {f"p{q}": float("nan") for q in qs}
    s = sorted(values)
    # nearest rank: the smallest value with at least q% of the values at or below it
    return {f"p{q}": s[min(len(s) - 1, max(0, math.ceil(q * len(s) / 100) - 1))] for q in qs}
