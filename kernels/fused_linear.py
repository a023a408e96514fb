"""Decode GEMMs fused with their neighbours (kernels/linear.py's skinny kernel with its
fusion flags on), for the decode layer at <= ``FUSE_MAX_ROWS`` (32) rows
(``DecoderLayer.forward_fused``), which runs no norm kernel at all:

- ``linear_residual``: x W^T + r (o and down: the residual stream's add); with
  ``sum_sq=True`` it also returns the new stream's sum of squares per row, as partial
  sums [P, M] float32 (one row per program: deterministic, no atomics, no zeroing).
- ``normed_linear``: rms_norm(x) W^T for a W whose columns already carry the norm weight
  (``DecoderModel.fold_norm_weights``): x W^T * rstd, rstd from those partial sums.
- ``normed_swiglu``: silu(n Wg^T) * (n Wu^T), n as above, on the fused gate_up weight
  [2I, K] (gate rows, then up rows): [M, I] out, no [M, 2I] intermediate.

Every fusion sits outside the GEMM's loop: x * g on the x operand inside it costs Triton
its software pipelining. GEMM follows GEMM here, so they let their dependents launch only
after their loop (``LATE_PDL_RELEASE``). The fused layer saves the norm kernels and the
residual adds' round trips (docs/kernels.md: both layers' step times). References and the
fallbacks (float32: exact cuBLAS; more rows than ``FUSE_MAX_ROWS``) compose torch ops.

Each takes 8-bit weight rows too (``Quantizer.scaled_rows``): q int8 (``quantize_int8``)
or float8_e4m3fn (``quantize_fp8``) [N, K] with ``scale`` [N] float32 per row, W =
q.float() * s[:, None]. The references compute that GEMM as ``int8_linear_torch`` /
``fp8_linear_torch`` do, the fallbacks with ``int8_linear_triton`` / ``fp8_linear_triton``.
Both take the same tiles (one byte a weight); one int8 row takes the word loop
(``gemv_dot_int8``), one e4m3 row the tensor-core tiles. ``mma=True`` (``INFERGRAFT_QUANT_MMA=1``,
bound by ``dispatch.get_ops``) reads the same tiles' 8-bit rows as int32 words widened by bit
tricks (``fp8_mma.dot_words``, ``WORDS``): the widening changes, never the grid (``plan``);
under ``auto``, byte tiles (``fp8_mma.rows_mma_chosen``).

An int4 weight (``Int4Weight``) goes to ``int4_fused_ops`` (its own kernel, ``int4_fused``),
its input norm's weight given as ``norm`` (not folded into the weight). ``counters``: the
split-K merges' ``paged_plan.CounterPool`` (int4; None: the shared one).
"""
import torch

from infergraft.core.spec import split_qkv

from . import int4_fused_ops as int4
from . import switches
from ._triton import HAVE_TRITON, next_pow2
from .fp8_linear import FP8, fp8_native
from .fp8_mma import rows_mma_chosen
from .int4_format import Int4Weight
from .gemv import gemv_config, gemv_kind, int8_gemv_config, takes_gemv, takes_int8_gemv
from .linear import SWAP_TILES, check_gemm, launch_gemm, skinny_config
from .rotary import qkv_rope_epilogue, rotary_kv_write_triton
from .silu_mul import silu_mul_torch
# the references (re-exported: the ops' torch side) and the helpers both sides share
from .fused_linear_ref import (_int4, _linear, _normed, _with_sum_sq,  # noqa: F401
                               linear_residual_torch, normed_linear_torch,
                               normed_qkv_rope_torch, normed_swiglu_torch)

# steps of up to this many tokens run the fused decode layer (the faster there: kernels.md)
FUSE_MAX_ROWS = switches.value("INFERGRAFT_FUSE_MAX_ROWS")


def _gemm(x, weight, bias, scale, mma=False):
    # the Triton entry points' GEMM where the fused kernel does not apply
    return _linear(x, weight, bias, scale, kernel=HAVE_TRITON, mma=mma)


def _fusable(x, weight, scale=None) -> bool:
    # 16-bit x with a weight of its dtype, or 8-bit rows with their scales (e4m3: where
    # Triton loads it, else the fallback's reference)
    if not (HAVE_TRITON and 0 < x.shape[0] <= FUSE_MAX_ROWS and x.dtype != torch.float32):
        return False
    if scale is None:
        return weight.dtype == x.dtype
    return weight.dtype == torch.int8 or (weight.dtype == FP8 and fp8_native(x.device))


