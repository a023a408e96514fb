"""Preemption by swap or by recompute, whichever costs less.

When no running sequence fits the cache the scheduler preempts the newest one, one of two
ways:

- **swap**: its K/V blocks go to host memory now and come back when there is room:
  ``2 x bytes`` over the host link, at the rate the cache's own swap copies ran so far
  (``swap_seconds``: a layer and pool at a time, launches and waits included), and before
  the first at the rate measured once per device (a pinned host -> device copy and back,
  32 MiB each way, timed by CUDA events; on the CPU a memcpy);
- **recompute**: its cache is freed and its tokens are prefilled again: the FLOPs of a
  prefill of the tokens it had computed (2 a weight for each through the layers, plus
  attention's causal triangle, counted as ``tools/throughput_report.py`` counts them) at
  the matmul rate measured once per device and dtype (an n x n x n matmul).

``preemption="auto"`` (``core.build``'s default) takes the cheaper; "swap" swaps wherever
the cache can; "recompute" never swaps. A cache without swap (``KVCache.supports_swap``),
or without host room for the sequence, recomputes. Both estimates are floors: a prefill
of a few tokens runs below the peak matmul rate. Recompute counts only the tokens past the
sequence's blocks the prefix cache holds (``cached_tokens``): they come back as a hit unless
evicted first (the H200 run where "auto" swapped them measured recompute 11% faster).
"""
from __future__ import annotations

import math
import time

import attrs
import torch

from .errors import PlanError

MODES = ("auto", "swap", "recompute")
LINK_BYTES = 32 << 20  # the measured copy, each way
MATMUL_N = {"cuda": 2048, "cpu": 256}  # the measured matmul's size


def check_mode(mode) -> str:
    if mode not in MODES:
        raise PlanError(f"preemption must be one of {', '.join(map(repr, MODES))} (\"auto\": "
                        f"swap or recompute, whichever costs less), got {mode!r}")
    return mode


@attrs.frozen
class Rates:
    link_bytes_per_s: float  # host <-> device, each way
    flops_per_s: float  # matmul, in the model's dtype


_MEASURED: dict = {}  # (device, dtype) -> Rates: measured once a process


def measured_rates(device, dtype) -> Rates:
    """The host link's and the matmul's rates on ``device`` (measured at the first call)."""
    device = torch.device(device)
    key = (str(device), str(dtype))
    if key not in _MEASURED:
        _MEASURED[key] = Rates(_link_rate(device), _matmul_rate(device, dtype))
    return _MEASURED[key]


def _best_seconds(device, fn, repeats: int = 3) -> float:
    fn()  # warm up
    best = math.inf
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            best = min(best, a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
    return max(best, 1e-9)


def _link_rate(device) -> float:
    cuda = device.type == "cuda"
    host = torch.empty(LINK_BYTES, dtype=torch.uint8, pin_memory=cuda).fill_(1)
    dev = torch.empty(LINK_BYTES, dtype=torch.uint8, device=device)
    there = _best_seconds(device, lambda: dev.copy_(host, non_blocking=cuda))
    back = _best_seconds(device, lambda: host.copy_(dev, non_blocking=cuda))
    return 2 * LINK_BYTES / (there + back)


def _matmul_rate(device, dtype) -> float:
    n = MATMUL_N["cuda" if device.type == "cuda" else "cpu"]
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    return 2 * n ** 3 / _best_seconds(device, lambda: torch.matmul(a, b, out=out))


def recompute_flops(spec, tokens: int) -> float:
    """FLOPs of prefilling ``tokens`` tokens again: the layers' matmuls and attention."""
    h, q, kv, i = spec.hidden_size, spec.q_size, spec.kv_size, spec.intermediate_size
    layer_weights = h * (q + 2 * kv) + q * h + h * i * (3 if spec.gated_mlp else 2)
    keys = 0  # over the layers, each its own window: a position attends min(pos + 1, W)
    for n in range(spec.num_layers):
        w = min(tokens, spec.layer_attention(n).window or tokens)
        keys += w * (w + 1) // 2 + (tokens - w) * w
    return 2.0 * (spec.num_layers * layer_weights * tokens + 2 * q * keys)


class PreemptionPolicy:
    """How the scheduler preempts a sequence: ``choose(cache, seq)`` -> "swap" or
    "recompute". ``rates``: the measured ones by default (at the first choice that needs
    them); tests give their own."""

    def __init__(self, mode: str = "recompute", spec=None, device="cpu",
                 dtype=torch.float32, rates: Rates | None = None):
        self.mode = check_mode(mode)
        if mode == "auto" and spec is None:
            raise ValueError("preemption 'auto' weighs recompute by the model's shapes: "
                             "give spec=")
        self.spec, self.device, self.dtype, self._rates = spec, device, dtype, rates

    @property
    def rates(self) -> Rates:
        if self._rates is None:
            self._rates = measured_rates(self.device, self.dtype)
        return self._rates

    def costs(self, cache, seq) -> tuple[float, float]:
        """(seconds to swap ``seq`` out and back in, seconds to prefill it again)."""
        r, n = self.rates, seq.num_computed_tokens
        # the leading blocks the prefix cache keeps (until evicted) are not computed again
        cached = min(n, getattr(cache, "cached_tokens", lambda _: 0)(seq.id))
        swap = getattr(cache, "swap_seconds", lambda _: None)(seq.id)  # as its copies ran
        return (2 * cache.swap_bytes(seq.id) / r.link_bytes_per_s if swap is None else swap,
                (recompute_flops(self.spec, n) - recompute_flops(self.spec, cached))
                / r.flops_per_s)

    def choose(self, cache, seq) -> str:
        if self.mode == "recompute" or not getattr(cache, "supports_swap", False) \
                or not cache.can_swap_out(seq.id):
            return "recompute"
        if self.mode == "swap":
            return "swap"
        swap, recompute = self.costs(cache, seq)
        return "swap" if swap < recompute else "recompute"


def policy_for(mode, spec, device, dtype, processes: int = 1) -> PreemptionPolicy:
    """``core.build``'s policy. Across processes every rank must preempt alike, and the
    rates each would measure differ: there "auto" recomputes and "swap" is refused."""
    check_mode(mode)
    if processes > 1 and mode == "swap":
        raise PlanError("preemption=\"swap\" runs in one process; across processes (torchrun) "
                        "give \"auto\" or \"recompute\" (both recompute there)")
    if processes > 1:
        mode = "recompute"
    return PreemptionPolicy(mode, spec, device, dtype)
