"""The fused decode GEMMs over an int4 weight (kernels/int4_fused.py through
fused_linear's entry points) against the torch references (dequantise, then the
composition: the norm with its weight, the GEMM, RoPE + the K/V write, SiLU * up, the
residual add and the next norm's sums of squares) on fresh random inputs: 1-8 rows on
the fused kernel (default tiles, and small ones spanning several groups or a fraction of
one, split-K summed by the last split), 16 and 32 rows composed, groups 128 / 64 / 32, odd
K, a partial last group, an act order's perm, and the split-K counters left at zero."""
import attrs
import pytest
import torch

from infergraft.kernels import fused_linear as FL
from infergraft.kernels import int4_fused
from infergraft.kernels.int4_linear import quantize_int4
from infergraft.kernels.paged_plan import CounterPool

from .test_rotary import MAX_POS, _cos_sin
from .tolerances import TOLERANCES

# tiles: the defaults (int4_gemv's), a K tile below the group split 3 ways, one spanning
# several groups split 2 ways with the release after the loop
TILES = [None, dict(BLOCK_N=16, BLOCK_K=32, SPLIT=3, num_warps=2, num_stages=1, EARLY=True),
         dict(BLOCK_N=32, BLOCK_K=128, SPLIT=2, num_warps=4, num_stages=1, EARLY=False)]
# (m, n, k, group, tiles): K of a partial last group (576 = 4.5 x 128) and odd (577)
CASES = [(1, 48, 576, 128, 0), (1, 48, 576, 128, 1), (2, 40, 577, 64, 2), (3, 64, 256, 32, 1),
         (8, 48, 320, 64, 0), (8, 48, 320, 64, 2)]


def _int4(randn, n, k, group, perm=False):
    w = quantize_int4(randn(n, k) / k ** 0.5, group)
    return attrs.evolve(w, perm=torch.randperm(k).to(w.qweight.device)) if perm else w


def _sum_sq(x, parts=3):
    # x [M, K] -> its sum of squares per row as ``parts`` partial sums [P, M] float32
    return torch.stack([c.float().square().sum(1) for c in x.chunk(parts, dim=1)]).contiguous()


def _inputs(randn, m, k, dtype):
    x = randn(m, k, dtype=dtype)
    return x, _sum_sq(x), (randn(k).abs() + 0.5).to(dtype)  # x, its sums, the norm weight


def _close(got, ref, dtype, what, normed=False):
    # ``normed``: the kernel keeps rms_norm(x, g) in float32 where the reference rounds it
    # to x's dtype twice (x / rms, then times g): a few ulps more than TOLERANCES' one
    tol = dict(atol=5e-3, rtol=5e-3) if normed and dtype is not torch.float32 else \
        TOLERANCES[dtype]
    torch.testing.assert_close(got, ref, **tol, msg=lambda e: f"{what}\n{e}")


@pytest.mark.parametrize("m,n,k,group,tiles", CASES)
def test_fused_int4_gemms_match_the_references(device, dtype, randn, poisoned_empty, m, n, k,
                                               group, tiles):
    x, ss, g = _inputs(randn, m, k, dtype)
    w, r = _int4(randn, n, k, group, perm=m == 2), randn(m, n, dtype=dtype)
    b = randn(n, dtype=dtype) if m % 2 else None
    cfg, counters = TILES[tiles], CounterPool()
    for name, args, kw in (("normed_linear", (ss, 1e-5), dict(norm=g)),
                           ("normed_linear", (ss, 1e-5), {}),  # a unit norm weight
                           ("normed_swiglu", (ss, 1e-5), dict(norm=g)),
                           ("linear_residual", (r, True), {}), ("linear_residual", (r, False), {})):
        got = getattr(FL, f"{name}_triton")(x, w, b, *args, **kw, config=cfg, counters=counters)
        ref = getattr(FL, f"{name}_torch")(x, w, b, *args, **kw)
        if name == "linear_residual" and args[1]:  # (y, partial sums): compare the sums
            _close(got[1].sum(0), ref[1].sum(0), torch.float32 if dtype is torch.float32
                   else torch.float16, f"{name} sums")
            got, ref = got[0], ref[0]
        _close(got, ref, dtype, f"{name} {kw.keys()}", normed=name != "linear_residual")
    assert not counters.get(x.device, 1).any()  # every split-K counter back at zero


@pytest.mark.parametrize("m,group,head_dim,tiles", [(1, 128, 64, 0), (3, 32, 32, 1),
                                                    (8, 64, 64, 2), (2, 64, 96, 0)])
