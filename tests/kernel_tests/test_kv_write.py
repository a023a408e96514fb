"""kv_write: Triton vs the torch reference, bit-exact, on contiguous and paged cache views."""
import pytest
import torch

from infergraft.kernels.kv_write import kv_write_torch, kv_write_triton

from .tolerances import assert_exact

SENTINEL = -3.25  # exactly representable in every float dtype, unlikely from randn


def _caches(layout, hkv, d, dtype, device):
    """Two sentinel-filled caches and their [N0, N1, Hkv, D] views."""
    if layout == "contiguous":  # [rows, Hkv, S, D] storage, indexed by (row, position)
        shape, perm = (3, hkv, 11, d), (0, 2, 1, 3)
    else:  # paged: [blocks, block_size, Hkv, D], indexed by (block, offset)
        shape, perm = (5, 4, hkv, d), (0, 1, 2, 3)
    caches = [torch.full(shape, SENTINEL, dtype=dtype, device=device) for _ in range(2)]
    return caches, [c.permute(*perm) for c in caches]


def _kv(randn, t, hkv, d, dtype, fused):
    if not fused:
        return randn(t, hkv, d, dtype=dtype), randn(t, hkv, d, dtype=dtype)
    qkv = randn(t, 4 * hkv * d, dtype=dtype)  # k, v as views of a fused qkv output
    return (qkv[:, 2 * hkv * d:3 * hkv * d].view(t, hkv, d),
            qkv[:, 3 * hkv * d:].view(t, hkv, d))


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("t,hkv,d,fused", [(0, 2, 8, False), (1, 1, 64, False),
                                           (5, 3, 24, True), (9, 2, 128, False)])
def test_kv_write_matches_reference(device, dtype, randn, gen, t, hkv, d, fused, layout, index_dtype):
    (kc, vc), (kv_view, vv_view) = _caches(layout, hkv, d, dtype, device)
    (kc_ref, vc_ref), (kr_view, vr_view) = _caches(layout, hkv, d, dtype, device)
    n0, n1 = kv_view.shape[:2]
    # T distinct slots (duplicates would make the write order observable)
    slots = torch.randperm(n0 * n1, generator=gen)[:t]
    idx0, idx1 = (slots // n1).to(device, index_dtype), (slots % n1).to(device, index_dtype)
    k, v = _kv(randn, t, hkv, d, dtype, fused)
    k0, v0 = k.clone(), v.clone()

    assert kv_write_triton(k, v, kv_view, vv_view, idx0, idx1) is None
    kv_write_torch(k, v, kr_view, vr_view, idx0, idx1)

    assert_exact(kc, kc_ref, "k_cache")
    assert_exact(vc, vc_ref, "v_cache")
    written = torch.zeros(n0, n1, dtype=torch.bool, device=device)
    written[idx0.long(), idx1.long()] = True
    for name, view in (("k_cache", kv_view), ("v_cache", vv_view)):
        assert (view[~written] == SENTINEL).all(), f"{name}: a slot not indexed was modified"
    assert_exact(k, k0, "k modified")
    assert_exact(v, v0, "v modified")


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_kv_write_skips_rows_with_negative_index(device, dtype, randn, gen, layout):
    # padding rows of a captured prefill carry idx0 = -1: they must not land anywhere
    # (not even at index -1, which torch indexing would wrap to the last block)
    (kc, vc), views = _caches(layout, 2, 16, dtype, device)
    (kc_ref, vc_ref), ref_views = _caches(layout, 2, 16, dtype, device)
    n0, n1 = views[0].shape[:2]
    slots = torch.randperm(n0 * n1, generator=gen)[:7]
    idx0, idx1 = slots // n1, slots % n1
    pad = torch.tensor([1, 4, 5])  # rows written nowhere
    idx0[pad] = -1
    idx0, idx1 = idx0.to(device), idx1.to(device)
    k, v = randn(7, 2, 16, dtype=dtype), randn(7, 2, 16, dtype=dtype)
    kv_write_triton(k, v, *views, idx0, idx1)
    kv_write_torch(k, v, *ref_views, idx0, idx1)
    assert_exact(kc, kc_ref, "k_cache")
    assert_exact(vc, vc_ref, "v_cache")
    live = idx0 >= 0
    written = torch.zeros(n0, n1, dtype=torch.bool, device=device)
    written[idx0[live].long(), idx1[live].long()] = True
    assert int(written.sum()) == 4
    for name, view in (("k_cache", views[0]), ("v_cache", views[1])):
        assert (view[~written] == SENTINEL).all(), f"{name}: a padding row was written"
    assert_exact(views[0][idx0[live].long(), idx1[live].long()], k[live], "live k rows")


def test_kv_write_casts_to_cache_dtype(device, randn, gen):
    # float32 activations into a float16 cache: same rounding as torch's .to()
    (kc, vc), views = _caches("paged", 2, 16, torch.float16, device)
    (kc_ref, vc_ref), ref_views = _caches("paged", 2, 16, torch.float16, device)
    k, v = randn(6, 2, 16) * 100, randn(6, 2, 16)
    slots = torch.randperm(20, generator=gen)[:6].to(device)
    idx0, idx1 = slots // 4, slots % 4
    kv_write_triton(k, v, *views, idx0, idx1)
    kv_write_torch(k, v, *ref_views, idx0, idx1)
    assert_exact(kc, kc_ref, "k_cache")
    assert_exact(vc, vc_ref, "v_cache")


def test_kv_write_rejects_bad_inputs(device, randn):
    (_, _), (kcv, vcv) = _caches("paged", 2, 8, torch.float32, device)
    k = v = randn(3, 2, 8)
    idx = torch.zeros(3, dtype=torch.long, device=device)
    with pytest.raises(AssertionError, match="k_cache must be"):
        kv_write_triton(k, v, kcv[..., :4], vcv, idx, idx)
    with pytest.raises(AssertionError, match="int32 or int64"):
        kv_write_triton(k, v, kcv, vcv, idx.float(), idx)
    with pytest.raises(AssertionError, match="idx1 must be"):
        kv_write_triton(k, v, kcv, vcv, idx, idx[:2])
    with pytest.raises(AssertionError, match="contiguous in its last dim"):
        kv_write_triton(k, v, kcv.transpose(2, 3).contiguous().transpose(2, 3), vcv, idx, idx)
