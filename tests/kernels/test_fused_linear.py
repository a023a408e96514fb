"""Decode GEMMs fused with RMSNorm, SwiGLU and the residual add vs the composed references."""
import pytest
import torch

from infergraft.kernels import fused_linear as FL
from infergraft.kernels.linear import MAX_SKINNY_M

from .tolerances import TOLERANCES

SMALL = dict(BLOCK_N=16, BLOCK_K=32, num_warps=4, num_stages=2)  # several tiles each way


def _cfg(m):
    return dict(BLOCK_M=max(16, 1 << (m - 1).bit_length()), **SMALL)


@pytest.fixture(params=[(True, True), (False, True), (True, False)],
                ids=["norm+swiglu", "swiglu", "norm"])
def fusions(request, monkeypatch):
    """Each combination of the A/B knobs takes its own kernel path."""
    monkeypatch.setattr(FL, "FUSE_NORM", request.param[0])
    monkeypatch.setattr(FL, "FUSE_SWIGLU", request.param[1])


@pytest.fixture
def fuse_fp32(monkeypatch, device, dtype):
    """float32 normally goes to cuBLAS; in the interpreter (exact float32 dots) run the
    kernel itself in float32 too, where a logic slip cannot hide in rounding."""
    if dtype is torch.float32:
        if device == "cuda":
            pytest.skip("float32 on CUDA uses tf32 in tl.dot; the entry points route it to cuBLAS")
        monkeypatch.setattr(FL, "_fusable", lambda x, w: 0 < x.shape[0] <= MAX_SKINNY_M)


def _close(out, ref32, what):
    """ref32: float32 math; the fused kernel rounds fewer intermediates than the reference
    in ``out``'s dtype does, so allow two of its ulps."""
    tol = {k: 2 * v for k, v in TOLERANCES[out.dtype].items()}
    torch.testing.assert_close(out.float(), ref32, **tol, msg=lambda m: f"{what}\n{m}")


def _swiglu_rounded_like_the_kernel(x, g, eps, w, b, dtype):
    """float32 math with the kernel's roundings to ``dtype`` (x * g; gate and up; silu):
    silu(g) * u cancels, so rounding the same intermediates elsewhere (as the composed
    reference does) lands several ulps away, either way. The float32 case checks the math."""
    i = w.shape[0] // 2
    if FL.FUSE_NORM:
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        acc = ((x * g).to(dtype).float() @ w.T) * rstd
    else:  # the rms_norm kernel first, rounded like its reference
        acc = FL.rms_norm_torch(x.to(dtype), g.to(dtype), eps).float() @ w.T
    acc = acc + (0 if b is None else b)
    gate, up = acc[:, :i].to(dtype).float(), acc[:, i:].to(dtype).float()
    return (gate * torch.sigmoid(gate)).to(dtype).float() * up


@pytest.mark.parametrize("m,n,k", [(1, 40, 72), (3, 17, 300), (16, 64, 96)])
@pytest.mark.parametrize("bias", [False, True])
def test_rms_norm_linear(device, dtype, randn, poisoned_empty, fusions, fuse_fp32, m, n, k, bias):
    x, g = randn(m, k, dtype=dtype) * 3, randn(k, dtype=dtype)
    w = randn(n, k, dtype=dtype) / k ** 0.5
    b = randn(n, dtype=dtype) if bias else None
    out = FL.rms_norm_linear_triton(x, g, 1e-5, w, b, config=_cfg(m))
    ref = FL.rms_norm_linear_torch(x.float(), g.float(), 1e-5, w.float(),
                                   None if b is None else b.float())
    assert out.shape == (m, n) and out.dtype == dtype
    _close(out, ref, f"M={m} N={n} K={k}")


