"""kernels/int4_mma.py (the int4-g128 decode GEMM on the tensor cores) against
int4_linear_torch: fresh random weights and inputs, odd shapes, split K fixed up in the
kernel and by the reduce kernel, the nibbles by inline assembly (CUDA) and by shifts."""
import pytest
import torch

from infergraft.kernels.int4_linear import int4_linear_torch, quantize_int4
from infergraft.kernels.int4_mma import int4_mma, mma_config, takes_mma
from infergraft.kernels.paged_plan import CounterPool

from .conftest import DEVICES
from .tolerances import TOLERANCES

# 16-bit x only (float32 stays on int4_linear's IEEE path); bf16 on CUDA only (the CPU
# interpreter's bf16 is not the GPU's: conftest.NEVER)
GRID = [pytest.param(dev, dt, id=f"{dev}-{tag}", marks=DEVICES[dev])
        for dev, dt, tag in (("cpu", torch.float16, "fp16"), ("cuda", torch.float16, "fp16"),
                             ("cuda", torch.bfloat16, "bf16"))]


def _randn(gen, dev):
    return lambda *shape, dtype=torch.float32: \
        torch.randn(*shape, generator=gen).to(device=dev, dtype=dtype)

# (M, N, K): one row; odd N (a partial tile of W's rows); K with a partial last group
# (576 = 4.5 groups); 17 rows (x padded to 32); the most rows it takes
SHAPES = [(1, 64, 256), (1, 130, 1024), (3, 96, 576), (17, 64, 384), (64, 40, 128)]


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("dev,dtype", GRID)
def test_int4_mma_matches_reference(dev, dtype, gen, poisoned_empty, m, n, k):
    randn = _randn(gen, dev)
    x = randn(m, k, dtype=dtype)
    p = quantize_int4(randn(n, k) / k ** 0.5, 128)
    b = randn(n, dtype=dtype) if m % 2 else None
    args = (p.qweight, p.scales, p.zeros, 128, k)
    ref = int4_linear_torch(x, *args, bias=b)
    bm = mma_config(m, n, k)["BLOCK_M"]
    small = dict(BLOCK_N=32, BLOCK_M=bm, num_warps=4, num_stages=2)
    asm = [False, True] if x.is_cuda else [False]
    # no split; K split 3 ways (fixed up by the last split, then by the reduce kernel:
    # a pool that cannot grow); the default tiles
    for config, counters in ((dict(small, SPLIT=1), None), (dict(small, SPLIT=3), CounterPool()),
                             (dict(small, SPLIT=3), _NoCounters()), (None, None)):
        for use_asm in asm:
            out = int4_mma(x, *args, bias=b, config=config, counters=counters, asm=use_asm)
            assert out.shape == (m, n) and out.dtype == dtype
            torch.testing.assert_close(out, ref, **TOLERANCES[dtype],
                                       msg=lambda e: f"{config} asm={use_asm}\n{e}")


class _NoCounters(CounterPool):
    def get(self, device, n):  # as inside a graph capture that would have to grow it
        return None


@pytest.mark.parametrize("dev", [pytest.param(d, marks=DEVICES[d]) for d in DEVICES])
def test_int4_mma_counters_return_to_zero(dev, gen):
    randn = _randn(gen, dev)
    pool = CounterPool()
    x = randn(2, 512, dtype=torch.float16)
    p = quantize_int4(randn(50, 512) / 20, 128)
    cfg = dict(BLOCK_N=16, BLOCK_M=16, SPLIT=4, num_warps=4, num_stages=2)
    first = int4_mma(x, p.qweight, p.scales, p.zeros, 128, 512, config=cfg, counters=pool)
    assert int(pool.get(x.device, 4)[:4].abs().sum()) == 0  # the last split reset each
    again = int4_mma(x, p.qweight, p.scales, p.zeros, 128, 512, config=cfg, counters=pool)
    torch.testing.assert_close(first, again, atol=0, rtol=0)  # split order: deterministic


def test_takes_mma_only_what_it_computes():
    x16 = torch.zeros(1, 256, dtype=torch.bfloat16)
    assert takes_mma(x16, 128, 256)
    assert not takes_mma(x16, 64, 256)  # a K tile is one group of 128
    assert not takes_mma(torch.zeros(1, 260, dtype=torch.bfloat16), 128, 260)  # K % 8
    assert not takes_mma(x16.float(), 128, 256)
    assert not takes_mma(torch.zeros(65, 256, dtype=torch.bfloat16), 128, 256)
