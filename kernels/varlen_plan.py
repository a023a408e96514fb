"""Launch planning for ``varlen_attention``: the arguments' checks, the query tiles, key
tiles, warps, stages and split count of one mixed step, all from shapes only (the call is
captured into CUDA graphs and replayed with other ``cu_seqlens_q`` / ``context_lens``)."""
from __future__ import annotations

import torch

from ._triton import next_pow2
from .paged_plan import _cdiv, check_cache_args, launch_plan

#: tokens per sequence (T / B) up to which a step counts as decode-heavy and takes the
#: decode kernel's 16-row tile and its measured plan (``paged_plan.launch_plan``)
DECODE_TOKENS_PER_SEQ = 2
#: rows of the longer sequences' tiles (prompts, chunks) beside the short ones
LONG_M = 64
#: their keys per tile, warps and stages by rows, with 16-bit q and head_dim <= 128 (the
#: best of ``bench.varlen --sweep`` at 64 rows; 128 rows: the best 8-warp tile there);
#: others take 32 keys, 4 warps, 2 stages
LONG_TILES = {64: (64, 4, 2), 128: (64, 8, 2)}


def tile_counts(num_tokens: int, num_seqs: int, block_q: int, short: bool = False
                ) -> tuple[int, int]:
    """(programs along the grid's first axis, query tiles that can hold tokens at most).
    Sequence b's tiles start at ``cu[b] // block_q + b``, so ``cdiv(T, block_q) + B``
    tiles cover any split of T tokens over B sequences, and the padding rows after
    ``cu[B]``; no more than T of them hold a token. ``short``: B programs more, one per
    sequence, for the short sequences' tiles."""
    grid = _cdiv(num_tokens, block_q) + num_seqs
    return grid + (num_seqs if short else 0), max(1, min(num_tokens, grid))


