"""Benchmark harness: our engine beside HF transformers and the memory roofline, one run.

Decode is memory-bound: a step reads every weight and the live K/V once, so the floor
for TPOT is (weight bytes + K/V bytes) / copy bandwidth, the bandwidth measured here in
the same run (of a mixture of experts, the experts a batch routes to: ``step_bytes`` in
``roofline.py``). Times are medians after warm-up runs of identical shapes. ``matmul_rate``
is the compute roofline of ``infergraft bench throughput``, measured the same way.
``SHAPES`` (``shapes.py``): the random LLaMA shapes a run may take instead of a checkpoint.
"""
from __future__ import annotations

import platform
import statistics
import time
from typing import Optional

import attrs
import torch

from ..errors import PlanError
from ..metrics import percentiles
from ..request import SamplingParams
from .bench_report import disagreement
from .roofline import Roofline, expert_bytes, rank_floors, step_bytes  # noqa: F401
from .shapes import SHAPES, shape_config  # noqa: F401  (imported from here too)


def describe_device(device) -> str:
    """The GPU's name on CUDA, else the host's processor (or machine)."""
    if str(device).startswith("cuda"):
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


SYSTEMS = ("infergraft", "hf-eager", "hf-static")
WARMUP_STEPS = 2  # decode steps left out of a run's TPOT: the first run slow (allocation, compile)


@attrs.define
class Result:
    system: str  # one of SYSTEMS
    batch: int
    ttft_ms: float
    tpot_ms: float
    roofline_ms: float  # TPOT floor for this batch: bytes read per step / bandwidth
    tpot_p90_ms: Optional[float] = None  # the step times' spread (tpot_ms is their median)
    tpot_p99_ms: Optional[float] = None
    tpot_runs_ms: list[float] = attrs.field(factory=list)  # each repeated run's median

    @property
    def runs_disagree(self) -> float:
        """How far the repeated runs are apart (bench_report: above UNSTEADY, a busy host)."""
        return disagreement(self.tpot_runs_ms)

    @property
    def tokens_per_s(self) -> float:
        return self.batch * 1e3 / self.tpot_ms

    @property
    def roofline_fraction(self) -> float:
        return self.roofline_ms / self.tpot_ms


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def best_seconds(device, fn, repeats: int) -> float:
    """The shortest of ``repeats`` timed ``fn()`` calls after an untimed one (STREAM's way)."""
    fn()
    return min(timings(device, fn, repeats))


