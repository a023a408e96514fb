"""kv_write_quant: Triton vs the torch reference, bit-exact (values and scales), on
contiguous and paged cache views, int8 and e4m3 caches; the quantisation error bounds;
ties; zero rows."""
import pytest
import torch

from infergraft.kernels.kv_write import (kv_write_quant_torch, kv_write_quant_triton,
                                         quantize_int8_torch, quantize_kv_torch)

from .tolerances import assert_exact

SENTINEL = -96  # exact in int8 and in e4m3
FP8 = torch.float8_e4m3fn
KV_DTYPES = pytest.mark.parametrize("kv_dtype", [torch.int8, FP8], ids=["int8", "fp8"])


def _bits(x):
    return x.view(torch.uint8) if x.dtype == FP8 else x  # e4m3 compared bit for bit


def _caches(layout, hkv, d, device, kv_dtype=torch.int8):
    """(K, V in ``kv_dtype``, K scales, V scales) sentinel-filled, and their 4-D/3-D views."""
    if layout == "contiguous":  # [rows, Hkv, S, D] storage, indexed by (row, position)
        shape, perm, sshape, sperm = (3, hkv, 11, d), (0, 2, 1, 3), (3, hkv, 11), (0, 2, 1)
    else:  # paged: [blocks, block_size, Hkv, D], indexed by (block, offset)
        shape, perm, sshape, sperm = (5, 4, hkv, d), (0, 1, 2, 3), (5, 4, hkv), (0, 1, 2)
    c = [torch.full(shape, SENTINEL, dtype=torch.float32, device=device).to(kv_dtype)
         for _ in range(2)]
    s = [torch.full(sshape, -1.0, device=device) for _ in range(2)]
    return c + s, [x.permute(*perm) for x in c] + [x.permute(*sperm) for x in s]