def varlen_plan(num_tokens: int, num_seqs: int, hkv: int, group: int, max_tokens: int,
                window: int | None, sms: int, *, head_dim: int, elem_bytes: int, quant: bool,
                widen: bool = False, num_splits: int | None = None, block_m: int | None = None,
                block_n: int | None = None, num_warps: int | None = None,
                num_stages: int | None = None) -> dict:
    """The launch of one step of ``num_tokens`` query rows (T) over ``num_seqs`` sequences
    (B): ``block_m`` rows of the dot tile (``block_q`` = block_m // group tokens x the
    ``group`` query heads of one kv head), ``block_n`` keys per tile, ``short_m`` /
    ``short_q`` / ``short_n`` the short sequences' tiles (0: none), ``nsplit`` splits of
    each tile's keys, and the launch ``tune`` (warps, stages). ``widen``: 8-bit K/V under
    one of ``kv8.py``'s modes besides ``cvt``, whose decode tiles are 16-bit K/V's with
    twice the keys (the same bytes). Measured on one H200 by
    ``python -m infergraft.core.tools.kernel_bench.varlen --sweep`` (docs/kernels.md).

    - Decode-heavy, T <= ``DECODE_TOKENS_PER_SEQ`` x B: one tile for all, 16 rows (one
      token's query heads, as the decode kernel's), and S, keys, warps, stages from
      ``paged_plan.launch_plan`` with the tiles that can hold tokens as its (sequence,
      kv head) pairs: few long decodes split their keys (flash-decoding).
    - Otherwise two tiles in the one launch: sequences of up to ``short_q`` tokens (decode
      tokens) take that 16-row tile (64 keys with 16-bit K/V and head_dim <= 128, else
      32), the longer ones ``LONG_M`` = 64 rows with ``LONG_TILES``' keys, warps and
      stages: decode tokens in 64-row tiles would multiply their tile's work by 4 to 16,
      and short prompts in 16-row ones re-read their keys as often. Unsplit (S x T x Hq
      partials would cost more than a prompt's attention) unless ``num_splits`` forces S.

    A tile's keys span at most the window plus its block_q - 1 earlier queries."""
    assert block_m is None or (block_m >= 16 and block_m & (block_m - 1) == 0), \
        f"block_m {block_m} must be a power of 2 >= 16"
    assert block_m is None or block_m >= group, \
        f"block_m {block_m} holds fewer rows than the {group} query heads of a kv head"
    assert block_n is None or (block_n >= 16 and block_n & (block_n - 1) == 0), \
        f"block_n {block_n} must be a power of 2 >= 16"
    assert num_splits is None or (isinstance(num_splits, int) and num_splits >= 1), \
        f"num_splits {num_splits!r}"
    floor = max(16, next_pow2(group))
    wide = (not quant or widen) and elem_bytes == 2 and head_dim <= 128  # 16-bit, D <= 128
    if num_tokens <= DECODE_TOKENS_PER_SEQ * num_seqs:
        block_m = block_m or floor
        block_q = block_m // group
        busy = tile_counts(num_tokens, num_seqs, block_q)[1]
        nsplit, bn, tune = launch_plan(
            busy, hkv, max_tokens, window + block_q - 1 if window else None, sms, group=group,
            wide_tiles=wide and block_m == floor, kv_bytes=1 if quant else 2, num_splits=num_splits, block_n=block_n,
            num_warps=num_warps, num_stages=num_stages)
        return dict(block_m=block_m, block_q=block_q, block_n=bn, short_m=0, short_q=0,
                    short_n=0, nsplit=nsplit, tune=tune)
    block_m = block_m or max(floor, LONG_M)
    wide = elem_bytes == 2 and head_dim <= 128  # 16-bit q (K/V 16-bit or int8)
    bn, warps, stages = LONG_TILES[block_m] if block_m in LONG_TILES and wide else (32, 4, 2)
    return dict(block_m=block_m, block_q=block_m // group, block_n=block_n or bn,
                short_m=floor, short_q=floor // group, short_n=64 if wide else 32,
                nsplit=num_splits or 1,
                tune=dict(num_warps=num_warps or warps, num_stages=num_stages or stages))


def check_args(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, window,
               k_scale, v_scale) -> bool:
    """The arguments' shapes, dtypes and devices (never values: the Triton path runs in
    CUDA graphs); True for int8 K/V."""
    assert q.dim() == 3, f"q must be [T, Hq, D], got {tuple(q.shape)}"
    quant = check_cache_args(q, k_cache, v_cache, k_scale, v_scale)
    assert block_tables.dim() == 2 and block_tables.dtype in (torch.int32, torch.int64), \
        f"block_tables must be int32/int64 [B, max_blocks], got {tuple(block_tables.shape)} " \
        f"{block_tables.dtype}"
    bsz = block_tables.shape[0]
    assert cu_seqlens_q.shape == (bsz + 1,) and cu_seqlens_q.dtype == torch.int32, \
        f"cu_seqlens_q must be int32 [{bsz + 1}] (B + 1 for {bsz} block-table rows), got " \
        f"{tuple(cu_seqlens_q.shape)} {cu_seqlens_q.dtype}"
    assert context_lens.shape == (bsz,) and context_lens.dtype in (torch.int32, torch.int64), \
        f"context_lens must be int32/int64 [{bsz}], got {tuple(context_lens.shape)} " \
        f"{context_lens.dtype}"
    assert window is None or (isinstance(window, int) and window >= 1), f"window {window!r}"
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        assert x.stride(-1) == 1, f"{name} must be contiguous in its last dim, strides {x.stride()}"
    others = [("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables),
              ("cu_seqlens_q", cu_seqlens_q), ("context_lens", context_lens)] \
        + ([("k_scale", k_scale), ("v_scale", v_scale)] if quant else [])
    for name, x in others:
        assert x.device == q.device, f"{name} on {x.device} but q on {q.device}"
    return quant
