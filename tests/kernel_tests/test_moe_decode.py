"""moe_decode: the fused decode layer's mixture of experts at few rows (norm, router,
top-k, each pair's SwiGLU, the weighted sum and the residual add in three kernels) vs
its torch reference, which composes rms_norm, the router, ``route`` and
``fused_moe_torch``; and the grouped kernels' residual add for the fused layer."""
import pytest
import torch

import infergraft.kernels.moe_decode as M
from infergraft.kernels.fused_moe import fused_moe_torch, fused_moe_triton
from infergraft.kernels.moe_decode import (moe_decode_torch, moe_decode_triton, route,
                                           takes_pair_path)

from infergraft.kernels._triton import HAVE_TRITON, tl, triton

from .tolerances import assert_close

if HAVE_TRITON:

    @triton.jit
    def _top_k_probe(logits_ptr, ids_ptr, E, E_POW2: tl.constexpr, TOP_K: tl.constexpr,
                     K_POW2: tl.constexpr):
        # a row's routing as the gate_up and down kernels compute it, its ids stored
        row = tl.program_id(0)
        ids, _ = M._top_k(logits_ptr + row * E, E, E_POW2, TOP_K, K_POW2, True)
        slots = tl.arange(0, K_POW2)
        tl.store(ids_ptr + row * TOP_K + slots, ids, mask=slots < TOP_K)

# small tiles, and the down kernel's routing before its PDL wait (DOWN_EARLY)
SMALL_TILES = dict(ROUTE_E=4, ROUTE_K=16, GATE_UP_N=8, GATE_UP_K=16, DOWN_N=8, DOWN_K=16,
                   DOWN_EARLY=True)


def _inputs(randn, t, e, h, i, dtype, parts=3):
    """A stream, its sums of squares split into ``parts`` partials, and the weights."""
    stream = randn(t, h, dtype=dtype)
    total = stream.float().square().sum(-1)
    sum_sq = torch.stack([total * (j + 1) / (parts * (parts + 1) / 2) for j in range(parts)])
    norm_weight = (1 + 0.2 * randn(h)).to(dtype)
    router = randn(e, h, dtype=dtype) * (2 / h ** 0.5)
    return (stream, sum_sq.contiguous(), norm_weight, 1e-5, router,
            randn(e, 2 * i, h, dtype=dtype) / h ** 0.5, randn(e, h, i, dtype=dtype) / i ** 0.5)


# (T, E, k, H, I, renormalize): one token of Mixtral's top-2 of 8 and of a top-4 of 16
# (Qwen3-MoE's shape, smaller), several tokens, odd sizes with partial tiles, top-1
@pytest.mark.parametrize("t,e,k,h,i,renorm", [(1, 8, 2, 64, 32, True), (1, 16, 4, 48, 40, False),
                                              (3, 6, 3, 40, 24, True), (2, 5, 1, 24, 56, False)])
@pytest.mark.parametrize("tiles", [None, SMALL_TILES], ids=["default", "small"])
def test_moe_decode_matches_reference(device, dtype, randn, poisoned_empty, t, e, k, h, i,
                                      renorm, tiles):
    args = _inputs(randn, t, e, h, i, dtype)
    before = [a.clone() if torch.is_tensor(a) else a for a in args]
    out, sum_sq = moe_decode_triton(*args, k, renorm, tiles=tiles)
    want, want_sq = moe_decode_torch(*args, k, renorm)
    assert out.shape == (t, h) and out.dtype == dtype
    assert_close(out, want, f"T={t} E={e} k={k} H={h} I={i}")
    # a partial sum for each block of H a program stores; together the new stream's
    assert sum_sq.dtype == torch.float32 and sum_sq.shape[1] == t
    torch.testing.assert_close(sum_sq.sum(0, keepdim=True), want_sq, rtol=1e-3, atol=1e-3)
    assert all(torch.equal(a, b) for a, b in zip(args, before) if torch.is_tensor(a))
    assert moe_decode_triton(*args, k, renorm, want_sum_sq=False, tiles=tiles)[1] is None


def test_the_reference_is_the_norm_router_and_experts_written_out(device, randn):
    from infergraft.kernels.rms_norm import rms_norm_torch

    stream, sum_sq, g, eps, router, wgu, wd = _inputs(randn, 3, 6, 32, 16, torch.float32)
    x = rms_norm_torch(stream, g, eps)
    weights, ids = route(x @ router.T, 2, True)
    out, _ = moe_decode_torch(stream, sum_sq, g, eps, router, wgu, wd, 2, True)
    torch.testing.assert_close(out, stream + fused_moe_torch(x, wgu, wd, weights, ids),
                               atol=1e-5, rtol=1e-5)


def test_only_the_routed_experts_weights_are_read(device, randn):
    """One token: the experts its router does not pick hold NaN, and change nothing."""
    args = list(_inputs(randn, 1, 8, 32, 16, torch.float32))
    want, _ = moe_decode_torch(*args, 2, True)
    x = M._normed(*args[:4])
    _, ids = route(x @ args[4].T, 2, True)
    idle = [j for j in range(8) if j not in ids.flatten().tolist()]
    args[5][idle], args[6][idle] = float("nan"), float("nan")
    got, _ = moe_decode_triton(*args, 2, True, tiles=SMALL_TILES)
    assert torch.isfinite(got).all()
    assert_close(got, want)


