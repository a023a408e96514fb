"""Launch planning for ``paged_attention_triton``: the split count (from shapes only),
warps and stages, and the counters of the fused combine (``CounterPool``)."""
from __future__ import annotations

import functools

import torch

from ._triton import next_pow2
from .kv_write import QUANT_KV_DTYPES


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


#: the automatic split count aims for at least this many programs per SM (a few resident
#: per SM hide memory latency; more, smaller programs shrink the last wave's tail)
PROGRAMS_PER_SM = 8
#: ... unless (sequence, kv head) pairs alone give this many per SM: then the GPU is full
#: without splits, and a split only adds the partials' writes and their merge
UNSPLIT_PER_SM = 4


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the CPU interpreter: small, so tests exercise splitting


def _longest_span(max_tokens: int, window: int | None) -> int:
    """Keys a query sees at most: the window, at most the table's width, or the width."""
    return max(1, min(window, max_tokens) if window else max_tokens)


def split_plan(bsz: int, hkv: int, max_tokens: int, window: int | None, sms: int,
               block_n: int, num_splits: int | None = None) -> int:
    """S, the number of splits of the sequence axis (``num_splits`` when given).

    From shapes only, never from context_lens: the call is captured into a CUDA graph once
    per batch size and replayed with other lengths. S is sized for the longest span (the
    window, at most the table's width, or the table's width) with splits no shorter than
    a tile and none empty at that span; the kernel then splits each sequence's actual
    visible keys in S (``split_len``)."""
    if num_splits is not None:
        return num_splits  # forced: kept even where some splits get no keys
    if bsz * hkv >= UNSPLIT_PER_SM * sms:
        return 1
    tiles = _cdiv(_longest_span(max_tokens, window), block_n)
    want = _cdiv(PROGRAMS_PER_SM * sms, max(1, bsz * hkv))
    per = _cdiv(tiles, max(1, min(want, tiles)))  # tiles per split at the longest span
    return _cdiv(tiles, per)  # drop splits that the longest span leaves empty


#: Mid-sized steps, (sequence, kv head) pairs from ``r`` x the SM count up: (splits, keys per
#: tile, warps, stages), each about two full waves of programs (1 to 3 resident per SM),
#: the best of a tile grid (``bench.attention --grid``); below 1.5 x SMs the
#: ``split_plan`` rule, already close to that grid's best there (docs/kernels.md)
MID_PLANS = ((1.5, (1, 128, 8, 2)), (2.5, (2, 32, 2, 4)), (3.4, (1, 64, 4, 3)))
#: ... and with one query head per kv head (MHA), whose best tiles of the same grid differ
#: (GQA's tiles are slower here)
MID_PLANS_MHA = ((1.5, (2, 64, 4, 2)), (2.5, (1, 64, 4, 2)), (3.4, (1, 64, 4, 3)))
#: Large GQA steps, from ``r`` x SMs pairs up: unsplit 64-key tiles instead of 32-key ones
#: with 2 warps (below ``r`` x SMs the 2-warp tiles stay faster). MHA keeps the 2-warp
#: tiles, which are the faster for it (docs/kernels.md)
LARGE_PLAN_GQA = (7.5, (1, 64, 4, 2))


def launch_plan(bsz: int, hkv: int, max_tokens: int, window: int | None, sms: int, *,
                group: int, wide_tiles: bool, kv_bytes: int = 2, num_splits: int | None = None,
                block_n: int | None = None, num_warps: int | None = None,
                num_stages: int | None = None):
    """(S, keys per tile, warps and stages) of one decode-attention call, from shapes
    only. ``group``: query heads per kv head. ``wide_tiles``: 16-bit K/V (or 8-bit K/V
    widened as ``kv8.py``'s modes besides ``cvt``) with head_dim <= 128, where the
    ``MID_PLANS`` / ``LARGE_PLAN_GQA`` tiles fit in shared memory and were tuned; with
    ``kv_bytes`` = 1 (8-bit K/V) their tiles hold twice the keys, the same bytes in flight.
    A given ``num_splits`` or ``block_n`` keeps the ``split_plan`` rule."""
    row = _measured_plan(bsz * hkv, sms, group) \
        if wide_tiles and num_splits is None and block_n is None else None
    if row:
        s, bn, warps, stages = row
        bn = bn * 2 // kv_bytes
        return (min(s, _cdiv(_longest_span(max_tokens, window), bn)), bn,
                dict(num_warps=num_warps or warps, num_stages=num_stages or stages))
    bn = block_n or 32
    s = split_plan(bsz, hkv, max_tokens, window, sms, bn, num_splits)
    return s, bn, tile_config(s, num_warps, num_stages)


