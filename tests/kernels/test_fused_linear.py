"""Decode GEMMs fused with the residual add, the (folded) RMSNorm and SwiGLU, vs the torch
compositions on fresh random inputs."""
import pytest
import torch

from infergraft.kernels import fused_linear as FL

from .tolerances import TOLERANCES

SMALL = dict(BLOCK_N=16, BLOCK_K=32, num_warps=4, num_stages=2)  # several tiles each way


def _cfg(m):
    return dict(BLOCK_M=max(16, 1 << (m - 1).bit_length()), **SMALL)


@pytest.fixture
def fuse_fp32(monkeypatch, device, dtype):
    """float32 normally goes to cuBLAS; in the interpreter (exact float32 dots) run the
    kernel itself in float32 too, where a logic slip cannot hide in rounding."""
    if dtype is torch.float32:
        if device == "cuda":
            pytest.skip("float32 on CUDA uses tf32 in tl.dot; the entry points route it to cuBLAS")
        monkeypatch.setattr(FL, "_fusable", lambda x, w: 0 < x.shape[0] <= FL.FUSE_MAX_ROWS)


def _close(out, ref32, what):
    """ref32: float32 math; the fused kernel rounds fewer intermediates than the reference
    in ``out``'s dtype does, so allow two of its ulps."""
    tol = {k: 2 * v for k, v in TOLERANCES[out.dtype].items()}
    torch.testing.assert_close(out.float(), ref32, **tol, msg=lambda m: f"{what}\n{m}")


def _sum_sq_parts(x, parts):
    """x's sum of squares per row split into ``parts`` partial sums [P, M] (as the
    producing GEMM's programs leave them)."""
    cols = torch.tensor_split(torch.arange(x.shape[1]), parts)
    return torch.stack([x[:, c].float().square().sum(-1) for c in cols]).contiguous()


@pytest.mark.parametrize("m,n,k,parts", [(1, 40, 72, 1), (3, 17, 300, 5), (16, 64, 96, 19)])
@pytest.mark.parametrize("bias", [False, True])
def test_normed_linear(device, dtype, randn, poisoned_empty, fuse_fp32, m, n, k, parts, bias):
    x = randn(m, k, dtype=dtype) * 3
    w = randn(n, k, dtype=dtype) / k ** 0.5
    b = randn(n, dtype=dtype) if bias else None
    out = FL.normed_linear_triton(x, w, b, _sum_sq_parts(x, parts), 1e-5, config=_cfg(m))
    xf = x.float()
    ref = torch.nn.functional.linear(xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-5),
                                     w.float(), None if b is None else b.float())
    assert out.shape == (m, n) and out.dtype == dtype
    _close(out, ref, f"M={m} N={n} K={k}")


def _swiglu_rounded_like_the_kernel(x, w, b, eps, dtype):
    """float32 math with the kernel's roundings to ``dtype`` (gate and up; silu):
    silu(g) * u cancels, so rounding other intermediates (as the composed reference
    does) lands several ulps away, either way. The float32 case checks the math."""
    i = w.shape[0] // 2
    acc = (x @ w.T) * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    acc = acc + (0 if b is None else b)
    gate, up = acc[:, :i].to(dtype).float(), acc[:, i:].to(dtype).float()
    return (gate * torch.sigmoid(gate)).to(dtype).float() * up


@pytest.mark.parametrize("m,i,k,parts", [(1, 40, 72, 1), (5, 24, 130, 3), (16, 33, 64, 8)])
@pytest.mark.parametrize("bias", [False, True])
def test_normed_swiglu(device, dtype, randn, poisoned_empty, fuse_fp32, m, i, k, parts, bias):
    x = randn(m, k, dtype=dtype)
    w = randn(2 * i, k, dtype=dtype) * (2 / k ** 0.5)  # gate | up
    b = randn(2 * i, dtype=dtype) if bias else None
    out = FL.normed_swiglu_triton(x, w, b, _sum_sq_parts(x, parts), 1e-6, config=_cfg(m))
    ref = _swiglu_rounded_like_the_kernel(x.float(), w.float(), None if b is None else b.float(),
                                          1e-6, dtype)
    assert out.shape == (m, i) and out.dtype == dtype
    _close(out, ref, f"M={m} I={i} K={k}")


