"""kv_write_int8: Triton vs the torch reference, bit-exact (values and scales), on
contiguous and paged cache views; the quantisation error bound; ties; zero rows."""
import pytest
import torch

from infergraft.kernels.kv_write import (kv_write_int8_torch, kv_write_int8_triton,
                                         quantize_int8_torch)

from .tolerances import assert_exact

SENTINEL = -77


def _caches(layout, hkv, d, device):
    """(int8 K, int8 V, K scales, V scales) sentinel-filled, and their 4-D/3-D views."""
    if layout == "contiguous":  # [rows, Hkv, S, D] storage, indexed by (row, position)
        shape, perm, sshape, sperm = (3, hkv, 11, d), (0, 2, 1, 3), (3, hkv, 11), (0, 2, 1)
    else:  # paged: [blocks, block_size, Hkv, D], indexed by (block, offset)
        shape, perm, sshape, sperm = (5, 4, hkv, d), (0, 1, 2, 3), (5, 4, hkv), (0, 1, 2)
    c = [torch.full(shape, SENTINEL, dtype=torch.int8, device=device) for _ in range(2)]
    s = [torch.full(sshape, -1.0, device=device) for _ in range(2)]
    return c + s, [x.permute(*perm) for x in c] + [x.permute(*sperm) for x in s]


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("t,hkv,d", [(0, 2, 8), (1, 1, 64), (6, 3, 24), (9, 2, 128)])
def test_kv_write_int8_matches_reference(device, dtype, randn, gen, t, hkv, d, layout):
    store, views = _caches(layout, hkv, d, device)
    store_ref, views_ref = _caches(layout, hkv, d, device)
    n0, n1 = views[0].shape[:2]
    slots = torch.randperm(n0 * n1, generator=gen)[:t]
    idx0, idx1 = (slots // n1).to(device), (slots % n1).to(device)
    k, v = randn(t, hkv, d, dtype=dtype) * 3, randn(t, hkv, d, dtype=dtype)
    if t:
        k[0, 0] = 0  # an all-zero row: scale 0, values 0, no NaN
    k0 = k.clone()
    assert kv_write_int8_triton(k, v, *views, idx0, idx1) is None
    kv_write_int8_torch(k, v, *views_ref, idx0, idx1)
    for name, a, b in zip(("k_cache", "v_cache", "k_scale", "v_scale"), store, store_ref):
        assert_exact(a, b, name)
    written = torch.zeros(n0, n1, dtype=torch.bool, device=device)
    written[idx0, idx1] = True
    assert (views[0][~written] == SENTINEL).all(), "a slot not indexed was modified"
    assert (views[2][~written] == -1).all(), "a scale not indexed was modified"
    assert_exact(k, k0, "k modified")
    if t:
        assert (views[0][idx0[0], idx1[0], 0] == 0).all() and views[2][idx0[0], idx1[0], 0] == 0
        # dequantised values are within half a step of the input
        deq = views[0][idx0, idx1].float() * views[2][idx0, idx1][..., None]
        step = views[2][idx0, idx1][..., None]
        assert ((deq - k.float()).abs() <= step / 2 + 1e-6).all()
        assert views[0][idx0, idx1].abs().amax(-1).le(127).all()


def test_kv_write_int8_skips_rows_with_negative_index(device, randn, gen):
    store, views = _caches("paged", 2, 16, device)
    store_ref, views_ref = _caches("paged", 2, 16, device)
    slots = torch.randperm(20, generator=gen)[:6]
    idx0, idx1 = slots // 4, slots % 4
    idx0[torch.tensor([0, 3])] = -1  # padding rows: written nowhere
    idx0, idx1 = idx0.to(device), idx1.to(device)
    k, v = randn(6, 2, 16), randn(6, 2, 16)
    kv_write_int8_triton(k, v, *views, idx0, idx1)
    kv_write_int8_torch(k, v, *views_ref, idx0, idx1)
    for name, a, b in zip(("k_cache", "v_cache", "k_scale", "v_scale"), store, store_ref):
        assert_exact(a, b, name)
    assert int((views[2] != -1).any(-1).sum()) == 4, "exactly the 4 live rows get scales"


def test_int8_rounds_ties_to_even_like_torch(device):
    # amax 127 -> scale 1, so x / scale hits the .5 ties exactly
    x = torch.tensor([[[127.0, 2.5, -2.5, 3.5, -3.5, 0.5, -0.5, 1.49]]], device=device)
    want_q, want_s = quantize_int8_torch(x)
    assert want_q.flatten().tolist() == [127, 2, -2, 4, -4, 0, 0, 1] and want_s.item() == 1.0
    kc, vc = (torch.zeros(1, 1, 1, 8, dtype=torch.int8, device=device) for _ in "kv")
    ks, vs = (torch.zeros(1, 1, 1, device=device) for _ in "kv")
    idx = torch.zeros(1, dtype=torch.long, device=device)
    kv_write_int8_triton(x, x, kc, vc, ks, vs, idx, idx)
    assert_exact(kc[0, 0], want_q[0])
    assert ks.item() == 1.0


def test_kv_write_int8_rejects_bad_inputs(device, randn):
    _, (kc, vc, ks, vs) = _caches("paged", 2, 8, device)
    k = v = randn(3, 2, 8)
    idx = torch.zeros(3, dtype=torch.long, device=device)
    with pytest.raises(AssertionError, match="k_cache must be int8"):
        kv_write_int8_triton(k, v, kc.float(), vc, ks, vs, idx, idx)
    with pytest.raises(AssertionError, match="k_scale must be float32"):
        kv_write_int8_triton(k, v, kc, vc, ks.double(), vs, idx, idx)
    with pytest.raises(AssertionError, match="v_scale must be"):
        kv_write_int8_triton(k, v, kc, vc, ks, vs[:, :2], idx, idx)
    with pytest.raises(AssertionError, match="idx1 must be"):
        kv_write_int8_triton(k, v, kc, vc, ks, vs, idx, idx[:2])
