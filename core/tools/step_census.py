"""``bench throughput --step-census`` and ``step_profile --census``: every engine step of a
run, classed, timed and set against its floor; where the run's wall time goes.

Each step is recorded where the engine runs it: a scheduled step as it enters the step's
body (its sequences and counts), a greedy decode step as the look-ahead launches or reads
it (one token a sequence). For every sequence of the step: the first position it feeds
and how many tokens (a span), whether it feeds prompt tokens (a prompt row) or one it
sampled (a decode row), and whether the LM head samples from it. A step is
**prefill-only** (prompt rows alone), **mixed** (both) or **decode-only** (decode rows
alone). Its wall time is the host's ``engine.step()`` call that returns its tokens; its
GPU time the model's forward (a graph replay or eager launches) between two CUDA events,
read once at the end (on the CPU: the forward's seconds). The run's wall less its steps'
is the time outside steps (the caller's loop: adding requests, collecting finished ones).

Off unless asked: it replaces ``engine.step`` and the runner's launch points on the
instance for the run only (``stop`` puts them back). No profiler: a list comprehension
over the step's sequences and two events a step.
"""
from __future__ import annotations

import collections
import time

import attrs
import torch

from .step_gaps import StepGaps

CLASSES = ("prefill-only", "mixed", "decode-only")


@attrs.define(slots=True)
class StepRecord:
    spans: list  # (first position, tokens) of each sequence of the step
    prompt_rows: int  # sequences feeding prompt tokens (the rest feed a sampled one)
    prompt_tokens: int
    sampled: int  # rows the LM head samples from
    wall_s: float = 0.0
    device: object = None  # (start, end) CUDA events, or the forward's seconds

    @property
    def rows(self) -> int:
        return len(self.spans)

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.spans)

    @property
    def kind(self) -> str:
        if self.prompt_rows == len(self.spans):
            return "prefill-only"
        return "mixed" if self.prompt_rows else "decode-only"


def scheduled(seqs, counts) -> StepRecord:
    """The record of a step feeding ``counts`` tokens to ``seqs``, taken before it runs."""
    spans, prompt_rows, prompt_tokens, sampled = [], 0, 0, 0
    for s, n in zip(seqs, counts):
        start = s.num_computed_tokens
        spans.append((start, n))
        if start < s.num_prefill_tokens:  # prefilling: samples once its prompt is fed
            prompt_rows += 1
            prompt_tokens += n
            sampled += start + n >= s.num_prefill_tokens
        else:  # its sampled token (and a draft's, each verified)
            sampled += n
    return StepRecord(spans, prompt_rows, prompt_tokens, sampled)


def decoding(seqs) -> StepRecord:
    """The record of a greedy decode step of ``seqs``, one token each, before it is read."""
    return StepRecord([(s.num_computed_tokens, 1) for s in seqs], 0, 0, len(seqs))


