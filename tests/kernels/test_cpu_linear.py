"""The CPU's few-row float32 linear (weight row blocks over the threads) against F.linear."""
import pytest
import torch
import torch.nn.functional as F

from infergraft.kernels import cpu_linear as C
from infergraft.kernels.linear import lm_head_torch, linear_torch


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("lead", [(1,), (3,), (8,), (2, 4)])
@pytest.mark.parametrize("n", [256, 300, 4099])  # divisible by the 4 blocks, and not
@pytest.mark.parametrize("bias", [False, True])
def test_row_blocks_match_f_linear(threads, lead, n, bias):
    threads(2)
    g = torch.Generator().manual_seed(n + len(lead))
    x = torch.randn(*lead, 96, generator=g)
    w = torch.randn(n, 96, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    assert C.applies(x, w) and C.blocks(n) == 4
    y = C.linear_cpu(x, w, b)
    assert y.shape == (*lead, n) and y.is_contiguous() and y.dtype == torch.float32
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(linear_torch(x, w, b), y, rtol=0, atol=0)


def test_where_it_does_not_apply_it_is_f_linear(threads):
    """More than MAX_ROWS rows, one thread, 16-bit, a strided weight, a tiny weight: F.linear
    itself (bit for bit)."""
    threads(2)
    w = torch.randn(256, 32)
    cases = [(torch.randn(C.MAX_ROWS + 1, 32), w), (torch.randn(2, 32).half(), w.half()),
             (torch.randn(2, 256), w.t()), (torch.randn(2, 32), w[:2 * C.MIN_BLOCK_ROWS - 1])]
    for x, weight in cases:
        assert not C.applies(x, weight)
        assert torch.equal(C.linear_cpu(x, weight), F.linear(x, weight))
    threads(1)
    assert not C.applies(torch.randn(1, 32), w) and C.blocks(256) == 1
    threads(64)  # many threads: blocks stay MIN_BLOCK_ROWS long or longer
    assert C.blocks(576) == 576 // C.MIN_BLOCK_ROWS and C.blocks(49152) == 128


def test_lm_head_reference_takes_the_row_blocks(threads):
    threads(2)
    x, w = torch.randn(3, 40), torch.randn(1000, 40)
    torch.testing.assert_close(lm_head_torch(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
