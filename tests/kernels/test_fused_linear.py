"""Skinny GEMM with a folded RMSNorm (row scale), a SwiGLU epilogue (gate | up weight) and
a residual epilogue vs the reference."""
import pytest
import torch
import torch.nn.functional as F

import infergraft.kernels.fused_linear as fl
from infergraft.kernels import get_ops
from infergraft.kernels.fused_linear import (fused_linear_torch, fused_linear_triton,
                                             fused_skinny_gemm, rstd_torch)
from infergraft.kernels.linear import MAX_SKINNY_M
from infergraft.kernels.silu_mul import silu_mul_torch

from .tolerances import assert_close

N, K = 37, 75  # odd: partial tiles in N and K, and 3 K iterations of BLOCK_K=32
EPS = 1e-2  # far from the default (and from 0), so a dropped eps shows


def small_config(m):
    return dict(BLOCK_M=max(16, 1 << (m - 1).bit_length()), BLOCK_N=16, BLOCK_K=32,
                num_warps=4, num_stages=2)


def make_inputs(randn, dtype, m, mode, bias, residual, n=N, k=K):
    """x, weight and the keyword arguments of one call; mode is one of MODES."""
    x = randn(m, k, dtype=dtype)
    if mode in ("norm", "norm+swiglu"):  # rows of very different scales: the row scale must be per row
        x = x * (2.0 ** (torch.arange(m, device=x.device) - m // 2)).to(dtype)[:, None]
    swiglu = mode.endswith("swiglu")
    n_w = 2 * n if swiglu else n
    w = randn(n_w, k, dtype=dtype) / k ** 0.5  # keeps y ~ N(0, 1)
    kw = dict(bias=randn(n_w, dtype=dtype) if bias else None, swiglu=swiglu,
              rms_eps=EPS if mode.startswith("norm") else None,
              residual=randn(m, n, dtype=dtype) if residual and not swiglu else None)
    return x, w, kw


def unfused(x, w, bias=None, *, rms_eps=None, swiglu=False, residual=None):
    """The layer before fusion: norm, F.linear, silu_mul, then the add (rounds y twice)."""
    a = (x.float() * rstd_torch(x, rms_eps)).to(x.dtype) if rms_eps is not None else x
    y = F.linear(a, w, bias)
    if swiglu:
        return silu_mul_torch(y)
    return y if residual is None else y + residual


MODES = ["plain", "norm", "swiglu", "norm+swiglu"]


@pytest.mark.parametrize("residual", [False, True], ids=["", "res"])
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("m", [1, 3, 16])
def test_fused_skinny_gemm_matches_reference(device, dtype, randn, poisoned_empty, m, mode,
                                             bias, residual):
    x, w, kw = make_inputs(randn, dtype, m, mode, bias, residual)
    ref = fused_linear_torch(x, w, **kw)
    out = fused_skinny_gemm(x, w, **kw, config=small_config(m))
    assert out.shape == (m, N) and out.dtype == dtype
    assert_close(out, ref, f"{mode} M={m} bias={bias} residual={residual}")
    if mode.startswith("norm") and dtype is torch.float32:  # the norm really is per row
        assert_close(out, unfused(x, w, **kw), f"{mode} M={m} vs unfused")


@pytest.mark.parametrize("mode", MODES)
def test_fused_linear_default_tiles(device, dtype, randn, poisoned_empty, mode):
    # the dispatching entry point with skinny_config's tiles (float32 takes the unfused ops)
    x, w, kw = make_inputs(randn, dtype, 2, mode, True, True, n=33, k=600)
    assert_close(fused_linear_triton(x, w, **kw), fused_linear_torch(x, w, **kw), mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("m", [0, MAX_SKINNY_M + 1])
def test_fused_linear_falls_back_outside_skinny_range(device, dtype, randn, poisoned_empty,
                                                      monkeypatch, m, mode):
    def no_kernel(*args, **kwargs):
        raise AssertionError("the skinny kernel must not run here")

    monkeypatch.setattr(fl, "fused_skinny_gemm", no_kernel)
    x, w, kw = make_inputs(randn, dtype, m, mode, True, True)
    out = fused_linear_triton(x, w, **kw)
    assert out.shape == (m, N)
    assert_close(out, unfused(x, w, **kw), f"{mode} M={m}")
    if dtype is torch.float32:  # no intermediate rounding to tell the two apart
        assert_close(out, fused_linear_torch(x, w, **kw), f"{mode} M={m}")


def test_fp32_takes_the_unfused_path(device, randn, monkeypatch):
    monkeypatch.setattr(fl, "fused_skinny_gemm", lambda *a, **k: pytest.fail("kernel ran"))
    x, w, kw = make_inputs(randn, torch.float32, 4, "norm", False, True)
    assert_close(fused_linear_triton(x, w, **kw), fused_linear_torch(x, w, **kw))


@pytest.mark.parametrize("fn", [fused_linear_torch, fused_linear_triton, fused_skinny_gemm])
def test_rejects_bad_arguments(device, randn, fn):
    x, w = randn(2, 8, dtype=torch.float16), randn(5, 8, dtype=torch.float16)
    with pytest.raises(AssertionError, match="do not combine"):
        fn(x, randn(6, 8, dtype=torch.float16), swiglu=True, residual=randn(2, 3, dtype=torch.float16))
    with pytest.raises(AssertionError, match="K=8"):
        fn(x, randn(5, 9, dtype=torch.float16))
    with pytest.raises(AssertionError, match=r"swiglu: weight must be \[2N, K\]"):
        fn(x, w, swiglu=True)
    with pytest.raises(AssertionError, match=r"bias must be \[5\]"):
        fn(x, w, randn(4, dtype=torch.float16))
    with pytest.raises(AssertionError, match="rms_eps must be > 0"):
        fn(x, w, rms_eps=0.0)
    with pytest.raises(AssertionError, match=r"residual must be \[2, 5\]"):
        fn(x, w, residual=randn(5, 2, dtype=torch.float16))
    with pytest.raises(AssertionError, match="!= weight"):
        fn(x, w.float())


def test_skinny_kernel_rejects_too_many_rows(device, randn):
    with pytest.raises(AssertionError, match="rows"):
        fused_skinny_gemm(randn(MAX_SKINNY_M + 1, 8), randn(4, 8))


def test_dispatch_exposes_fused_linear(device):
    assert get_ops(device, "triton").fused_linear is fused_linear_triton
    assert get_ops(device, "torch").fused_linear is fused_linear_torch
