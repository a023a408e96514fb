"""int8 weight-only linear (W8A16) vs its torch reference, and the quantiser's rounding."""
import types

import pytest
import torch

from infergraft.kernels.int8_linear import int8_linear_torch, int8_linear_triton, quantize_int8

from .tolerances import TOLERANCES


def test_quantize_int8_rounds_each_row_to_its_own_scale(device, randn):
    w = randn(37, 70) * torch.linspace(0.01, 3, 37, device=device)[:, None]
    w[5] = 0  # an all-zero row: scale 1, q 0
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (37,)
    assert int(q.abs().max()) == 127 and bool((q[5] == 0).all()) and float(s[5]) == 1.0
    err = (q.float() * s[:, None] - w).abs()
    assert bool((err <= s[:, None] / 2 + 1e-6).all())  # half a step at most
    assert torch.equal(q.abs().amax(1)[[i for i in range(37) if i != 5]],
                       torch.full((36,), 127, dtype=torch.int8, device=device))


@pytest.mark.parametrize("m,n,k", [(1, 40, 72), (5, 33, 300), (16, 64, 96), (70, 48, 130)])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_matches_reference(device, dtype, randn, poisoned_empty, m, n, k, bias):
    x = randn(m, k, dtype=dtype)
    q, s = quantize_int8(randn(n, k) / k ** 0.5)
    b = randn(n, dtype=dtype) if bias else None
    cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, num_warps=4, num_stages=2)  # many tiles
    swap = dict(cfg, BLOCK_N=32, SWAP=True)  # y^T = w x^T (float32 takes the unswapped dot)
    for config in (cfg, swap, None):  # small tiles, swapped operands, and the defaults
        out = int8_linear_triton(x, q, s, b, config=config)
        ref = int8_linear_torch(x, q, s, b)
        assert out.shape == (m, n) and out.dtype == dtype
        torch.testing.assert_close(out, ref, **TOLERANCES[dtype])


def test_int8_linear_leading_dims_and_errors(device, randn):
    dt = torch.float16
    x = randn(2, 3, 64, dtype=dt)
    q, s = quantize_int8(randn(24, 64))
    out = int8_linear_triton(x, q, s)
    assert out.shape == (2, 3, 24)
    torch.testing.assert_close(out, int8_linear_torch(x, q, s), **TOLERANCES[dt])
    with pytest.raises(AssertionError, match="qweight must be contiguous int8"):
        int8_linear_triton(x, q.float(), s)
    with pytest.raises(AssertionError, match="x has K=63"):
        int8_linear_triton(randn(2, 63, dtype=dt), q, s)
    with pytest.raises(AssertionError, match="scale must be contiguous float32"):
        int8_linear_triton(x, q, s.half())
    with pytest.raises(AssertionError, match="scale must be contiguous float32 .* stride"):
        int8_linear_triton(x, q, torch.stack([s, s], 1)[:, 0])  # every other float


@pytest.mark.parametrize("dt", [torch.float16, torch.bfloat16])
def test_int8_linear_widens_the_weight_for_many_rows(device, randn, monkeypatch, dt):
    """From DEQUANT_MIN_ROWS rows on (compute-bound prefill) the weight is widened to x's
    dtype and the GEMM is cuBLAS's: within the dtype's tolerance of the exact int8 math,
    with leading dims and a bias. Fewer rows, and float32, take the int8 kernel."""
    import infergraft.kernels.int8_linear as IL

    real, calls = torch.nn.functional.linear, []

    def spy(x, w, b=None):
        calls.append(w.dtype)
        return real(x, w, b)

    monkeypatch.setattr(IL, "DEQUANT_MIN_ROWS", 8)
    monkeypatch.setattr(IL, "F", types.SimpleNamespace(linear=spy))
    x = randn(2, 5, 96, dtype=dt)  # 10 rows >= 8
    q, s = quantize_int8(randn(40, 96) / 96 ** 0.5)
    b = randn(40, dtype=dt)
    out = int8_linear_triton(x, q, s, b)
    assert calls == [dt] and out.shape == (2, 5, 40) and out.dtype == dt
    torch.testing.assert_close(out, int8_linear_torch(x, q, s, b), **TOLERANCES[dt])
    int8_linear_triton(x[0, :3].float(), q, s)  # 3 rows
    int8_linear_triton(x.float(), q, s)  # float32
    assert calls == [dt]