@pytest.mark.parametrize("m,i,k", [(1, 40, 72), (5, 24, 130), (16, 33, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_rms_norm_swiglu(device, dtype, randn, poisoned_empty, fusions, fuse_fp32, m, i, k, bias):
    x, g = randn(m, k, dtype=dtype), randn(k, dtype=dtype)
    w = randn(2 * i, k, dtype=dtype) * (2 / k ** 0.5)  # gate | up
    b = randn(2 * i, dtype=dtype) if bias else None
    out = FL.rms_norm_swiglu_triton(x, g, 1e-6, w, b, config=_cfg(m))
    ref = _swiglu_rounded_like_the_kernel(x.float(), g.float(), 1e-6, w.float(),
                                          None if b is None else b.float(), dtype)
    assert out.shape == (m, i) and out.dtype == dtype
    _close(out, ref, f"M={m} I={i} K={k}")


@pytest.mark.parametrize("m,n,k", [(1, 40, 72), (7, 17, 300), (16, 64, 96)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_residual(device, dtype, randn, poisoned_empty, fuse_fp32, m, n, k, bias):
    x, r = randn(m, k, dtype=dtype), randn(m, n, dtype=dtype) * 4
    w = randn(n, k, dtype=dtype) / k ** 0.5
    b = randn(n, dtype=dtype) if bias else None
    out = FL.linear_residual_triton(x, w, b, r, config=_cfg(m))
    ref = FL.linear_residual_torch(x.float(), w.float(), None if b is None else b.float(), r.float())
    assert out.shape == (m, n) and out.dtype == dtype
    _close(out, ref, f"M={m} N={n} K={k}")


def test_default_configs_and_strided_rows(device, randn):
    """The launchers' own tile choices, and rows that are a view of a wider tensor."""
    dt = torch.float16
    wide = randn(4, 300, dtype=dt)
    x, g = wide[:, :200], randn(200, dtype=dt)
    w, r = randn(96, 200, dtype=dt) / 15, randn(4, 96, dtype=dt)
    xf, gf, wf = x.float(), g.float(), w.float()
    _close(FL.rms_norm_linear_triton(x, g, 1e-6, w), FL.rms_norm_linear_torch(xf, gf, 1e-6, wf),
           "norm")
    _close(FL.rms_norm_swiglu_triton(x, g, 1e-6, w),
           _swiglu_rounded_like_the_kernel(xf, gf, 1e-6, wf, None, dt), "swiglu")
    _close(FL.linear_residual_triton(x, w, None, r),
           FL.linear_residual_torch(xf, wf, None, r.float()), "residual")


def test_unfusable_inputs_take_the_composition(device, randn):
    """float32 and more than MAX_SKINNY_M rows: the unfused ops, same results as the
    references in that dtype."""
    m = MAX_SKINNY_M + 1
    for dt, rows in ((torch.float16, m), (torch.float32, 2)):
        x, g, r = randn(rows, 32, dtype=dt), randn(32, dtype=dt), randn(rows, 48, dtype=dt)
        w = randn(48, 32, dtype=dt) / 6
        tol = TOLERANCES[dt]
        torch.testing.assert_close(FL.rms_norm_linear_triton(x, g, 1e-6, w),
                                   FL.rms_norm_linear_torch(x, g, 1e-6, w), **tol)
        torch.testing.assert_close(FL.rms_norm_swiglu_triton(x, g, 1e-6, w),
                                   FL.rms_norm_swiglu_torch(x, g, 1e-6, w), **tol)
        torch.testing.assert_close(FL.linear_residual_triton(x, w, None, r),
                                   FL.linear_residual_torch(x, w, None, r), **tol)


def test_bad_shapes_are_rejected(device, randn):
    dt = torch.float16
    x, w = randn(2, 32, dtype=dt), randn(48, 32, dtype=dt)
    with pytest.raises(AssertionError, match="norm weight"):
        FL.rms_norm_linear_triton(x, randn(31, dtype=dt), 1e-6, w)
    with pytest.raises(AssertionError, match="residual"):
        FL.linear_residual_triton(x, w, None, randn(2, 47, dtype=dt))
    with pytest.raises(AssertionError, match="even"):
        FL.rms_norm_swiglu_triton(x, randn(32, dtype=dt), 1e-6, randn(47, 32, dtype=dt))


def test_norm_folded_into_the_weight(device, randn, poisoned_empty):
    """``norm_folded``: W's columns already carry the norm weight; the kernel applies rstd."""
    from infergraft.kernels.linear import launch_gemm
    dt = torch.float16
    x, g = randn(3, 96, dtype=dt) * 2, randn(96, dtype=dt)
    w = randn(40, 96, dtype=dt) / 10
    y = torch.empty((3, 40), dtype=dt, device=x.device)
    launch_gemm((3, 1), _cfg(3), x, (w.float() * g.float()).to(dt), None, y, eps=1e-6,
                norm_folded=True)
    _close(y, FL.rms_norm_linear_torch(x.float(), g.float(), 1e-6, w.float()), "folded")
