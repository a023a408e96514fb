"""kernels/fp8_mma.py (the 8-bit rows' decode GEMM on the tensor cores, bytes widened by
integer ops) against fp8_linear_torch / int8_linear_torch: fresh random weights and inputs
(subnormal e4m3 codes, int8's -127..127), odd shapes, split K fixed up in the kernel and
by the reduce kernel."""
import pytest
import torch

from infergraft.kernels.fp8_linear import fp8_linear_torch, quantize_fp8
from infergraft.kernels.fp8_mma import (fp8_mma, fp8_mma_config, int8_mma, rows_mma,
                                        takes_fp8_mma)
from infergraft.kernels.int8_linear import int8_linear_torch, quantize_int8
from infergraft.kernels.paged_plan import CounterPool

from .test_int4_mma import GRID, _NoCounters, _randn
from .tolerances import TOLERANCES

# (M, N, K): one row; odd N; K not a multiple of the 128-byte tile; 17 rows; 64 rows
SHAPES = [(1, 64, 256), (1, 130, 1024), (3, 96, 580), (17, 64, 384), (64, 40, 128)]


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("dev,dtype", GRID)
def test_fp8_mma_matches_reference(dev, dtype, gen, poisoned_empty, m, n, k):
    randn = _randn(gen, dev)
    x = randn(m, k, dtype=dtype)
    w = randn(n, k) / k ** 0.5
    w[:, ::7] *= 3e-3  # tiny weights: e4m3 subnormals (below 2^-6) after the row scale
    w[:, 1::7] *= 3e-4
    q, scale = quantize_fp8(w)
    codes = q.view(torch.uint8) & 0x7F
    assert bool(((codes > 0) & (codes < 8)).any())  # some subnormal codes
    b = randn(n, dtype=dtype) if m % 2 else None
    ref = fp8_linear_torch(x, q, scale, b)
    bm = fp8_mma_config(m, n, k)["BLOCK_M"]
    small = dict(BLOCK_N=32, BLOCK_M=bm, num_warps=4, num_stages=2)
    asm = [False, True] if x.is_cuda else [False]
    for config, counters in ((dict(small, SPLIT=1), None), (dict(small, SPLIT=3), CounterPool()),
                             (dict(small, SPLIT=3), _NoCounters()), (None, None)):
        for use_asm in asm:
            out = fp8_mma(x, q, scale, b, config=config, counters=counters, asm=use_asm)
            assert out.shape == (m, n) and out.dtype == dtype
            torch.testing.assert_close(out, ref, **TOLERANCES[dtype],
                                       msg=lambda e: f"{config} asm={use_asm}\n{e}")


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("dev,dtype", GRID)
def test_int8_rows_match_the_reference(dev, dtype, gen, poisoned_empty, m, n, k):
    """The same kernel on int8 rows (each byte widened by its sign: -127..127, and -128,
    which no quantiser writes but the widening must keep)."""
    randn = _randn(gen, dev)
    x = randn(m, k, dtype=dtype)
    q, scale = quantize_int8(randn(n, k) / k ** 0.5)
    q[0, :4] = torch.tensor([-128, -127, 127, 0], dtype=torch.int8)
    b = randn(n, dtype=dtype) if m % 2 else None
    ref = int8_linear_torch(x.float(), q, scale, None if b is None else b.float()).to(dtype)
    bm = fp8_mma_config(m, n, k)["BLOCK_M"]
    small = dict(BLOCK_N=32, BLOCK_M=bm, num_warps=4, num_stages=2)
    for config, counters in ((dict(small, SPLIT=1), None), (dict(small, SPLIT=3), CounterPool()),
                             (None, None)):
        for use_asm in ([False, True] if x.is_cuda else [False]):
            out = int8_mma(x, q, scale, b, config=config, counters=counters, asm=use_asm)
            assert out.shape == (m, n) and out.dtype == dtype
            torch.testing.assert_close(out, ref, **TOLERANCES[dtype],
                                       msg=lambda e: f"{config} asm={use_asm}\n{e}")


def test_each_entry_takes_its_own_row_format_only():
    x = torch.zeros(1, 256, dtype=torch.float16)
    q8, s = quantize_int8(torch.randn(8, 256))
    with pytest.raises(AssertionError, match="fp8_mma takes e4m3 rows, got torch.int8"):
        fp8_mma(x, q8, s)
    with pytest.raises(AssertionError, match="int8_mma takes int8 rows, got torch.float8_e4m3fn"):
        int8_mma(x, quantize_fp8(torch.randn(8, 256))[0], s)
    with pytest.raises(AssertionError, match=r"e4m3 or int8; got .* torch.float16"):
        rows_mma(x, q8.half(), s)


def test_takes_fp8_mma_only_what_it_computes():
    x = torch.zeros(1, 256, dtype=torch.bfloat16)
    assert takes_fp8_mma(x, 256)
    assert not takes_fp8_mma(torch.zeros(1, 258, dtype=torch.bfloat16), 258)  # K % 4
    assert not takes_fp8_mma(x.float(), 256)
    assert not takes_fp8_mma(torch.zeros(65, 256, dtype=torch.bfloat16), 256)