@pytest.mark.parametrize("e,k", [(128, 8), (6, 2)])
def test_routing_of_a_row_of_no_token_picks_experts_that_exist(device, randn, e, k):
    """Rows whose logits are NaN or infinite (a CUDA graph's capture runs attention over no
    keys: NaN) still route to k distinct experts in [0, E): an id past the last expert
    read past the weights (an illegal address on the GPU, at Qwen3-30B-A3B's capture).
    Finite rows route as ``route`` does."""
    nan, inf = float("nan"), float("inf")
    rows = [torch.full((e,), nan), torch.full((e,), -inf), torch.full((e,), inf),
            randn(e, dtype=torch.float32).cpu(), randn(e, dtype=torch.float32).cpu()]
    rows[3][1] = nan  # one NaN among finite logits: never picked
    logits = torch.stack(rows).to(device)
    ids = torch.full((len(rows), k), -1, dtype=torch.int32, device=device)
    _top_k_probe[(len(rows),)](logits, ids, e, E_POW2=M.next_pow2(e), TOP_K=k,
                               K_POW2=max(2, M.next_pow2(k)))
    got = ids.cpu()
    assert ((got >= 0) & (got < e)).all(), got
    assert all(len(set(r.tolist())) == k for r in got), got
    assert 1 not in got[3].tolist()
    finite = logits[3].clone()
    finite[1] = -inf
    assert got[3].tolist() == route(finite[None], k, True)[1][0].tolist()
    assert got[4].tolist() == route(logits[4:5], k, True)[1][0].tolist()


def test_bad_inputs_say_what_is_accepted(device, randn):
    args = list(_inputs(randn, 2, 4, 16, 8, torch.float32))
    with pytest.raises(AssertionError, match=r"w_down must be contiguous .*\(4, 16, 8\)"):
        moe_decode_triton(*args[:6], args[6][:, :, :4], 2, True)
    with pytest.raises(AssertionError, match="8-bit experts take the grouped kernels"):
        moe_decode_triton(*args[:5], args[5].half(), args[6], 2, True)
    with pytest.raises(AssertionError, match="top_k must be in"):
        moe_decode_triton(*args, 5, True)


def test_the_pair_path_where_pairs_hardly_share_experts(monkeypatch):
    monkeypatch.setattr(M, "DECODE_MAX_ROWS", 8)
    assert takes_pair_path(1, 8, 2) and takes_pair_path(1, 128, 8)  # one token: always
    assert not takes_pair_path(2, 8, 2)  # Mixtral: two tokens often share an expert
    assert takes_pair_path(4, 128, 8) and not takes_pair_path(8, 128, 8)  # Qwen3-30B-A3B
    assert not takes_pair_path(0, 128, 8)
    monkeypatch.setattr(M, "DECODE_MAX_ROWS", 0)  # INFERGRAFT_MOE_DECODE_ROWS=0: never
    assert not takes_pair_path(1, 128, 8)


@pytest.mark.parametrize("sum_sq", [True, False])
def test_grouped_kernels_add_the_output_to_the_stream(device, dtype, gen, randn, sum_sq):
    """The fused layer's rows past the pair path: the grouped kernels' last kernel adds
    the stream and stores the new stream's partial sums of squares."""
    t, e, k, h, i = 5, 6, 2, 40, 24
    x, residual = randn(t, h, dtype=dtype), randn(t, h, dtype=dtype)
    wgu, wd = randn(e, 2 * i, h, dtype=dtype) / h ** 0.5, randn(e, h, i, dtype=dtype) / i ** 0.5
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).to(device)
    weights = torch.rand(ids.shape, generator=gen).to(device)
    out, parts = fused_moe_triton(x, wgu, wd, weights, ids, residual=residual, sum_sq=sum_sq)
    want, want_sq = fused_moe_torch(x, wgu, wd, weights, ids, residual=residual, sum_sq=sum_sq)
    assert_close(out, want)
    assert_close(want, residual + fused_moe_torch(x, wgu, wd, weights, ids))
    if sum_sq:
        torch.testing.assert_close(parts.sum(0, keepdim=True), want_sq, rtol=1e-3, atol=1e-3)
    else:
        assert parts is None and want_sq is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [(128, 8, 2048, 768), (8, 2, 4096, 1024)],
                         ids=["qwen3-30b-a3b", "mixtral-narrow"])
def test_moe_decode_replays_in_a_cuda_graph(shape):
    """Captured once with the real shapes (bf16), replayed on new streams that route to
    other experts: no host sync inside, the reference's result each time."""
    e, k, h, i = shape
    g = torch.Generator().manual_seed(0)

    def randn(*s, dtype=torch.float32):
        return torch.randn(*s, generator=g).to("cuda", dtype)

    args = _inputs(randn, 1, e, h, i, torch.bfloat16)
    moe_decode_triton(*args, k, True)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, sum_sq = moe_decode_triton(*args, k, True)
    for _ in range(3):
        fresh = randn(1, h, dtype=torch.bfloat16)
        args[0].copy_(fresh)
        args[1].copy_(torch.stack([fresh.float().square().sum(-1)] + [
            torch.zeros(1, device="cuda")] * (args[1].shape[0] - 1)))
        graph.replay()
        want, want_sq = moe_decode_torch(*args, k, True)
        assert_close(out, want)
        torch.testing.assert_close(sum_sq.sum(0, keepdim=True), want_sq, rtol=1e-2, atol=1e-2)
