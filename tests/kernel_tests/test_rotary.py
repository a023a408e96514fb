"""rotary: Triton vs the torch reference, incl. partial rotary, GQA and fused-qkv views."""
import pytest
import torch

from infergraft.kernels.rotary import rotary_torch, rotary_triton

from .tolerances import assert_close, assert_exact

MAX_POS = 50


def _cos_sin(rot_dim, device, base=10000.0):
    """cos/sin: [MAX_POS, R/2] float32, as a model's rotary cache."""
    inv_freq = 1.0 / base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim)
    freqs = torch.outer(torch.arange(MAX_POS, dtype=torch.float32), inv_freq)
    return freqs.cos().to(device), freqs.sin().to(device)


def _qk(randn, t, hq, hkv, d, dtype, layout):
    """q: [T, Hq, D], k: [T, Hkv, D] as the attention layer would hand them over."""
    if layout == "separate":
        return randn(t, hq, d, dtype=dtype), randn(t, hkv, d, dtype=dtype)
    if layout == "fused_qkv":  # views into one [T, (Hq + 2*Hkv) * D] projection output
        qkv = randn(t, (hq + 2 * hkv) * d, dtype=dtype)
        return (qkv[:, :hq * d].view(t, hq, d),
                qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d))
    # head_major: [H, T, D] storage seen as [T, H, D] (token stride D, head stride T*D)
    return (randn(hq, t, d, dtype=dtype).transpose(0, 1),
            randn(hkv, t, d, dtype=dtype).transpose(0, 1))


# (D, R, Hq, Hkv): full rotary, partial rotary (R < D), MHA and GQA, odd head counts
CONFIGS = [(8, 8, 1, 1), (64, 64, 4, 1), (64, 32, 3, 3), (128, 128, 4, 4), (128, 64, 3, 1)]


@pytest.mark.parametrize("layout", ["separate", "fused_qkv", "head_major"])
@pytest.mark.parametrize("d,r,hq,hkv", CONFIGS)
@pytest.mark.parametrize("t", [1, 7])
def test_rotary_matches_reference(device, dtype, randn, gen, poisoned_empty, t, d, r, hq, hkv, layout):
    q, k = _qk(randn, t, hq, hkv, d, dtype, layout)
    cos, sin = _cos_sin(r, device)
    positions = torch.randint(0, MAX_POS, (t,), generator=gen).to(device)
    q0, k0 = q.clone(), k.clone()
    q_out, k_out = rotary_triton(q, k, cos, sin, positions)
    q_ref, k_ref = rotary_torch(q, k, cos, sin, positions)
    assert q_out.is_contiguous() and k_out.is_contiguous()
    assert_close(q_out, q_ref, f"q T={t} D={d} R={r} Hq={hq} {layout}")
    assert_close(k_out, k_ref, f"k T={t} D={d} R={r} Hkv={hkv} {layout}")
    # dims beyond R pass through bit-for-bit
    assert_exact(q_out[..., r:], q0[..., r:], "q pass-through dims")
    assert_exact(k_out[..., r:], k0[..., r:], "k pass-through dims")
    assert_exact(q, q0, "q modified")
    assert_exact(k, k0, "k modified")


def test_rotary_random_cos_sin_and_int32_positions(device, randn, gen, poisoned_empty):
    # arbitrary (non-trigonometric) tables catch swapped cos/sin or a wrong sign
    t, hq, hkv, d, r = 5, 3, 1, 16, 12
    q, k = randn(t, hq, d), randn(t, hkv, d)
    cos, sin = randn(MAX_POS, r // 2), randn(MAX_POS, r // 2)
    positions = torch.randint(0, MAX_POS, (t,), generator=gen).to(device)
    out = rotary_triton(q, k, cos, sin, positions.int())
    for a, b in zip(out, rotary_torch(q, k, cos, sin, positions)):
        assert_close(a, b)


def test_rotary_empty_tokens(device, randn):
    cos, sin = _cos_sin(8, device)
    q, k = rotary_triton(randn(0, 2, 8), randn(0, 1, 8), cos, sin,
                         torch.zeros(0, dtype=torch.long, device=device))
    assert q.shape == (0, 2, 8) and k.shape == (0, 1, 8)


def test_rotary_rejects_bad_inputs(device, randn):
    q, k, pos = randn(2, 2, 8), randn(2, 1, 8), torch.zeros(2, dtype=torch.long, device=device)
    cos, sin = _cos_sin(8, device)
    with pytest.raises(AssertionError, match="exceed head dim"):
        rotary_triton(q, k, *_cos_sin(16, device), pos)
    with pytest.raises(AssertionError, match="float32"):
        rotary_triton(q, k, cos.half(), sin.half(), pos)
    with pytest.raises(AssertionError, match="contiguous in its last dim"):
        rotary_triton(randn(2, 8, 2).transpose(1, 2), k, cos, sin, pos)
    with pytest.raises(AssertionError, match="does not match"):
        rotary_triton(q, randn(2, 1, 4), cos, sin, pos)


def decode_write_step(randn, gen, device, dtype, t, d, r, hq, hkv, scale=1.0):
    """(qkv, q, k, v, cos, sin, positions, idx0, idx1) of T tokens: q, k, v views of one
    fused projection, random positions, distinct slots of a 5 x 4 paged pool with token 1
    a padding row (idx0 = -1, written nowhere)."""
    qkv = randn(t, (hq + 2 * hkv) * d, dtype=dtype) * scale
    q = qkv[:, :hq * d].view(t, hq, d)
    k = qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
    v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
    cos, sin = _cos_sin(r, device)
    positions = torch.randint(0, MAX_POS, (t,), generator=gen).to(device)
    slots = torch.randperm(5 * 4, generator=gen)[:t]
    idx0, idx1 = slots // 4, slots % 4
    if t > 1:
        idx0[1] = -1
    return qkv, q, k, v, cos, sin, positions, idx0.to(device), idx1.to(device)


@pytest.mark.parametrize("d,r,hq,hkv", [(64, 64, 4, 2), (128, 64, 3, 1), (8, 8, 1, 1)])
@pytest.mark.parametrize("t", [1, 6])
def test_rotary_kv_write_matches_reference(device, dtype, randn, gen, poisoned_empty, t, d, r,
                                           hq, hkv):
    # RoPE on q (returned) and k, with k and v written to paged cache slots in one kernel;
    # idx0 = -1 rows (padding) are skipped like kv_write's
    from infergraft.kernels.rotary import rotary_kv_write_torch, rotary_kv_write_triton

    qkv, q, k, v, cos, sin, positions, idx0, idx1 = decode_write_step(
        randn, gen, device, dtype, t, d, r, hq, hkv)
    caches = [torch.full((5, 4, hkv, d), -3.25, dtype=dtype, device=device) for _ in range(4)]
    qkv0 = qkv.clone()
    q_out = rotary_kv_write_triton(q, k, v, cos, sin, positions, caches[0], caches[1], idx0, idx1)
    q_ref = rotary_kv_write_torch(q, k, v, cos, sin, positions, caches[2], caches[3], idx0, idx1)
    assert q_out.shape == (t, hq, d)
    assert_close(q_out, q_ref, f"q T={t} D={d} R={r}")
    assert_close(caches[0], caches[2], "k_cache (rotated k)")
    assert_exact(caches[1], caches[3], "v_cache (copied v)")
    assert_exact(qkv, qkv0, "inputs modified")
    assert int((caches[1] != -3.25).any(-1).any(-1).sum()) == int((idx0 >= 0).sum())