class StepCensus:
    """Records every step of ``engine`` from now until ``stop()``."""

    def __init__(self, engine):
        self.engine, self.steps = engine, []
        self.cuda = engine.device.type == "cuda"
        self._record = None  # the step the current engine.step() call runs
        self._launched = collections.deque()  # each launched forward's timing, in order
        self._patched = []  # (object, name, its own attribute before or None)
        self._patch(engine, "step", self._step)
        self._patch(engine, "_step_body", self._body)
        self._patch(engine.lookahead, "run", self._lookahead_run)
        self._patch(engine.runner, "forward", self._timed)
        if engine.decode_graphs is not None:
            self._patch(engine.decode_graphs, "launch", self._timed)
        self.start, self.end = time.perf_counter(), None

    def _patch(self, obj, name: str, wrap) -> None:
        own = vars(obj).get(name)
        self._patched.append((obj, name, own))
        setattr(obj, name, wrap(getattr(obj, name)))

    def stop(self) -> None:
        """The run is over: the engine's own methods back, the wall's end taken."""
        self.end = time.perf_counter()
        for obj, name, own in reversed(self._patched):
            if own is None:
                delattr(obj, name)
            else:
                setattr(obj, name, own)
        self._patched = []

    # the engine's methods, wrapped
    def _step(self, step):
        def run():
            inflight = self.engine.lookahead.inflight  # read now, launched before
            self._record = None if inflight is None else decoding(inflight[0])
            t = time.perf_counter()
            try:
                out = step()
            except BaseException:  # the step's sequences are recomputed: nothing to time
                self._record = None
                self._launched.clear()
                raise
            record, self._record = self._record, None
            if record is not None:
                record.wall_s = time.perf_counter() - t
                record.device = self._launched.popleft() if self._launched else None
                self.steps.append(record)
            return out
        return run

    def _body(self, body):
        def run(step, tokens, replay):
            self._record = scheduled(step.seqs, step.counts)
            return body(step, tokens, replay)
        return run

    def _lookahead_run(self, lookahead_run):
        def run(seqs, tokens):
            self._record = decoding(seqs)
            return lookahead_run(seqs, tokens)
        return run

    def _timed(self, launch):
        """A forward launch, timed: two CUDA events around it, or its seconds on the CPU."""
        def run(*args, **kwargs):
            if not self.cuda:
                t = time.perf_counter()
                out = launch(*args, **kwargs)
                self._launched.append(time.perf_counter() - t)
                return out
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            out = launch(*args, **kwargs)
            end.record()
            self._launched.append((start, end))
            return out
        return run

    def device_s(self) -> list:
        """Each step's GPU seconds (None where no forward was timed)."""
        if self.cuda:
            torch.cuda.synchronize()
        return [d if d is None or isinstance(d, float) else d[0].elapsed_time(d[1]) / 1e3
                for d in (s.device for s in self.steps)]

    def summary(self, floors) -> dict:
        """The run by class (``CLASSES``, then ``outside steps``): steps, wall seconds and
        share of the run's wall, GPU seconds, rows, prompt and decode tokens, rows
        sampled, the floor (``floors``: step_floors.StepFloors); of the decode-only steps,
        the tail's (``tail``: fewer rows than half the batch); and every step's own."""
        end = self.end if self.end is not None else time.perf_counter()
        wall, device = end - self.start, self.device_s()
        per_step = [(s, d, sum(floors.parts_s(s).values()))
                    for s, d in zip(self.steps, device)]
        classes = {kind: _tally([x for x in per_step if x[0].kind == kind], wall)
                   for kind in CLASSES}
        half = self.engine.scheduler.max_batch_size // 2
        classes["decode-only"]["tail"] = dict(below_rows=half, **_tally(
            [x for x in per_step if x[0].kind == "decode-only" and x[0].rows < half], wall))
        inside = sum(c["wall_s"] for c in classes.values())
        classes["outside steps"] = {"wall_s": wall - inside, "wall_share": 1 - inside / wall}
        return {"wall_s": wall, "classes": classes,
                "floor_s": sum(f for _, _, f in per_step),
                "rates": {"matmul_flops_per_s": floors.matmul_rate,
                          "copy_bytes_per_s": floors.copy_rate},
                "steps": {"kind": [s.kind for s, _, _ in per_step],
                          "rows": [s.rows for s, _, _ in per_step],
                          "prompt_tokens": [s.prompt_tokens for s, _, _ in per_step],
                          "tokens": [s.tokens for s, _, _ in per_step],
                          "wall_ms": [1e3 * s.wall_s for s, _, _ in per_step],
                          "gpu_ms": [None if d is None else 1e3 * d for _, d, _ in per_step],
                          "floor_ms": [1e3 * f for _, _, f in per_step]}}


