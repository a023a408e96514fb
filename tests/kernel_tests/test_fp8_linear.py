"""fp8 (e4m3) weight linear vs its torch reference: the skinny decode kernel (widened e4m3
tiles; natively loaded in the CPU interpreter and on sm_89+ GPUs), the W8A8 path above 64
rows (x quantised per token, ``torch._scaled_mm``), the widened-weight fallbacks, and the
quantiser's rounding."""
import types

import pytest
import torch

import infergraft.kernels.fp8_linear as FL
from infergraft.kernels.fp8_linear import (dequantize_fp8, fp8_linear_torch, fp8_linear_triton,
                                           quantize_fp8, quantize_rows_fp8,
                                           quantize_rows_fp8_triton)

from .tolerances import TOLERANCES

SMALL = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, num_warps=4, num_stages=2)  # many tiles


def _within_e4m3_rounding(q, s, w):
    """|q s - w| <= 2^-4 |w| for normal e4m3 values, 2^-10 s below them (subnormals)."""
    err = (q.float() * s[:, None] - w.float()).abs()
    bound = torch.maximum(w.float().abs() / 16, s[:, None] / 1024) * (1 + 1e-5)
    return bool((err <= bound).all())


def test_quantize_fp8_rounds_each_row_to_its_own_scale(device, randn):
    w = randn(37, 70) * torch.linspace(0.01, 3, 37, device=device)[:, None]
    w[5] = 0  # an all-zero row: scale 1, q 0
    w[7, 3] = 1e-6  # deep in the subnormals of its row
    q, s = quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (37,)
    assert float(s[5]) == 1.0 and not q[5].float().any()
    rows = [i for i in range(37) if i != 5]
    assert bool((q.float().abs().amax(1)[rows] == 448).all())  # every row's max is e4m3's max
    assert _within_e4m3_rounding(q, s, w)
    assert torch.isfinite(q.float()).all()
    normal = (w / s[:, None]).abs() >= 2 ** -6  # the subnormal tail: absolute error only
    assert not normal[7, 3] and bool(normal.sum() > 0.9 * w.numel())
    torch.testing.assert_close(dequantize_fp8(q, s)[normal], w[normal], atol=0, rtol=1 / 16)


def test_activation_rows_get_their_own_dynamic_scale(device, randn):
    x = randn(9, 48).to(torch.bfloat16) * 7
    xq, sx = quantize_rows_fp8(x)
    assert xq.shape == (9, 48) and sx.shape == (9, 1) and sx.dtype == torch.float32
    torch.testing.assert_close(sx[:, 0], x.float().abs().amax(1) / 448)
    assert _within_e4m3_rounding(xq, sx[:, 0], x)


@pytest.mark.parametrize("m,n,k", [(1, 40, 72), (5, 33, 300), (16, 64, 96), (64, 48, 130)])
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_linear_matches_reference(device, dtype, randn, poisoned_empty, m, n, k, bias):
    x = randn(m, k, dtype=dtype)
    q, s = quantize_fp8(randn(n, k) / k ** 0.5)
    b = randn(n, dtype=dtype) if bias else None
    if device == "cuda" and torch.cuda.get_device_capability() >= (8, 9):
        assert FL.fp8_native(device)  # the e4m3 kernel runs, not the fallback
    for config in (SMALL, None):  # small tiles, and the defaults
        out = fp8_linear_triton(x, q, s, b, config=config)
        ref = fp8_linear_torch(x, q, s, b)
        assert out.shape == (m, n) and out.dtype == dtype
        torch.testing.assert_close(out, ref, **TOLERANCES[dtype])


def test_fp8_linear_leading_dims_and_errors(device, randn):
    dt = torch.float16
    x = randn(2, 3, 64, dtype=dt)
    q, s = quantize_fp8(randn(24, 64))
    out = fp8_linear_triton(x, q, s)
    assert out.shape == (2, 3, 24)
    torch.testing.assert_close(out, fp8_linear_torch(x, q, s), **TOLERANCES[dt])
    with pytest.raises(AssertionError, match="qweight must be contiguous float8_e4m3fn"):
        fp8_linear_triton(x, q.float(), s)
    with pytest.raises(AssertionError, match="x has K=63"):
        fp8_linear_triton(randn(2, 63, dtype=dt), q, s)
    with pytest.raises(AssertionError, match="scale must be contiguous float32 .* stride"):
        fp8_linear_triton(x, q, torch.stack([s, s], 1)[:, 0])  # every other float


def _spies(monkeypatch):
    """Count the calls of ``torch._scaled_mm`` (W8A8) and of the widened-weight F.linear."""
    calls = []
    real_mm, real_linear = torch._scaled_mm, torch.nn.functional.linear

    def scaled_mm(a, b, **kw):
        calls.append("w8a8")
        assert a.dtype == b.dtype == torch.float8_e4m3fn and b.stride(0) == 1  # column-major
        assert kw["scale_a"].shape == (a.shape[0], 1) and kw["scale_b"].shape == (1, b.shape[1])
        return real_mm(a, b, **kw)

    def linear(x, w, b=None):
        calls.append(f"widened {w.dtype}")
        return real_linear(x, w, b)

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    monkeypatch.setattr(FL, "F", types.SimpleNamespace(linear=linear))
    return calls