@pytest.mark.parametrize("m,n,k", [(1, 40, 72), (7, 17, 300), (16, 64, 96)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_residual_and_its_sum_of_squares(device, dtype, randn, poisoned_empty, fuse_fp32,
                                                m, n, k, bias):
    x, r = randn(m, k, dtype=dtype), randn(m, n, dtype=dtype) * 4
    w = randn(n, k, dtype=dtype) / k ** 0.5
    b = randn(n, dtype=dtype) if bias else None
    out, parts = FL.linear_residual_triton(x, w, b, r, sum_sq=True, config=_cfg(m))
    ref = FL.linear_residual_torch(x.float(), w.float(), None if b is None else b.float(), r.float())
    assert out.shape == (m, n) and out.dtype == dtype
    _close(out, ref, f"M={m} N={n} K={k}")
    # one partial per program (16 columns each), of the values as stored
    assert parts.shape == (-(-n // 16), m) and parts.dtype == torch.float32
    torch.testing.assert_close(parts.sum(0), out.float().square().sum(-1), rtol=1e-5, atol=1e-5)
    alone = FL.linear_residual_triton(x, w, b, r, config=_cfg(m))
    torch.testing.assert_close(alone, out, rtol=0, atol=0)  # without the sums: same output


def test_a_decode_layer_chain_matches_the_unfused_composition(device, randn):
    """o + residual -> normed gate_up (weights folded) -> down + residual, with the sums
    of squares handed along, equals norm -> GEMM -> silu -> GEMM -> add in float16."""
    dt, h, i = torch.float16, 96, 80
    stream, attn = randn(2, h, dtype=dt), randn(2, h, dtype=dt)
    wo, wgu, wd = randn(h, h, dtype=dt) / 10, randn(2 * i, h, dtype=dt) / 10, randn(h, i, dtype=dt) / 9
    g = (1 + 0.3 * randn(h)).to(dt)
    s1, parts = FL.linear_residual_triton(attn, wo, None, stream, sum_sq=True)
    folded = (wgu.float() * g.float()).to(dt)
    out = FL.linear_residual_triton(FL.normed_swiglu_triton(s1, folded, None, parts, 1e-6),
                                    wd, None, s1)
    from infergraft.kernels.rms_norm import rms_norm_torch
    r1 = (attn.float() @ wo.float().T).to(dt) + stream
    act = FL.silu_mul_torch(torch.nn.functional.linear(rms_norm_torch(r1, g, 1e-6), wgu))
    ref = (act.float() @ wd.float().T).to(dt) + r1
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=1e-2)


def test_unfusable_inputs_take_the_composition(device, randn):
    """float32 and more than FL.FUSE_MAX_ROWS rows: torch ops, same results as the references."""
    for dt, rows in ((torch.float16, FL.FUSE_MAX_ROWS + 1), (torch.float32, 2)):
        x, r = randn(rows, 32, dtype=dt), randn(rows, 48, dtype=dt)
        w, ss = randn(48, 32, dtype=dt) / 6, _sum_sq_parts(x, 3)
        tol = TOLERANCES[dt]
        torch.testing.assert_close(FL.normed_linear_triton(x, w, None, ss, 1e-6),
                                   FL.normed_linear_torch(x, w, None, ss, 1e-6), **tol)
        torch.testing.assert_close(FL.normed_swiglu_triton(x, w, None, ss, 1e-6),
                                   FL.normed_swiglu_torch(x, w, None, ss, 1e-6), **tol)
        y, parts = FL.linear_residual_triton(x, w, None, r, sum_sq=True)
        ry, rparts = FL.linear_residual_torch(x, w, None, r, sum_sq=True)
        torch.testing.assert_close(y, ry, **tol)
        torch.testing.assert_close(parts.sum(0), rparts.sum(0), rtol=1e-5, atol=1e-5)


def test_bad_inputs_are_rejected(device, randn):
    dt = torch.float16
    x, w = randn(2, 32, dtype=dt), randn(48, 32, dtype=dt)
    with pytest.raises(AssertionError, match="sum_sq"):
        FL.normed_linear_triton(x, w, None, torch.ones(3, 1, device=x.device), 1e-6)
    with pytest.raises(AssertionError, match="residual"):
        FL.linear_residual_triton(x, w, None, randn(2, 47, dtype=dt))
    with pytest.raises(AssertionError, match="even"):
        FL.normed_swiglu_triton(x, randn(47, 32, dtype=dt), None, _sum_sq_parts(x, 1), 1e-6)
    with pytest.raises(AssertionError, match="weight"):
        FL.normed_linear_triton(x, randn(48, 31, dtype=dt), None, _sum_sq_parts(x, 1), 1e-6)