def timings(device, fn, repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` ``fn()`` calls (CUDA: events; the host adds its sync)."""
    times = []
    cuda = torch.device(device).type == "cuda"
    for _ in range(repeats):
        sync(device)
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return times


def copy_bandwidth(device, nbytes: int = 1 << 30, repeats: int = 20) -> float:
    """Bytes per second of a large device copy, counting bytes read plus written: the best
    of ``repeats`` copies (``best_seconds``)."""
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / best_seconds(device, lambda: dst.copy_(src), repeats)


def matmul_rate(device, dtype, n: int, repeats: int = 5) -> float:
    """FLOP/s of an n x n x n ``dtype`` matmul (n^3 multiply-adds: 2 n^3 FLOPs), the best
    of ``repeats`` (``best_seconds``): the compute roofline, as copy_bandwidth is the
    memory one."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    return 2 * n ** 3 / best_seconds(device, lambda: torch.matmul(a, b, out=out), repeats)


def random_prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 1, (batch, length), generator=g).tolist()


def bench_ours(engine, prompts, new_tokens: int, warmup: int = 1,
               repeats: int = 3) -> tuple[float, float, dict, list[float]]:
    """(median TTFT, median TPOT, percentiles of the step times, each run's median TPOT)
    in seconds over ``repeats`` runs after ``warmup``. Each run rotates the prompts by its
    index: the prefix cache would otherwise hand every run after the first its prompts'
    K/V, and TTFT would time one token's prefill."""
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    ttfts, itls, runs = [], [], []
    for run in range(warmup + repeats):
        seqs = [engine.add_request(p[run:] + p[:run], params) for p in prompts]
        while engine.has_unfinished():
            engine.step()
        if run >= warmup:
            ttfts.append(max(s.metrics.ttft for s in seqs))
            itl = full_batch_steps([s.metrics for s in seqs])
            if not itl:
                raise PlanError(
                    f"batch {len(seqs)} never decoded whole: its prompts took more steps to "
                    f"admit than the {new_tokens} new tokens last; give more new tokens "
                    f"(--new-tokens) or more prompt tokens a step (--max-num-batched-tokens, "
                    f"build's max_num_batched_tokens)")
            itls += itl[min(WARMUP_STEPS, len(itl) - 1):]
            runs.append(statistics.median(itl[min(WARMUP_STEPS, len(itl) - 1):]))
    return statistics.median(ttfts), statistics.median(itls), percentiles(itls), runs


def full_batch_steps(metrics) -> list[float]:
    """Step times (seconds) while the whole batch decodes: between the last sequence's
    first token and the first sequence's last one. A batch whose prompts are admitted
    over several steps has prefill chunks in its first sequences' early steps, and fewer
    rows in its last sequences' final ones; neither is a step of this batch size. A step
    stamps one time on every sequence it gives a token to."""
    start = max(m.first_token for m in metrics)
    end = min(m.token_times[-1] for m in metrics)
    times = [t for t in metrics[0].token_times if start <= t <= end]
    return [b - a for a, b in zip(times, times[1:])]


class _StepClock:
    """Stopping criterion that records a synchronised timestamp after every token."""

    def __init__(self, device):
        self.device, self.times = device, []

    def __call__(self, input_ids, scores, **kw):
        sync(self.device)
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def bench_hf(model, prompts, new_tokens: int, static: bool = False,
             warmup: int = 1, repeats: int = 3) -> tuple[float, float, dict]:
    """As ``bench_ours``, for HF ``generate`` (eager, or its static cache compiled)."""
    from transformers import StoppingCriteriaList

    device = next(model.parameters()).device
    ids = torch.tensor(prompts, device=device)
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
              attention_mask=torch.ones_like(ids), pad_token_id=0)
    if static:  # transformers compiles the static-cache forward (CUDA graphs) itself
        kw.update(cache_implementation="static")
    ttfts, itls, runs = [], [], []
    for run in range(warmup + repeats):
        clock = _StepClock(device)
        sync(device)
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, stopping_criteria=StoppingCriteriaList([clock]), **kw)
        if run >= warmup:
            t = clock.times
            ttfts.append(t[0] - start)
            steps = [b - a for a, b in zip(t[WARMUP_STEPS:], t[WARMUP_STEPS + 1:])]
            itls += steps
            runs.append(statistics.median(steps))
    return statistics.median(ttfts), statistics.median(itls), percentiles(itls), runs


def min_new_tokens(system: str) -> int:
    """Fewest new tokens that leave ``system`` a decode step to time: the first token comes
    from the prefill, then HF always leaves out WARMUP_STEPS steps; ours leaves them out
    only while a step remains (a batch admitted over several steps needs more, PlanError)."""
    return 2 if system == "infergraft" else WARMUP_STEPS + 2


def check_systems(systems, new_tokens: int, device) -> None:
    """PlanError, before anything is measured, for a system we cannot time here."""
    for system in systems:
        if system not in SYSTEMS:
            raise PlanError(f"unknown system {system!r} in --systems; choose from "
                            f"{', '.join(SYSTEMS)}")
        if system == "hf-static" and torch.device(device).type != "cuda":
            # transformers compiles the static cache on CUDA only: elsewhere the row would
            # be an uncompiled static cache under the compiled baseline's name
            raise PlanError(f"--systems hf-static needs a CUDA --device (transformers compiles "
                            f"its static cache on CUDA only), not {device}")
        need = min_new_tokens(system)
        if new_tokens < need:
            warmup = f", {WARMUP_STEPS} warm-up decode steps" if system != "infergraft" else ""
            raise PlanError(f"--new-tokens {new_tokens} is too few for {system}: its timing needs "
                            f"at least {need} (the prefill's token{warmup} and a decode step to "
                            f"take the median of)")


def run_benchmark(hf_model, engine, batches, prompt_len: int, new_tokens: int,
                  systems=("infergraft", "hf-eager"), bandwidth: Optional[float] = None,
                  log=print, roofline: Optional[Roofline] = None) -> tuple[list[Result], float]:
    """Measure every system at every batch size on the same weights; returns results and
    the measured copy bandwidth (bytes/s). ``engine`` None (HF's systems alone, measured
    after our engine was freed): each batch's floor from ``roofline``, that engine's."""
    device = engine.device if engine is not None else next(hf_model.parameters()).device
    check_systems(systems, new_tokens, device)
    bw = bandwidth or copy_bandwidth(device, nbytes=(1 << 30) if device.type == "cuda" else 1 << 28)
    log(f"copy bandwidth: {bw / 1e9:.1f} GB/s on {device}")
    roofline = roofline or Roofline.of(engine)
    results = []
    for b in batches:
        prompts = random_prompts(b, prompt_len, roofline.spec.vocab_size, seed=b)
        floor = roofline.seconds(b, prompt_len, new_tokens, bw)
        for system in systems:
            if system == "infergraft":
                ttft, tpot, spread, runs = bench_ours(engine, prompts, new_tokens)
            else:
                ttft, tpot, spread, runs = bench_hf(hf_model, prompts, new_tokens,
                                                    static=system == "hf-static")
            r = Result(system, b, ttft * 1e3, tpot * 1e3, floor * 1e3,
                       spread["p90"] * 1e3, spread["p99"] * 1e3, [t * 1e3 for t in runs])
            log(f"  batch {b:3d} {system:11s} TTFT {r.ttft_ms:8.2f} ms  TPOT {r.tpot_ms:8.3f} ms"
                f"  {r.tokens_per_s:9.1f} tok/s  roofline {r.roofline_fraction:5.1%}")
            results.append(r)
    return results, bw