def test_fused_int4_qkv_rope_writes_k_v_and_rotates_q(device, dtype, randn, monkeypatch, m,
                                                      group, head_dim, tiles):
    """RoPE and the K/V write in the epilogue (head_dim 96: tiles of 16 dims, a power of two
    dividing 48), rows with idx0 < 0 written nowhere, against normed_linear + rotary_kv_write."""
    from infergraft.kernels import int4_fused_ops

    def unfused(*a, **kw):
        raise AssertionError("took the unfused composition")
    monkeypatch.setattr(int4_fused_ops, "rotary_kv_write_triton", unfused)  # one kernel only
    hq, hkv, k = 4, 2, 192
    x, ss, g = _inputs(randn, m, k, dtype)
    w = _int4(randn, (hq + 2 * hkv) * head_dim, k, group, perm=m == 3)
    cos, sin = _cos_sin(head_dim, device)
    positions = torch.randint(0, MAX_POS, (m,)).to(device)
    caches = [torch.zeros(5, 4, hkv, head_dim, dtype=dtype, device=device) for _ in range(4)]
    idx0 = torch.tensor([3, -1, 1, 0, 2, 4, 1, 0][:m], device=device)
    idx1 = torch.tensor([1, 0, 3, 2, 0, 1, 2, 3][:m], device=device)
    got = FL.normed_qkv_rope_triton(x, w, None, ss, 1e-5, cos, sin, positions, hq, *caches[:2],
                                    idx0, idx1, norm=g, config=TILES[tiles])
    ref = FL.normed_qkv_rope_torch(x, w, None, ss, 1e-5, cos, sin, positions, hq, *caches[2:],
                                   idx0, idx1, norm=g)
    _close(got, ref, dtype, "q", normed=True)
    _close(caches[0], caches[2], dtype, "k cache", normed=True)
    _close(caches[1], caches[3], dtype, "v cache", normed=True)
    assert caches[0].abs().sum() > 0


@pytest.mark.parametrize("m", [16, 32])
def test_more_rows_than_the_kernel_takes_compose(device, randn, monkeypatch, m):
    """16 and 32 rows: the norm, the int4 GEMM of that many rows (its tiles; int4_mma
    under INFERGRAFT_QUANT_MMA from 16) and the unfused ops, never the fused kernel."""
    monkeypatch.setattr(int4_fused, "_int4_fused_kernel", None)  # a call would fail
    x, ss, g = _inputs(randn, m, 128, torch.float16)
    w, r = _int4(randn, 64, 128, 128), randn(m, 64, dtype=torch.float16)
    for mma in (False, True):
        got = FL.normed_swiglu_triton(x, w, None, ss, 1e-5, norm=g, mma=mma)
        _close(got, FL.normed_swiglu_torch(x, w, None, ss, 1e-5, norm=g), torch.float16,
               "swiglu", normed=True)
        got = FL.linear_residual_triton(x, w, None, r, mma=mma)
        _close(got, FL.linear_residual_torch(x, w, None, r), torch.float16, "residual")


def test_a_graph_capture_without_counters_takes_one_split(device, randn, monkeypatch):
    """Where the counter pool has none to give (it would grow inside a CUDA graph
    capture), the kernel runs unsplit: the same results, no counter read."""
    x, ss, g = _inputs(randn, 1, 576, torch.float16)
    w = _int4(randn, 48, 576, 64)
    ref = FL.normed_linear_triton(x, w, None, ss, 1e-5, norm=g, config=TILES[1])
    splits = []
    kernel = int4_fused._int4_fused_kernel
    monkeypatch.setattr(CounterPool, "get", lambda self, device, n: None)
    monkeypatch.setattr(int4_fused, "_int4_fused_kernel", type("K", (), {
        "__getitem__": lambda self, grid: splits.append(grid[1]) or kernel[grid]})())
    got = FL.normed_linear_triton(x, w, None, ss, 1e-5, norm=g, config=TILES[1])
    assert splits == [1]
    _close(got, ref, torch.float16, "unsplit", normed=True)


def test_a_norm_weight_for_a_folded_weight_is_refused(device, randn):
    x, ss, g = _inputs(randn, 1, 32, torch.float16)
    with pytest.raises(AssertionError, match="folded in, not as norm"):
        FL.normed_linear_triton(x, randn(16, 32, dtype=torch.float16), None, ss, 1e-5, norm=g)