def _tally(steps, wall: float) -> dict:
    """The sums of (StepRecord, GPU seconds, floor seconds) ``steps``, as summary says."""
    step_wall = sum(s.wall_s for s, _, _ in steps)
    return {"steps": len(steps), "wall_s": step_wall, "wall_share": step_wall / wall,
            "device_s": sum(d or 0.0 for _, d, _ in steps),
            "rows": sum(s.rows for s, _, _ in steps),
            "prompt_tokens": sum(s.prompt_tokens for s, _, _ in steps),
            "decode_tokens": sum(s.tokens - s.prompt_tokens for s, _, _ in steps),
            "sampled": sum(s.sampled for s, _, _ in steps),
            "floor_s": sum(f for _, _, f in steps)}


class StepTimers:
    """What times a ``bench throughput`` run's steps, as asked: ``gaps`` (step_gaps.py)
    and, given ``floors`` (step_floors.StepFloors), the census; both from ``start()``
    (after the warm-up) to ``stop()`` (the requests done)."""

    def __init__(self, engine, gaps: bool, floors=None):
        self.engine, self.want_gaps, self.floors = engine, gaps, floors
        self.gaps = self.census = None

    def start(self) -> None:
        self.gaps = StepGaps(self.engine) if self.want_gaps else None
        self.census = StepCensus(self.engine) if self.floors else None

    def stop(self) -> None:
        if self.census is not None:
            self.census.stop()

    def results(self) -> dict:
        """{step_gaps, step_census}: the summaries of those that ran."""
        out = {} if self.gaps is None else {"step_gaps": self.gaps.summary()}
        if self.census is not None:
            out["step_census"] = self.census.summary(self.floors)
        return out


def table(census: dict) -> str:
    """A census summary as a table: a row a class (the decode-only tail below its own),
    then the time outside steps and the run."""
    wall, rows = census["wall_s"], census["classes"]
    head = (f"{'step class':<15}{'steps':>7}{'wall s':>9}{'of wall':>9}{'GPU s':>8}"
            f"{'rows/step':>10}{'prompt tok':>11}{'decode tok':>11}{'floor s':>9}"
            f"{'floor/wall':>11}")
    lines = [head]
    for kind in CLASSES:
        lines.append(_row(kind, rows[kind]))
        if kind == "decode-only":  # within it: the few rows left at the end, or between
            lines.append(_row(f"  < {rows[kind]['tail']['below_rows']} rows",
                              rows[kind]["tail"]))
    out = rows["outside steps"]
    lines.append(f"{'outside steps':<15}{'':>7}{out['wall_s']:>9.3f}{out['wall_share']:>9.1%}")
    lines.append(f"{'run':<15}{sum(rows[k]['steps'] for k in CLASSES):>7}{wall:>9.3f}"
                 f"{1:>9.1%}{sum(rows[k]['device_s'] for k in CLASSES):>8.3f}{'':>10}"
                 f"{sum(rows[k]['prompt_tokens'] for k in CLASSES):>11}"
                 f"{sum(rows[k]['decode_tokens'] for k in CLASSES):>11}"
                 f"{census['floor_s']:>9.3f}{census['floor_s'] / wall:>11.1%}")
    r = census["rates"]
    lines.append(f"floors at {r['matmul_flops_per_s'] / 1e12:.3g} TFLOP/s and "
                 f"{r['copy_bytes_per_s'] / 1e9:.0f} GB/s (step_floors.py)")
    return "\n".join(lines)


def _row(label: str, c: dict) -> str:
    per = c["rows"] / c["steps"] if c["steps"] else 0
    ratio = f"{c['floor_s'] / c['wall_s']:.1%}" if c["wall_s"] else "-"
    return (f"{label:<15}{c['steps']:>7}{c['wall_s']:>9.3f}{c['wall_share']:>9.1%}"
            f"{c['device_s']:>8.3f}{per:>10.1f}{c['prompt_tokens']:>11}"
            f"{c['decode_tokens']:>11}{c['floor_s']:>9.3f}{ratio:>11}")
