"""``bench throughput --step-gaps``: how long the GPU sits idle between engine steps.

Every CUDA-graph replay of the engine (decode and mixed steps) is bracketed by two CUDA
events recorded on the stream: the first runs when the GPU reaches the replay, the
second when the replay's work is done. ``start[N+1] - end[N]`` is then the time the GPU
waited for the host between two steps (scheduling, sampling, building step N+1's
inputs), ``end[N] - start[N]`` the step's own GPU time. Only graph replays are timed: on
CUDA every step of the paged cache replays one (steps over the largest bucket excepted).
"""
from __future__ import annotations

import torch

from ..metrics import percentiles


class StepGaps:
    def __init__(self, engine):
        self.pairs: list[tuple] = []  # (start, end) CUDA events, in launch order
        runners = [engine.decode_graphs, engine.runner.step_graphs]
        for runner in (r for r in runners if r is not None):
            for graph in runner.graphs.values():
                graph.replay = self._timed(graph.replay)

    def _timed(self, replay):
        def run():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            replay()
            end.record()
            self.pairs.append((start, end))
        return run

    def summary(self) -> dict:
        """Milliseconds: the steps' GPU time and the gaps between them (P50 / P90 / P99,
        totals), and the idle share of the span from the first step to the last."""
        if len(self.pairs) < 2:
            return {"steps": len(self.pairs)}
        torch.cuda.synchronize()
        busy = [s.elapsed_time(e) for s, e in self.pairs]
        gaps = [e.elapsed_time(s) for (_, e), (s, _) in zip(self.pairs, self.pairs[1:])]
        span = self.pairs[0][0].elapsed_time(self.pairs[-1][1])
        return {"steps": len(busy), "span_ms": span, "busy_ms_total": sum(busy),
                "gap_ms_total": sum(gaps), "idle_share": sum(gaps) / span,
                "busy_ms": percentiles(busy), "gap_ms": percentiles(gaps)}