def _measured_plan(pairs: int, sms: int, group: int):
    """The ``MID_PLANS`` / ``LARGE_PLAN_GQA`` row (S, keys, warps, stages) for this many
    (sequence, kv head) pairs, or None where the ``split_plan`` rule stands."""
    if pairs < UNSPLIT_PER_SM * sms:
        mid = [plan for lo, plan in (MID_PLANS_MHA if group == 1 else MID_PLANS)
               if pairs >= lo * sms]
        return mid[-1] if mid else None
    lo, plan = LARGE_PLAN_GQA
    return plan if group > 1 and pairs >= lo * sms else None


def split_len(visible: int, nsplit: int, block_n: int) -> int:
    """Keys per split (whole tiles) for ``visible`` keys in ``nsplit`` splits: the kernel's
    own computation, for benchmarks and tests."""
    return _cdiv(_cdiv(visible, nsplit), block_n) * block_n


def _capturing() -> bool:
    try:
        return torch.cuda.is_current_stream_capturing()
    except (RuntimeError, AssertionError):  # torch without CUDA
        return False


class CounterPool:
    """int32 counters, zero between calls (each call sets its own back to 0), for kernels
    whose last program to finish merges the others' work: decode attention's split merge
    and ``logits_argmax``'s split. Calls drawing on one pool must not overlap, so an engine
    owns its pools (its cache's, its model's): engines replaying graphs on other streams
    never share a counter. ``SHARED_COUNTERS`` serves callers that bring none."""

    def __init__(self):
        self._buffers: dict[torch.device, torch.Tensor] = {}
        self._retired: list[torch.Tensor] = []  # outgrown buffers: captured graphs may use them

    def get(self, device: torch.device, n: int) -> torch.Tensor | None:
        """At least n counters on ``device``, or None where the buffer would have to grow
        inside a CUDA graph capture (a fresh one must be zeroed outside the graph and
        outlive it): the caller then merges another way."""
        buf = self._buffers.get(device)
        if buf is not None and buf.numel() >= n:
            return buf
        if _capturing():
            return None
        if buf is not None:
            self._retired.append(buf)
        buf = self._buffers[device] = torch.zeros(max(1024, next_pow2(n)), dtype=torch.int32,
                                                  device=device)
        return buf


SHARED_COUNTERS = CounterPool()


def counters_for(counters: CounterPool | None, device: torch.device, n: int):
    """``CounterPool.get`` on the caller's pool, or on ``SHARED_COUNTERS`` if it brings none."""
    return (counters or SHARED_COUNTERS).get(device, n)


def tile_config(nsplit: int, num_warps: int | None, num_stages: int | None) -> dict:
    """Warps and pipeline depth, from a sweep (bf16, D=128, 544-token context,
    ``python -m infergraft.core.tools.kernel_bench.attention --wide``): with 32-key tiles,
    many short programs (split sequences, small batch) like 4 warps and 2 stages; one long
    program per (sequence, head) (S = 1, large batch) likes 2 warps and 4 stages, which keep
    more loads in flight along its keys (docs/kernels.md)."""
    warps, stages = (4, 2) if nsplit > 1 else (2, 4)
    return dict(num_warps=num_warps or warps, num_stages=num_stages or stages)


def check_cache_args(q, k_cache, v_cache, k_scale, v_scale) -> bool:
    """The paged K/V arguments against q ([rows, Hq, D]): shapes and dtypes (16-bit or
    float32 K/V of q's dtype, or int8 / e4m3 with float32 scales [NB, BS, Hkv]); True for
    quantised K/V. Shared by the decode and the varlen attention launchers."""
    _, hq, d = q.shape
    assert q.dtype in (torch.float32, torch.float16, torch.bfloat16), f"q dtype {q.dtype}"
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, \
        f"k_cache and v_cache must both be [NB, BS, Hkv, D], got {tuple(k_cache.shape)} " \
        f"and {tuple(v_cache.shape)}"
    nb, bs, hkv, dk = k_cache.shape
    assert dk == d, f"q head_dim {d} != cache head_dim {dk}"
    assert hkv >= 1 and hq % hkv == 0, f"Hq={hq} is not a multiple of Hkv={hkv}"
    quant = k_cache.dtype in QUANT_KV_DTYPES
    if quant:
        assert v_cache.dtype == k_cache.dtype, \
            f"k_cache is {k_cache.dtype} but v_cache is {v_cache.dtype}"
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            assert s is not None and s.shape == (nb, bs, hkv) and s.dtype == torch.float32, \
                f"{k_cache.dtype} K/V need {name} float32 [{nb}, {bs}, {hkv}], got " \
                f"{None if s is None else (tuple(s.shape), s.dtype)}"
    else:
        assert k_cache.dtype == v_cache.dtype == q.dtype, \
            f"cache dtype {k_cache.dtype}/{v_cache.dtype} must equal q dtype {q.dtype} " \
            "(or be int8 / float8_e4m3fn with scales)"
        assert k_scale is None and v_scale is None, "scales are only for int8 / e4m3 K/V"
    return quant
