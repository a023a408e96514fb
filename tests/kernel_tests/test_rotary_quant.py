"""rotary_kv_write_quant: RoPE + the quantised K/V write in one kernel, int8 and e4m3
caches: bit for bit what the two kernels (rotary, kv_write_quant) store, close to the
torch reference, padding rows skipped, bad caches refused."""
import pytest
import torch

from infergraft.kernels.kv_write import kv_write_quant_triton
from infergraft.kernels.rotary import rotary_triton
from infergraft.kernels.rotary_quant import (rotary_kv_write_quant_torch,
                                             rotary_kv_write_quant_triton)

from .test_rotary import _cos_sin, decode_write_step
from .tolerances import assert_close, assert_exact

FP8 = torch.float8_e4m3fn


def _bits(x):
    return x.view(torch.uint8) if x.dtype == FP8 else x


def _caches(hkv, d, kv_dtype, device):
    """K, V (sentinel-filled) and their scales (-1) of a paged pool of 5 blocks of 4."""
    kv = [torch.full((5, 4, hkv, d), -96.0, device=device).to(kv_dtype) for _ in "kv"]
    return kv + [torch.full((5, 4, hkv), -1.0, device=device) for _ in "kv"]


@pytest.mark.parametrize("kv_dtype", [torch.int8, FP8], ids=["int8", "fp8"])
@pytest.mark.parametrize("d,r,hq,hkv", [(64, 64, 4, 2), (128, 64, 3, 1), (8, 8, 1, 1)])
@pytest.mark.parametrize("t", [1, 6])
def test_matches_the_two_kernels_and_the_reference(device, dtype, randn, gen, poisoned_empty,
                                                   t, d, r, hq, hkv, kv_dtype):
    qkv, q, k, v, cos, sin, positions, idx0, idx1 = decode_write_step(
        randn, gen, device, dtype, t, d, r, hq, hkv, scale=3)
    one, two, ref = (_caches(hkv, d, kv_dtype, device) for _ in range(3))
    qkv0 = qkv.clone()
    q_out = rotary_kv_write_quant_triton(q, k, v, cos, sin, positions, *one, idx0, idx1)
    q_two, k_two = rotary_triton(q, k, cos, sin, positions)
    kv_write_quant_triton(k_two, v, *two, idx0, idx1)
    q_ref = rotary_kv_write_quant_torch(q, k, v, cos, sin, positions, *ref, idx0, idx1)
    assert_exact(q_out, q_two, "q")
    for name, a, b in zip(("k_cache", "v_cache", "k_scale", "v_scale"), one, two):
        assert_exact(_bits(a), _bits(b), f"{name}: one kernel vs two")
    assert_close(q_out, q_ref, f"q T={t} D={d} R={r}")
    assert_close(one[2], ref[2], "k_scale vs the reference")
    assert_exact(_bits(one[1]), _bits(ref[1]), "v_cache (quantised v) vs the reference")
    deq = lambda c, s: c.float() * s[..., None]  # noqa: E731
    step = one[2][..., None] / (16 if kv_dtype == FP8 else 2) * 1.01 + 1e-3  # rounding apart
    assert ((deq(one[0], one[2]) - deq(ref[0], ref[2])).abs() <= 2 * step.clamp(min=0)).all()
    assert_exact(qkv, qkv0, "inputs modified")
    assert int((one[2] != -1).any(-1).sum()) == int((idx0 >= 0).sum())


def test_refuses_a_float_cache_and_bad_scales(device, randn):
    q, k, v = randn(2, 2, 8), randn(2, 1, 8), randn(2, 1, 8)
    cos, sin = _cos_sin(8, device)
    pos = idx = torch.zeros(2, dtype=torch.long, device=device)
    kc, vc, ks, vs = _caches(1, 8, FP8, device)
    with pytest.raises(AssertionError, match="k_cache must be int8 or float8_e4m3fn"):
        rotary_kv_write_quant_triton(q, k, v, cos, sin, pos, kc.float(), vc, ks, vs, idx, idx)
    with pytest.raises(AssertionError, match="v_scale must be float32"):
        rotary_kv_write_quant_triton(q, k, v, cos, sin, pos, kc, vc, ks, vs.half(), idx, idx)