def test_many_bf16_rows_run_w8a8_with_a_per_token_scale(device, randn, monkeypatch):
    """Above 64 rows bf16 x is quantised to e4m3 row by row and multiplied on the fp8
    tensor cores: the exact product of the two quantised operands, within bf16's rounding,
    and within e4m3's rounding of x (2^-4) of the summed terms from the W8A16 reference."""
    calls = _spies(monkeypatch)
    x = randn(2, 40, 96, dtype=torch.bfloat16)  # 80 rows
    w = randn(48, 96) / 96 ** 0.5
    q, s = quantize_fp8(w)
    b = randn(48, dtype=torch.bfloat16)
    out = fp8_linear_triton(x, q, s, b)
    assert calls == ["w8a8"] and out.shape == (2, 40, 48) and out.dtype == torch.bfloat16
    xq, sx = quantize_rows_fp8(x.reshape(80, 96))
    exact = (xq.float() * sx) @ dequantize_fp8(q, s).t() + b.float()
    torch.testing.assert_close(out.reshape(80, 48).float(), exact, atol=2e-2, rtol=1e-2)
    ref = fp8_linear_torch(x, q, s, b).float()
    terms = x.float().abs() @ dequantize_fp8(q, s).abs().t()
    assert float((out.float() - ref).abs().max() / terms.max()) < 1 / 16 + 1e-2


@pytest.mark.parametrize("case", ["fp16", "fp32", "k_not_16", "switched_off"])
def test_other_many_row_cases_widen_the_weight(device, randn, monkeypatch, case):
    calls = _spies(monkeypatch)
    dt = {"fp16": torch.float16, "fp32": torch.float32}.get(case, torch.bfloat16)
    k = 100 if case == "k_not_16" else 96
    if case == "switched_off":
        monkeypatch.setenv("INFERGRAFT_FP8_W8A8", "0")
    x = randn(70, k, dtype=dt)
    q, s = quantize_fp8(randn(32, k) / k ** 0.5)
    out = fp8_linear_triton(x, q, s)
    assert calls == [f"widened {dt}"]
    torch.testing.assert_close(out, fp8_linear_torch(x, q, s), **TOLERANCES[dt])
    calls.clear()
    fp8_linear_triton(x[:64], q, s)  # 64 rows: the skinny kernel
    assert calls == []


def test_without_native_fp8_the_reference_runs(device, randn, monkeypatch):
    """A GPU below sm_89 (no e4m3 in Triton): the launcher is the reference, bit for bit."""
    monkeypatch.setattr(FL, "fp8_native", lambda dev: False)
    x = randn(5, 64, dtype=torch.float16)
    q, s = quantize_fp8(randn(24, 64))
    assert torch.equal(fp8_linear_triton(x, q, s), fp8_linear_torch(x, q, s))
    assert torch.equal(fp8_linear_triton(x.repeat(20, 1), q, s),
                       fp8_linear_torch(x.repeat(20, 1), q, s))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_native_fp8_on_the_gpu_follows_its_capability():
    assert FL.fp8_native("cuda") == (torch.cuda.get_device_capability() >= (8, 9))
    assert not FL.fp8_native("cpu") or FL.interpreting()


@pytest.mark.parametrize("m,k", [(1, 16), (3, 100), (5, 4096), (2, 5000)])
def test_the_activation_quantiser_kernel_rounds_as_quantize_fp8(device, randn, m, k):
    """W8A8's per-token quantiser in one kernel (rows longer than a block read in parts):
    bit for bit ``quantize_fp8`` where torch divides exactly (the CPU); on CUDA, whose
    torch divides a tensor by 448 through a reciprocal, scales within an ulp and values
    within one e4m3 step, every row's max 448. An all-zero row: scale 1, zeros."""
    for dt in (torch.float32, torch.bfloat16):
        x = (randn(m, k) * torch.logspace(-3, 3, m, device=device)[:, None]).to(dt)
        if m > 1:
            x[1] = 0
        q, s = quantize_rows_fp8_triton(x)
        want_q, want_s = quantize_fp8(x)
        assert q.shape == (m, k) and q.dtype == torch.float8_e4m3fn and s.shape == (m, 1)
        if device == "cpu":
            assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
            assert torch.equal(s[:, 0], want_s)
        else:
            torch.testing.assert_close(s[:, 0], want_s, rtol=2 ** -23, atol=0)
            assert _within_e4m3_rounding(q, s[:, 0], x)
        assert (q.float().abs().amax(1)[s[:, 0] != 1] == 448).all()
        if m > 1:
            assert float(s[1]) == 1.0 and not q[1].float().any()
    if device == "cuda":  # the W8A8 path quantises x with it
        got = quantize_rows_fp8(x)
        assert torch.equal(got[0].view(torch.uint8), q.view(torch.uint8))
