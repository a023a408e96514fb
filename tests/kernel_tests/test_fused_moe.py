"""fused_moe: the grouped-GEMM Triton kernels vs the torch reference (a loop over the
experts), and the reference vs the MoE MLP written out token by token."""
import pytest
import torch
import torch.nn.functional as F

from infergraft.kernels.fused_moe import (fused_moe_torch, fused_moe_triton, moe_blocks,
                                          tile_bound)

from .tolerances import assert_close


def _routing(t, e, k, gen, device, ids=None):
    """topk ids (k distinct experts a token, as torch.topk gives them) and weights."""
    if ids is None:
        ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]) \
            if t else torch.empty((0, k), dtype=torch.int64)
    weights = torch.rand(ids.shape, generator=gen)
    return weights.to(device), ids.to(device)


def _experts(randn, e, h, i, dtype):
    return randn(e, 2 * i, h, dtype=dtype) / h ** 0.5, randn(e, h, i, dtype=dtype) / i ** 0.5


def _by_hand(x, w_gate_up, w_down, weights, ids):
    """Each token's k experts one at a time, in float32."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (w_gate_up[e].float() @ x[t].float()).chunk(2)
            out[t] += float(weights[t, j]) * (w_down[e].float() @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("sync_free", [False, True])
def test_the_reference_is_the_moe_mlp_written_out(device, gen, randn, sync_free):
    """Both loops: over the experts with tokens (the CPU's), and over every expert with a
    mask (off the CPU, where a graph may capture it)."""
    x = randn(9, 24)
    w_gate_up, w_down = _experts(randn, 5, 24, 12, torch.float32)
    weights, ids = _routing(9, 5, 2, gen, device)
    got = fused_moe_torch(x, w_gate_up, w_down, weights, ids, sync_free=sync_free)
    want = _by_hand(*(t.cpu() for t in (x, w_gate_up, w_down, weights, ids)))
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)


# (T, E, k, H, I): one token (decode), odd sizes that leave partial tiles in every
# dimension, and an expert with more rows than one 16-row tile
@pytest.mark.parametrize("t,e,k,h,i", [(1, 8, 2, 64, 32), (5, 6, 2, 40, 24), (23, 4, 3, 32, 48),
                                       (37, 3, 1, 48, 16)])
def test_fused_moe_matches_reference(device, dtype, gen, randn, poisoned_empty, t, e, k, h, i):
    x = randn(t, h, dtype=dtype)
    w_gate_up, w_down = _experts(randn, e, h, i, dtype)
    weights, ids = _routing(t, e, k, gen, device)
    x0 = x.clone()
    out = fused_moe_triton(x, w_gate_up, w_down, weights, ids)
    assert out.shape == (t, h) and out.dtype == dtype
    assert_close(out, fused_moe_torch(x, w_gate_up, w_down, weights, ids),
                 f"T={t} E={e} k={k} H={h} I={i} {dtype}")
    assert torch.equal(x, x0)


@pytest.mark.parametrize("blocks", [dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16),
                                    dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=16)])
def test_tiles_of_every_size_cover_the_segments(device, gen, randn, poisoned_empty, blocks):
    # every token on expert 2 but one: a segment of several tiles beside one of a single row
    t, e, h, i = 40, 4, 32, 40
    ids = torch.full((t, 1), 2)
    ids[7, 0] = 0
    x = randn(t, h)
    w_gate_up, w_down = _experts(randn, e, h, i, torch.float32)
    weights, ids = _routing(t, e, 1, gen, device, ids)
    assert_close(fused_moe_triton(x, w_gate_up, w_down, weights, ids, blocks=blocks),
                 fused_moe_torch(x, w_gate_up, w_down, weights, ids))


@pytest.mark.parametrize("op", [fused_moe_torch, fused_moe_triton])
def test_only_the_routed_experts_weights_are_read(device, gen, randn, op):
    """The experts no token routes to hold NaN: the output is finite and unchanged."""
    t, e, k, h, i = 1, 8, 2, 32, 16
    x = randn(t, h)
    w_gate_up, w_down = _experts(randn, e, h, i, torch.float32)
    weights, ids = _routing(t, e, k, gen, device)
    want = fused_moe_torch(x, w_gate_up, w_down, weights, ids)
    idle = [j for j in range(e) if j not in ids.flatten().tolist()]
    w_gate_up[idle], w_down[idle] = float("nan"), float("nan")
    got = op(x, w_gate_up, w_down, weights, ids)  # (on the CPU: the loop over routed experts)
    assert torch.isfinite(got).all()
    assert_close(got, want)


@pytest.mark.parametrize("qdtype", ["int8", "fp8"])
def test_eight_bit_expert_rows_with_their_scales(device, dtype, gen, randn, qdtype):
    """Expert weights as 8-bit rows and a float32 scale a row (``Quantizer.scaled_rows``)."""
    from infergraft.kernels.fp8_linear import quantize_fp8
    from infergraft.kernels.int8_linear import quantize_int8

    quantize = quantize_int8 if qdtype == "int8" else quantize_fp8
    t, e, k, h, i = 6, 4, 2, 48, 32
    x = randn(t, h, dtype=dtype)
    w_gate_up, w_down = _experts(randn, e, h, i, torch.float32)
    (qgu, sgu), (qd, sd) = (quantize(w.reshape(-1, w.shape[-1])) for w in (w_gate_up, w_down))
    qgu, qd = qgu.view(e, 2 * i, h), qd.view(e, h, i)
    sgu, sd = sgu.view(e, 2 * i), sd.view(e, h)
    weights, ids = _routing(t, e, k, gen, device)
    got = fused_moe_triton(x, qgu, qd, weights, ids, sgu, sd)
    assert_close(got, fused_moe_torch(x, qgu, qd, weights, ids, sgu, sd), f"{qdtype} {dtype}")
    # the scales are applied: the result is the float weights' within 8-bit rounding
    dense = fused_moe_torch(x.float(), w_gate_up, w_down, weights, ids)
    assert float((got.float() - dense).abs().max() / dense.abs().max()) < 0.1


def test_e4m3_experts_where_triton_cannot_load_e4m3(device, gen, randn, monkeypatch):
    """Before sm_89 Triton loads no e4m3: the reference's sync-free loop runs instead."""
    import infergraft.kernels.fused_moe as M
    from infergraft.kernels.fp8_linear import quantize_fp8

    t, e, k, h, i = 3, 4, 2, 32, 16
    x = randn(t, h)
    w_gate_up, w_down = _experts(randn, e, h, i, torch.float32)
    (qgu, sgu), (qd, sd) = (quantize_fp8(w.reshape(-1, w.shape[-1])) for w in (w_gate_up, w_down))
    args = (x, qgu.view(e, 2 * i, h), qd.view(e, h, i), *_routing(t, e, k, gen, device),
            sgu.view(e, 2 * i), sd.view(e, h))
    calls = []
    monkeypatch.setattr(M, "fp8_native", lambda dev: False)
    monkeypatch.setattr(M, "fused_moe_torch", lambda *a, **kw: calls.append(kw) or
                        fused_moe_torch(*a, **kw))
    assert_close(M.fused_moe_triton(*args), fused_moe_torch(*args))
    assert calls == [{"sync_free": True}]


def test_no_tokens_and_bad_inputs(device, gen, randn):
    w_gate_up, w_down = _experts(randn, 4, 16, 8, torch.float32)
    weights, ids = _routing(0, 4, 2, gen, device)
    assert fused_moe_triton(randn(0, 16), w_gate_up, w_down, weights, ids).shape == (0, 16)
    weights, ids = _routing(3, 4, 2, gen, device)
    with pytest.raises(AssertionError, match="w_down must be"):
        fused_moe_triton(randn(3, 16), w_gate_up, w_down[:, :, :4].contiguous(), weights, ids)
    with pytest.raises(AssertionError, match="8-bit rows need a scale"):
        fused_moe_triton(randn(3, 16), w_gate_up.half(), w_down, weights, ids)
    with pytest.raises(AssertionError, match="float32 topk_weights"):
        fused_moe_triton(randn(3, 16), w_gate_up, w_down, weights.half(), ids)


def test_the_grid_covers_only_tiles_of_routed_experts():
    # one token, top-2 of 8: two programs a column block, one per routed expert
    assert tile_bound(2, 8, 16) == 2
    assert tile_bound(8, 128, 16) == 8  # top-8 of 128 (Qwen3-30B-A3B)
    # 40 pairs over 4 experts in 16-row tiles: 2 full, and a part-filled one an expert
    assert tile_bound(40, 4, 16) == 6


def test_block_sizes_follow_the_rows_an_expert_gets():
    assert moe_blocks(2, 8, 4096, 14336, torch.bfloat16)["BLOCK_M"] == 16  # decode
    assert moe_blocks(2048 * 2, 8, 4096, 14336, torch.bfloat16)["BLOCK_M"] == 64  # prefill
    assert moe_blocks(4, 8, 24, 12, torch.float32) == dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_moe_replays_in_a_cuda_graph():
    """Captured once, replayed on new routings (other experts, another spread of rows):
    no host sync inside, and a grid that covers every tiling of the same shapes."""
    g = torch.Generator().manual_seed(0)
    t, e, k, h, i = 8, 8, 2, 256, 128
    dev = "cuda"
    x = torch.randn(t, h, generator=g).to(dev, torch.bfloat16)
    w_gate_up = (torch.randn(e, 2 * i, h, generator=g) / h ** 0.5).to(dev, torch.bfloat16)
    w_down = (torch.randn(e, h, i, generator=g) / i ** 0.5).to(dev, torch.bfloat16)
    weights, ids = _routing(t, e, k, g, dev)
    fused_moe_triton(x, w_gate_up, w_down, weights, ids)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe_triton(x, w_gate_up, w_down, weights, ids)
    for crowded in (False, True):
        new_w, new_ids = _routing(t, e, k, g, dev)
        if crowded:  # every token's first expert the same one
            new_ids[:, 0] = 3
            new_ids[:, 1] = torch.arange(t, device=dev) % 3 + 4
        weights.copy_(new_w)
        ids.copy_(new_ids)
        x.copy_(torch.randn(t, h, generator=g).to(dev, torch.bfloat16))
        graph.replay()
        assert_close(out, fused_moe_torch(x, w_gate_up, w_down, weights, ids))
