"""int4 weight-only linear (W4A16) vs its torch reference; the nibble packing and the
round-to-nearest quantiser's error bound."""
import pytest
import torch

from infergraft.kernels.int4_linear import (dequantize_int4, int4_config, int4_linear_torch,
                                            int4_linear_triton, pack_nibbles, quantize_int4,
                                            unpack_nibbles)

from .tolerances import TOLERANCES


@pytest.mark.parametrize("k", [1, 2, 7, 100, 576])
def test_nibbles_round_trip_low_nibble_first(gen, k):
    q = torch.randint(0, 16, (5, k), generator=gen, dtype=torch.uint8)
    packed = pack_nibbles(q)
    assert packed.dtype == torch.uint8 and packed.shape == (5, (k + 1) // 2)
    assert torch.equal(packed[:, 0] & 0xF, q[:, 0])  # column 0 in the low nibble
    if k > 1:
        assert torch.equal(packed[:, 0] >> 4, q[:, 1])
    if k % 2:
        assert not (packed[:, -1] >> 4).any()  # the padded column is 0
    assert torch.equal(unpack_nibbles(packed, k), q)
    with pytest.raises(AssertionError, match="do not hold K="):
        unpack_nibbles(packed, k + 2)


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("k", [100, 576, 64])
def test_quantize_int4_is_within_half_a_step_of_each_group(gen, group_size, k):
    n = 9
    w = torch.randn(n, k, generator=gen) * torch.linspace(0.01, 3, n)[:, None]
    w[1] = 0  # all zero: scale 1, zero 0, q 0
    w[2] = 0.7  # constant, positive: the range widened to hold 0, exact
    w[3] = torch.rand(k, generator=gen) + 1  # all positive: zero 0
    p = quantize_int4(w, group_size)
    g = -(-k // group_size)
    assert p.qweight.shape == (n, (k + 1) // 2) and p.qweight.dtype == torch.uint8
    assert p.scales.shape == p.zeros.shape == (n, g) and p.scales.dtype == torch.float32
    assert p.zeros.dtype == torch.uint8 and int(p.zeros.max()) <= 15
    assert (p.group_size, p.in_features, p.dtype) == (group_size, k, torch.float32)
    assert torch.isfinite(p.scales).all() and bool((p.scales > 0).all())
    assert not p.zeros[1].any() and bool((p.scales[1] == 1).all())
    assert not p.zeros[3].any()
    back = dequantize_int4(p)
    assert back.shape == w.shape and back.dtype == w.dtype
    cols = torch.arange(k) // group_size
    step = p.scales[:, cols]  # each column's group scale
    assert bool(((back - w).abs() <= step / 2 + 1e-6 * w.abs().amax()).all())
    assert not back[1].any() and torch.allclose(back[2], w[2], atol=1e-6)
    # each group's range is used: its extreme value is within half a step of a code
    q = unpack_nibbles(p.qweight, k)
    assert int(q.max()) == 15 and int(q.min()) == 0


def test_quantize_int4_keeps_the_weight_dtype_and_a_partial_group_its_own_range(gen):
    w = torch.randn(4, 160, generator=gen)
    w[:, 128:] *= 100  # the partial last group (32 of 128 columns) is far wider
    p = quantize_int4(w.half(), 128)
    assert dequantize_int4(p).dtype == torch.float16
    assert bool((p.scales[:, 1] > 20 * p.scales[:, 0]).all())
    p32 = quantize_int4(w, 32)
    assert p32.scales.shape == (4, 5)


SHAPES = [(1, 40, 576), (3, 33, 100), (17, 48, 130), (64, 24, 576), (3, 17, 64)]


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_linear_matches_reference(device, dtype, randn, poisoned_empty, m, n, k,
                                       group_size):
    x = randn(m, k, dtype=dtype)
    p = quantize_int4(randn(n, k) / k ** 0.5, group_size)
    b = randn(n, dtype=dtype) if m % 2 else None  # odd M with a bias, even without
    args = (p.qweight, p.scales, p.zeros, group_size, k, b)
    # the tensor-core kernel on small tiles: x's even and odd columns loaded with stride
    # 2; then as pairs split in registers, K split three ways, W x^T on odd M (float32
    # keeps the IEEE dot); and the defaults for this M
    small = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=min(64, group_size), num_warps=4,
                 num_stages=2)  # many tiles
    split = dict(small, PATH="tiles", XSPLIT=True, SPLIT=3, SWAP=m % 2 == 1)
    ref = int4_linear_torch(x, *args)
    for config in (small, split, None):
        out = int4_linear_triton(x, *args, config=config)
        assert out.shape == (m, n) and out.dtype == dtype
        torch.testing.assert_close(out, ref, **TOLERANCES[dtype], msg=lambda e: f"{config}\n{e}")


def test_reference_is_the_dequantised_weights_matmul(gen):
    w, x = torch.randn(20, 100, generator=gen), torch.randn(3, 100, generator=gen)
    p = quantize_int4(w, 32)
    y = int4_linear_torch(x, p.qweight, p.scales, p.zeros, 32, 100)
    torch.testing.assert_close(y, x @ dequantize_int4(p).T, atol=1e-5, rtol=1e-5)


def test_int4_config_tiles_stay_inside_a_group():
    for m in (1, 3, 17, 64, 65, 300, 4096):
        for gs in (32, 64, 128):
            cfg = int4_config(m, 4096, 576, gs)
            if cfg["PATH"] == "tiles":
                assert gs % cfg["BLOCK_K"] == 0 and cfg["BLOCK_M"] >= 16
    assert int4_config(1, 576, 576, 128)["PATH"] == "gemv"  # decode's one row
    assert int4_config(4096, 576, 576, 128)["PATH"] == "widen"  # compute-bound


def test_int4_linear_leading_dims_and_errors(device, randn):
    dt = torch.float16
    x = randn(2, 3, 100, dtype=dt)
    p = quantize_int4(randn(24, 100) / 10, 64)
    args = (p.qweight, p.scales, p.zeros, 64, 100)
    out = int4_linear_triton(x, *args)
    assert out.shape == (2, 3, 24)
    torch.testing.assert_close(out, int4_linear_torch(x, *args), **TOLERANCES[dt])
    with pytest.raises(AssertionError, match="qweight must be contiguous uint8"):
        int4_linear_triton(x, p.qweight.to(torch.int8), *args[1:])
    with pytest.raises(AssertionError, match="x has K=99"):
        int4_linear_triton(randn(2, 99, dtype=dt), *args)
    with pytest.raises(AssertionError, match="scales must be contiguous float32"):
        int4_linear_triton(x, p.qweight, p.scales.half(), *args[2:])
    with pytest.raises(AssertionError, match="zeros must be contiguous uint8"):
        int4_linear_triton(x, p.qweight, p.scales, p.zeros.float(), *args[3:])
    with pytest.raises(AssertionError, match="group_size 100"):
        int4_linear_triton(x, p.qweight, p.scales, p.zeros, 100, 100)