@KV_DTYPES
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("t,hkv,d", [(0, 2, 8), (1, 1, 64), (6, 3, 24), (9, 2, 128)])
def test_kv_write_quant_matches_reference(device, dtype, randn, gen, t, hkv, d, layout,
                                          kv_dtype):
    store, views = _caches(layout, hkv, d, device, kv_dtype)
    store_ref, views_ref = _caches(layout, hkv, d, device, kv_dtype)
    n0, n1 = views[0].shape[:2]
    slots = torch.randperm(n0 * n1, generator=gen)[:t]
    idx0, idx1 = (slots // n1).to(device), (slots % n1).to(device)
    k, v = randn(t, hkv, d, dtype=dtype) * 3, randn(t, hkv, d, dtype=dtype)
    if t:
        k[0, 0] = 0  # an all-zero row: scale 0, values 0, no NaN
    k0 = k.clone()
    assert kv_write_quant_triton(k, v, *views, idx0, idx1) is None
    kv_write_quant_torch(k, v, *views_ref, idx0, idx1)
    for name, a, b in zip(("k_cache", "v_cache", "k_scale", "v_scale"), store, store_ref):
        assert_exact(_bits(a), _bits(b), name)
    written = torch.zeros(n0, n1, dtype=torch.bool, device=device)
    written[idx0, idx1] = True
    assert (views[0][~written].float() == SENTINEL).all(), "a slot not indexed was modified"
    assert (views[2][~written] == -1).all(), "a scale not indexed was modified"
    assert_exact(k, k0, "k modified")
    if t:
        assert (views[0][idx0[0], idx1[0], 0].float() == 0).all()
        assert views[2][idx0[0], idx1[0], 0] == 0
        q, s = views[0][idx0, idx1].float(), views[2][idx0, idx1][..., None]
        err = (q * s - k.float()).abs()
        if kv_dtype == torch.int8:  # within half a step of the input
            assert (err <= s / 2 + 1e-6).all() and q.abs().amax(-1).le(127).all()
        else:  # 3 mantissa bits: half a step is 2^-4 of a normal value, 2^-10 s below 2^-6 s
            assert (err <= torch.maximum(k.float().abs() / 16, s / 1024) * 1.001 + 1e-6).all()
            assert q.abs().amax(-1)[s[..., 0] > 0].eq(448).all(), "amax maps to e4m3's 448"


@KV_DTYPES
def test_kv_write_quant_skips_rows_with_negative_index(device, randn, gen, kv_dtype):
    store, views = _caches("paged", 2, 16, device, kv_dtype)
    store_ref, views_ref = _caches("paged", 2, 16, device, kv_dtype)
    slots = torch.randperm(20, generator=gen)[:6]
    idx0, idx1 = slots // 4, slots % 4
    idx0[torch.tensor([0, 3])] = -1  # padding rows: written nowhere
    idx0, idx1 = idx0.to(device), idx1.to(device)
    k, v = randn(6, 2, 16), randn(6, 2, 16)
    kv_write_quant_triton(k, v, *views, idx0, idx1)
    kv_write_quant_torch(k, v, *views_ref, idx0, idx1)
    for name, a, b in zip(("k_cache", "v_cache", "k_scale", "v_scale"), store, store_ref):
        assert_exact(_bits(a), _bits(b), name)
    assert int((views[2] != -1).any(-1).sum()) == 4, "exactly the 4 live rows get scales"


def test_int8_rounds_ties_to_even_like_torch(device):
    # amax 127 -> scale 1, so x / scale hits the .5 ties exactly
    x = torch.tensor([[[127.0, 2.5, -2.5, 3.5, -3.5, 0.5, -0.5, 1.49]]], device=device)
    want_q, want_s = quantize_int8_torch(x)
    assert want_q.flatten().tolist() == [127, 2, -2, 4, -4, 0, 0, 1] and want_s.item() == 1.0
    kc, vc = (torch.zeros(1, 1, 1, 8, dtype=torch.int8, device=device) for _ in "kv")
    ks, vs = (torch.zeros(1, 1, 1, device=device) for _ in "kv")
    idx = torch.zeros(1, dtype=torch.long, device=device)
    kv_write_quant_triton(x, x, kc, vc, ks, vs, idx, idx)
    assert_exact(kc[0, 0], want_q[0])
    assert ks.item() == 1.0


def test_fp8_rounds_to_nearest_even_like_torch(device):
    # amax 448 -> scale 1: 1.0625 lies halfway between 1 and 1.125 (-> 1, even mantissa),
    # 1.1875 between 1.125 and 1.25 (-> 1.25), 0.0029296875 is 1.5 subnormal steps (-> 2)
    x = torch.tensor([[[448.0, 1.0625, -1.1875, 1.1876, 0.0029296875, 300.0, -17.0, 0.0]]],
                     device=device)
    want_q, want_s = quantize_kv_torch(x, FP8)
    assert want_q.float().flatten().tolist() == [448, 1, -1.25, 1.25, 0.00390625, 288, -16, 0]
    assert want_s.item() == 1.0
    kc, vc = (torch.zeros(1, 1, 1, 8, dtype=FP8, device=device) for _ in "kv")
    ks, vs = (torch.zeros(1, 1, 1, device=device) for _ in "kv")
    idx = torch.zeros(1, dtype=torch.long, device=device)
    kv_write_quant_triton(x, x, kc, vc, ks, vs, idx, idx)
    assert_exact(_bits(kc[0, 0]), _bits(want_q[0]))
    assert vs.item() == 1.0


def test_kv_write_quant_rejects_bad_inputs(device, randn):
    _, (kc, vc, ks, vs) = _caches("paged", 2, 8, device)
    k = v = randn(3, 2, 8)
    idx = torch.zeros(3, dtype=torch.long, device=device)
    with pytest.raises(AssertionError, match="k_cache must be int8 or float8_e4m3fn"):
        kv_write_quant_triton(k, v, kc.float(), vc, ks, vs, idx, idx)
    with pytest.raises(AssertionError, match=r"v_cache must be int8 or float8_e4m3fn \(both"):
        kv_write_quant_triton(k, v, kc, vc.to(FP8), ks, vs, idx, idx)
    with pytest.raises(AssertionError, match="k_scale must be float32"):
        kv_write_quant_triton(k, v, kc, vc, ks.double(), vs, idx, idx)
    with pytest.raises(AssertionError, match="v_scale must be"):
        kv_write_quant_triton(k, v, kc, vc, ks, vs[:, :2], idx, idx)
    with pytest.raises(AssertionError, match="idx1 must be"):
        kv_write_quant_triton(k, v, kc, vc, ks, vs, idx, idx[:2])
