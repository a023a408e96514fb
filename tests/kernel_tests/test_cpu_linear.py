"""The CPU's float32 linear (weight row blocks over the threads at a few rows, oneDNN
above) against F.linear."""
import pytest
import torch
import torch.nn.functional as F

from infergraft.kernels import cpu_linear as C
from infergraft.kernels.linear import linear_torch
from infergraft.kernels.lm_head import lm_head_torch


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def _spy_bmm(monkeypatch):
    calls = []
    real = torch.bmm
    monkeypatch.setattr(C.torch, "bmm", lambda *a: calls.append(1) or real(*a))
    return calls


@pytest.mark.parametrize("lead", [(1,), (3,), (C.MAX_BLOCK_ROWS,), (8,), (2, 4), (70,)])
@pytest.mark.parametrize("n", [256, 300, 4099])  # divisible by the 4 blocks, and not
@pytest.mark.parametrize("bias", [False, True])
def test_both_paths_match_f_linear(threads, monkeypatch, lead, n, bias):
    threads(2)
    g = torch.Generator().manual_seed(n + len(lead))
    x = torch.randn(*lead, 96, generator=g)
    w = torch.randn(n, 96, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    assert C.applies(x, w) and C.blocks(n) == 4
    bmm = _spy_bmm(monkeypatch)
    y = C.linear_cpu(x, w, b)
    rows = x.numel() // 96
    assert bool(bmm) == (rows <= C.MAX_BLOCK_ROWS)  # row blocks only at a few rows
    assert y.shape == (*lead, n) and y.is_contiguous() and y.dtype == torch.float32
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(linear_torch(x, w, b), y, rtol=0, atol=0)


def test_onednn_is_found_on_x86():
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("oneDNN's linear is checked on x86 builds of torch")
    assert C.onednn_available()


def test_where_neither_path_applies_it_is_f_linear(threads, monkeypatch):
    """16-bit, a strided weight, oneDNN switched off or missing: F.linear itself, bit for
    bit."""
    threads(2)
    w = torch.randn(256, 32)
    for x, weight in ((torch.randn(2, 32).half(), w.half()), (torch.randn(2, 256), w.t())):
        assert not C.applies(x, weight)
        assert torch.equal(C.linear_cpu(x, weight), F.linear(x, weight))
    x = torch.randn(9, 32)
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)  # the user's switch
    assert torch.equal(C.linear_cpu(x, w), F.linear(x, w))
    monkeypatch.undo()
    monkeypatch.setattr(C, "onednn_available", lambda: False)
    assert torch.equal(C.linear_cpu(x, w), F.linear(x, w))


def test_block_count_follows_the_threads(threads):
    threads(1)
    assert C.blocks(256) == 1  # one thread: nothing to spread; oneDNN takes it
    x, w = torch.randn(1, 32), torch.randn(256, 32)
    torch.testing.assert_close(C.linear_cpu(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    threads(2)
    assert C.blocks(2 * C.MIN_BLOCK_ROWS - 1) == 1 and C.blocks(4 * C.MIN_BLOCK_ROWS) == 4
    threads(64)  # many threads: blocks stay MIN_BLOCK_ROWS long or longer
    assert C.blocks(576) == 576 // C.MIN_BLOCK_ROWS and C.blocks(49152) == 128


def test_lm_head_reference_takes_the_cpu_paths(threads):
    threads(2)
    for rows in (3, 12):
        x, w = torch.randn(rows, 40), torch.randn(1000, 40)
        torch.testing.assert_close(lm_head_torch(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dt", [torch.float32, torch.float16])
@pytest.mark.parametrize("lead", [(1,), (2, 3), (70,)])
def test_int8_chunks_equal_the_whole_weight_widened(threads, monkeypatch, dt, lead):
    """int8 rows widened a chunk at a time (here 64 rows: 5 chunks, the last short) give
    (x q^T) * s + b in float32, rounded to x's dtype, as the whole weight widened does."""
    from infergraft.kernels.int8_linear import int8_linear_torch, quantize_int8

    threads(2)
    monkeypatch.setattr(C, "INT8_CHUNK_BYTES", 64 * 4 * 48)
    g = torch.Generator().manual_seed(len(lead))
    q, s = quantize_int8(torch.randn(300, 48, generator=g))
    x, b = torch.randn(*lead, 48, generator=g).to(dt), torch.randn(300, generator=g).to(dt)
    want = (F.linear(x.float(), q.float()) * s + b.float()).to(dt)
    # float32 sums in another order (the BLAS blocks by shape and thread count) may round
    # to the neighbouring float16: one float16 ulp (2**-10 relative) apart is equal here
    # (on a 16-core host with torch 2.11 a (2, 3)-row case landed one ulp off)
    tol = 1e-5 if dt == torch.float32 else 2 ** -10
    for got in (C.int8_linear_cpu(x, q, s, b), int8_linear_torch(x, q, s, b)):
        assert got.shape == (*lead, 300) and got.dtype == dt
        torch.testing.assert_close(got, want, rtol=tol, atol=1e-5)