def _row_dtype(weight, scale):
    # the dtype of 8-bit weight rows (a scale given), None for a 16-bit weight
    return None if scale is None else weight.dtype


def _tiles(config, default: dict, rows, kind: str, m: int, k: int, mma=False) -> dict:
    """The caller's tiles, else ``default`` (16-bit). ``rows``: the dtype of 8-bit weight
    rows (``_row_dtype``), None for 16-bit ones. An 8-bit tile carries half the bytes, so
    where the default's K tiles are short (<= 256) 8-bit ones are twice as long. One int8
    row takes the word loop (``takes_int8_gemv``) with the ``kind``'s tiles; e4m3 where its
    switch says. ``mma`` (``INFERGRAFT_QUANT_MMA``'s value): where ``rows_mma_chosen`` (True),
    the 8-bit tiles (not the word loop, which reads words already) with K a multiple of 4
    take ``WORDS``: the same tiles, W read as words and widened by bit tricks."""
    if config:
        return dict(config)
    if rows is not None and takes_int8_gemv(m, k, fp8=rows == torch.float8_e4m3fn):
        return int8_gemv_config(kind)
    cfg = dict(default)
    if rows is not None and default["BLOCK_K"] <= 256:
        cfg["BLOCK_K"] = 2 * default["BLOCK_K"]
    if rows is not None and rows_mma_chosen(mma) and k % 4 == 0:
        return words_tiles(cfg, paired=kind in ("swiglu", "qkv_rope"))
    return cfg


