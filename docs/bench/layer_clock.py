"""Each decoder layer's time in a decode step (CUDA events on the compute stream; host time
on the CPU), for docs/bench/offload_weights.py and offload_resident.py."""
import statistics
import time

import torch

from infergraft.core.request import SamplingParams


def greedy(engine, prompts, new_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    return [list(s.output_ids) for s in seqs]


class LayerClock:
    """Each layer's start and end, per forward (CUDA events on the compute stream, after
    any wait for a streamed layer's copy; host time on the CPU). ``span(rows, a, b)``:
    the median time of layers a..b-1 over the forwards of ``rows`` rows."""

    def __init__(self, model, cuda: bool):
        self.model, self.cuda, self.steps = model, cuda, []
        for i, layer in enumerate(model.layers):
            for name in ("forward", "forward_fused"):
                setattr(layer, name, self._wrap(i, getattr(layer, name)))

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def _wrap(self, i, fn):
        def timed(h, *args, **kw):
            if i == 0:
                self.steps.append((h.shape[-2], []))
            start = self._mark()
            out = fn(h, *args, **kw)
            self.steps[-1][1].append((start, self._mark()))
            return out
        return timed

    def remove(self):
        for layer in self.model.layers:
            for name in ("forward", "forward_fused"):
                delattr(layer, name)  # the instance's wrapper: the class method again
        if self.cuda:
            torch.cuda.synchronize()

    def span(self, rows: int, a: int, b: int) -> float:
        """Seconds (median over the forwards of ``rows`` rows) from layer a's start to
        layer b-1's end."""
        def seconds(x, y):
            return x.elapsed_time(y) / 1e3 if self.cuda else y - x
        times = [seconds(marks[a][0], marks[b - 1][1]) for r, marks in self.steps
                 if r == rows and len(marks) >= b]
        return statistics.median(times) if times else float("nan")


def layer_times(engine, prompts, new_tokens, cuda, spans) -> dict:
    """{name: seconds} of each (a, b) layer span in ``spans`` at decode steps of this batch."""
    clock = LayerClock(engine.model, cuda)
    try:
        greedy(engine, prompts, new_tokens)
    finally:
        clock.remove()
    return {name: clock.span(len(prompts), a, b) for name, (a, b) in spans.items()}


class GraphSpanClock:
    """The GPU time from layer a's start to layer b-1's end inside the decode graphs'
    replays: a timing event at each end captured into every graph (``external``: an event
    record node, re-recorded by each replay), read after each replay. Installing it
    recaptures the engine's decode graphs (the nodes stay in them)."""

    def __init__(self, engine, a: int, b: int):
        self.engine, self.marks = engine, {}  # rows -> [start, end] events
        for layer, end in ((engine.model.layers[a], False), (engine.model.layers[b - 1], True)):
            for name in ("forward", "forward_fused"):
                setattr(layer, name, self._wrap(getattr(layer, name), end))
        graphs = engine.decode_graphs
        graphs.graphs.clear()
        graphs.pool = None
        graphs.capture()

    def _mark(self, rows: int, end: bool) -> None:
        e = torch.cuda.Event(enable_timing=True, external=True)
        e.record()
        self.marks.setdefault(rows, [None, None])[end] = e

    def _wrap(self, fn, end: bool):
        def timed(h, *args, **kw):
            capturing = torch.cuda.is_current_stream_capturing()
            if capturing and not end:
                self._mark(h.shape[-2], False)
            out = fn(h, *args, **kw)
            if capturing and end:
                self._mark(h.shape[-2], True)
            return out
        return timed

    def times(self, prompts, new_tokens: int) -> list[float]:
        """Seconds of the span in each decode replay of one greedy batch of ``prompts``."""
        engine, graphs = self.engine, self.engine.decode_graphs
        params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
        for p in prompts:
            engine.add_request(p, params)
        start, end = self.marks[graphs.bucket(len(prompts))]
        times = []
        while engine.has_unfinished():
            before = graphs.replays
            engine.step()
            torch.cuda.synchronize()
            if graphs.replays > before:  # the latest replay's events
                times.append(start.elapsed_time(end) / 1e3)
        return times