def words_tiles(cfg: dict, paired: bool = False) -> dict:
    """8-bit byte tiles -> the same tiles read as words (``WORDS``): the same columns and
    rows a program (so the same grid), shorter K steps with as many more stages as keep the
    bytes of W in flight (up to 8). The step: 256 bytes for one W tile (not ``paired``:
    SwiGLU, RoPE) against 16 rows, else 128 (fp8_mma's), the longest that compile for
    sm_90 without spilling (x split four ways and four widened planes of W a step;
    ``core/tools/kernel_bench/cubin.py``)."""
    step = 256 if cfg["BLOCK_M"] == 16 and not paired else 128
    more = max(1, cfg["BLOCK_K"] // step)
    return dict(cfg, BLOCK_K=min(cfg["BLOCK_K"], step),
                num_stages=min(8, cfg["num_stages"] * more), WORDS=True)


def plan(gemm: str, m: int, n: int, k: int, rows=None, mma=False, config=None, half=0):
    """(grid, tiles) of a fused GEMM's kernel: ``gemm`` "linear" (``normed_linear``,
    ``linear_residual``: [M, K] x [N, K]^T), "swiglu" (N = 2I gate | up rows) or "qkv_rope"
    (N = (Hq + 2 Hkv) D rows, ``half`` = D / 2); ``rows``, ``mma``, ``config`` as
    ``_tiles`` takes them. One program a column tile (a pair of them for SwiGLU, RoPE)."""
    gemv = rows is None
    if gemm == "swiglu":
        cfg = _tiles(config, swiglu_config(m, n // 2, k, gemv), rows, "swiglu", m, k, mma)
        return (-(-(n // 2) // cfg["BLOCK_N"]), 1), cfg
    if gemm == "qkv_rope":
        cfg = _tiles(config, qkv_rope_config(m, half, k, gemv), rows, "qkv_rope", m, k, mma)
        if cfg.get("GEMV") or cfg.get("WORDS"):
            cfg["BLOCK_N"] = min(cfg["BLOCK_N"], half)
        return (n // (2 * cfg["BLOCK_N"]), 1), cfg
    assert gemm == "linear", f"gemm must be linear, swiglu or qkv_rope, got {gemm!r}"
    cfg = _tiles(config, skinny_config(m, n, k, gemv), rows, gemv_kind(n, k), m, k, mma)
    return (-(-n // cfg["BLOCK_N"]), 1), cfg


def _output(x, weight, bias, scale, n_out):
    check_gemm(x, weight, bias, scale)
    return torch.empty((x.shape[0], n_out), dtype=x.dtype, device=x.device)


def _check_sum_sq(x, sum_sq):
    assert sum_sq.dim() == 2 and sum_sq.shape[1] == x.shape[0] and sum_sq.is_contiguous() \
        and sum_sq.dtype == torch.float32, \
        f"sum_sq must be contiguous float32 [P, {x.shape[0]}] partial sums, got " \
        f"{tuple(sum_sq.shape)} {sum_sq.dtype}"


def normed_linear_triton(x, weight, bias, sum_sq, eps, scale=None, config=None, mma=False,
                         norm=None, counters=None):
    _check_sum_sq(x, sum_sq)
    if _int4(weight, norm):
        return int4.normed_linear(x, weight, bias, sum_sq, eps, norm, True, mma, counters, config)
    if not _fusable(x, weight, scale):
        return _gemm(_normed(x, sum_sq, eps), weight, bias, scale, mma)
    m, k = x.shape
    n = weight.shape[0]
    y = _output(x, weight, bias, scale, n)
    grid, cfg = plan("linear", m, n, k, _row_dtype(weight, scale), mma, config)
    launch_gemm(grid, cfg, x, weight, bias, y, sum_sq=sum_sq,
                eps=eps, w_scale=scale)
    return y


def swiglu_config(m: int, i: int, k: int, gemv: bool = True) -> dict:
    """Two [BN, BK] weight tiles (gate and up) per step: at M <= 16 the bytes per stage of
    the unfused gate_up's [64, 128] tiles; above, twice as wide, so each column tile
    re-reads x from L2 half as often (docs/kernels.md)."""
    if takes_gemv(m, gemv):  # one row: kernels/gemv.py's register loop
        return gemv_config("swiglu")
    if gemv and SWAP_TILES and 16 < m <= 32:  # 16-bit weights: swapped W x^T tiles
        return dict(BLOCK_M=max(16, next_pow2(m)), BLOCK_N=64, BLOCK_K=64, num_warps=4,
                    num_stages=4, SWAP=True)
    return dict(BLOCK_M=max(16, next_pow2(m)), BLOCK_N=32 if m <= 16 else 64, BLOCK_K=128,
                num_warps=4, num_stages=3)


def normed_swiglu_triton(x, weight, bias, sum_sq, eps, scale=None, config=None, mma=False,
                         norm=None, counters=None):
    _check_sum_sq(x, sum_sq)
    if _int4(weight, norm):
        return int4.normed_swiglu(x, weight, bias, sum_sq, eps, norm, True, mma, counters, config)
    assert weight.shape[0] % 2 == 0, f"gate_up weight needs an even row count, got {weight.shape[0]}"
    if not _fusable(x, weight, scale):
        return silu_mul_torch(_gemm(_normed(x, sum_sq, eps), weight, bias, scale, mma))
    m, k = x.shape
    i = weight.shape[0] // 2
    y = _output(x, weight, bias, scale, i)
    grid, cfg = plan("swiglu", m, 2 * i, k, _row_dtype(weight, scale), mma, config)
    launch_gemm(grid, cfg, x, weight, bias, y, up_rows=i,
                sum_sq=sum_sq, eps=eps, w_scale=scale)
    return y


def linear_residual_triton(x, weight, bias, residual, sum_sq: bool = False, scale=None,
                           config=None, mma=False, counters=None):
    if isinstance(weight, Int4Weight):
        return int4.linear_residual(x, weight, bias, residual, sum_sq, True, mma, counters, config)
    m, k = x.shape
    n = weight.shape[0]
    assert residual.shape == (m, n) and residual.dtype == x.dtype and residual.stride(1) == 1, \
        f"residual must be [{m}, {n}] {x.dtype} with contiguous rows, got " \
        f"{tuple(residual.shape)} {residual.dtype}"
    if not _fusable(x, weight, scale):
        return _with_sum_sq(_gemm(x, weight, bias, scale, mma) + residual, sum_sq)
    y = _output(x, weight, bias, scale, n)
    grid, cfg = plan("linear", m, n, k, _row_dtype(weight, scale), mma, config)
    parts = torch.empty((grid[0], m), dtype=torch.float32, device=x.device) if sum_sq else None
    launch_gemm(grid, cfg, x, weight, bias, y, residual=residual, sum_sq_out=parts,
                w_scale=scale)
    return (y, parts) if sum_sq else y


# up to this many rows the qkv GEMM rotates and writes K/V itself, one kernel (and one
# launch) fewer a layer than normed_linear + rotary_kv_write. Past UNSWAPPED_ROPE_MAX_ROWS
# only on the swapped tiles (16-bit weights): on unswapped ones the fused GEMM is slower
# there than the two kernels it replaces (docs/kernels.md)
QKV_ROPE_MAX_ROWS = switches.value("INFERGRAFT_QKV_ROPE_MAX_ROWS")
UNSWAPPED_ROPE_MAX_ROWS = 16
ROPE_SWAP_TILES = switches.value("INFERGRAFT_ROPE_SWAP")


def qkv_rope_config(m: int, half: int, k: int, gemv: bool = True) -> dict:
    """Two [BN, BK] tiles a step (dims and their rotate-half partners); 16-bit weights take
    swapped 64-wide tiles, 8-bit ones unswapped 32-wide tiles: each the best of an
    in-model comparison of tiles (int8's; docs/kernels.md)."""
    if takes_gemv(m, gemv):  # one row: kernels/gemv.py's register loop
        cfg = gemv_config("qkv_rope")
        return dict(cfg, BLOCK_N=min(cfg["BLOCK_N"], half))
    if gemv and ROPE_SWAP_TILES:
        return dict(BLOCK_M=max(16, next_pow2(m)), BLOCK_N=min(64, half), BLOCK_K=128,
                    num_warps=4, num_stages=4, SWAP=True)
    return dict(BLOCK_M=max(16, next_pow2(m)), BLOCK_N=min(32, half), BLOCK_K=128, num_warps=4,
                num_stages=4)  # unswapped: <= UNSWAPPED_ROPE_MAX_ROWS rows only


def normed_qkv_rope_triton(x, weight, bias, sum_sq, eps, cos, sin, positions, num_heads,
                           k_cache, v_cache, idx0, idx1, scale=None, config=None, mma=False,
                           norm=None, counters=None):
    """Same contract as ``normed_qkv_rope_torch``; one GEMM whose epilogue rotates and
    stores q, k and v where it applies (<= ``QKV_ROPE_MAX_ROWS`` rows on swapped tiles,
    else <= ``UNSWAPPED_ROPE_MAX_ROWS``; all of every head rotated, D / 2 a multiple of
    the tiles' BLOCK_N, a power of two >= 16), else ``normed_linear`` + ``rotary_kv_write``."""
    _check_sum_sq(x, sum_sq)
    if _int4(weight, norm):
        return int4.normed_qkv_rope(x, weight, bias, sum_sq, eps, cos, sin, positions,
                                    num_heads, k_cache, v_cache, idx0, idx1, norm, True, mma,
                                    counters, config)
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    half = cos.shape[1]
    assert weight.shape[0] == (num_heads + 2 * hkv) * d, \
        f"qkv weight has {weight.shape[0]} rows, not (Hq={num_heads} + 2 Hkv={hkv}) x D={d}"
    grid, cfg = plan("qkv_rope", x.shape[0], weight.shape[0], x.shape[1],
                     _row_dtype(weight, scale), mma, config, half)
    max_rows = QKV_ROPE_MAX_ROWS if cfg.get("SWAP") else min(QKV_ROPE_MAX_ROWS,
                                                              UNSWAPPED_ROPE_MAX_ROWS)
    # the epilogue pairs each tile of dims with its rotate-half partners: a tile must be a
    # power of two (tl.arange) dividing half a head (a head of 96 has none >= 16)
    bn = cfg["BLOCK_N"]
    if not (_fusable(x, weight, scale) and x.shape[0] <= max_rows and 2 * half == d
            and half % bn == 0 and bn >= 16 and bn & (bn - 1) == 0
            and k_cache.dtype == v_cache.dtype == x.dtype and k_cache.stride() == v_cache.stride()):
        qkv = normed_linear_triton(x, weight, bias, sum_sq, eps, scale, mma=mma)
        q, k, v = split_qkv(qkv, num_heads, hkv, d)
        return rotary_kv_write_triton(q, k, v, cos, sin, positions, k_cache, v_cache, idx0, idx1)
    m = x.shape[0]
    check_gemm(x, weight, bias, scale)
    q = torch.empty((m, num_heads * d), dtype=x.dtype, device=x.device)
    rope = qkv_rope_epilogue(q, num_heads, cos, sin, positions, k_cache, v_cache, idx0, idx1)
    launch_gemm(grid, cfg, x, weight, bias, q,
                sum_sq=sum_sq, eps=eps, up_rows=half, rope=rope, w_scale=scale)
    return q.view(m, num_heads, d)
