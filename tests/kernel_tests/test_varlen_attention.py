"""varlen_attention: Triton vs the torch reference, and the reference vs plain float64
math, on mixed steps: decode tokens and prompt chunks (fresh or on a cached prefix,
ending mid-block) in one launch, zero-length padding sequences and padding rows after
``cu_seqlens_q[B]``, GQA ratios 1/3/4, sliding windows shorter than a chunk (the blocks
that left every window, and the slots before the first visible key, poisoned with NaN),
int8 and e4m3 K/V, forced and automatic query tiles and splits, merged by the last split or a
second kernel; the launch rule itself (shapes only); one CUDA graph replayed at other
lengths."""
import functools

import pytest
import torch

from infergraft.kernels import varlen_attention as va
from infergraft.kernels._triton import next_pow2
from infergraft.kernels.varlen_attention import varlen_attention_torch, varlen_attention_triton
from infergraft.kernels.varlen_plan import tile_counts, varlen_plan

from .test_paged_attention import _paged
from .tolerances import assert_close


def _step(randn, gen, seqs, hkv, d, bs, dtype, kv_quant, device, window=None, width=0):
    """Cache, tables, cu_seqlens_q and context_lens of a step of ``seqs`` = (cached prefix,
    q_len) pairs, unused blocks and slots NaN; with a window, table entries of blocks
    before the first key a sequence's first query sees name a NaN block (freed blocks) and
    that key's block is NaN before it. Also each sequence's K/V in order (float32, CPU)."""
    lens = [p + n for p, n in seqs]
    k, v, ks, vs, tables, kv = _paged(randn, gen, lens, hkv, d, bs, dtype, kv_quant, device,
                                      width)
    if window:
        used = {int(x) for row, n in zip(tables.cpu(), lens) for x in row[:-(-n // bs)]}
        freed = min(set(range(k.shape[0])) - used)  # a spare block: NaN throughout
        for b, (prefix, n) in enumerate(seqs):
            first = max(0, prefix - window + 1) if n else 0
            for p in range(first // bs * bs, first):  # slots before the first visible key
                blk, off = int(tables[b, p // bs]), p % bs
                if kv_quant is not None:
                    ks[blk, off], vs[blk, off] = float("nan"), float("nan")
                else:
                    k[blk, off], v[blk, off] = float("nan"), float("nan")
            tables[b, :first // bs] = freed
    cu = torch.tensor([0] + [n for _, n in seqs], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    ctx = torch.tensor(lens, dtype=torch.int32)
    return k, v, ks, vs, tables, cu.to(device), ctx.to(device), kv


def _naive(q, seqs, kv, scale, window, softcap=None):
    """Per sequence and head, softmax(q k^T) v in float64, each row over the keys it sees
    (positions in (pos - window, pos]), each score capped to softcap * tanh(score /
    softcap) where a softcap is given; padding rows 0."""
    out, row = torch.zeros(q.shape, dtype=torch.float64), 0
    for (prefix, n), (kb, vb) in zip(seqs, kv):
        group = q.shape[1] // kb.shape[1]
        kk = kb.double().repeat_interleave(group, 1)                      # [L, Hq, D]
        vv = vb.double().repeat_interleave(group, 1)
        pos = torch.arange(prefix, prefix + n)[:, None]                   # [Q, 1]
        key = torch.arange(kb.shape[0])[None, :]                          # [1, L]
        seen = (key <= pos) & (key > pos - window if window else True)   # [Q, L]
        s = torch.einsum("qhd,lhd->hql", q[row:row + n].double(), kk) * scale
        s = s if softcap is None else softcap * torch.tanh(s / softcap)
        p = s.masked_fill(~seen, float("-inf")).softmax(-1)              # [Hq, Q, L]
        out[row:row + n] = torch.einsum("hql,lhd->qhd", p, vv)
        row += n
    return out


def _inputs(randn, gen, device, dtype, hq, hkv, d, bs, seqs, pad, window=None, kv_quant=None,
            width=0):
    """(the positional arguments of one call, q to v_scale; each sequence's K/V): q has
    ``pad`` padding rows after the sequences' rows."""
    k, v, ks, vs, tables, cu, ctx, kv = _step(randn, gen, seqs, hkv, d, bs, dtype, kv_quant, device,
                                              window, width)
    q = randn(sum(n for _, n in seqs) + pad, hq, d, dtype=dtype)
    return (q, k, v, tables, cu, ctx, d ** -0.5, window, ks, vs), kv


def _run(randn, gen, device, dtype, hq, hkv, d, bs, seqs, pad, window=None, kv_quant=None,
         width=0, check_naive=True, q_scale=1.0, **knobs):
    args, kv = _inputs(randn, gen, device, dtype, hq, hkv, d, bs, seqs, pad, window, kv_quant, width)
    args = (q_scale * args[0], *args[1:])  # larger scores: where a softcap bites
    q, softcap = args[0], knobs.get("softcap")
    out = varlen_attention_triton(*args, **knobs)
    ref = varlen_attention_torch(*args, softcap=softcap)
    assert out.shape == q.shape and out.dtype == q.dtype
    msg = f"Hq={hq} Hkv={hkv} seqs={seqs} window={window} kv={kv_quant} {knobs}"
    assert_close(out, ref, msg)
    assert (out[q.shape[0] - pad:] == 0).all(), f"padding rows not zero: {msg}"
    if check_naive:  # and the reference is the plain math
        tol = 1e-5 if dtype == torch.float32 else 2e-3
        torch.testing.assert_close(ref.double().cpu(), _naive(q.cpu(), seqs, kv, args[6], window,
                                                              softcap)
                                   .to(ref.dtype).double(), atol=tol, rtol=tol)
    return args


CASES = [  # (Hq, Hkv, D, block_size, [(cached prefix, q_len)], padding rows)
    # MHA: a fresh prompt and decode tokens, padding rows
    (4, 4, 16, 16, [(0, 5), (36, 1), (79, 1)], 3),
    # GQA 3, odd head_dim and block size: decodes, a one-token prompt, a chunk on a prefix
    # ending mid-block, a zero-length padding sequence
    (6, 2, 24, 5, [(8, 1), (0, 1), (20, 13), (0, 0)], 2),
    # GQA 4: a fresh multi-block prompt, chunks across several blocks, decodes
    (8, 2, 32, 4, [(0, 37), (16, 1), (17, 20), (5, 1)], 0),
    # decode-heavy (T <= 2B: one 16-row tile for all, the decode plan), a chunk over
    # two of those tiles
    (8, 2, 16, 8, [(40, 1), (3, 1), (0, 1), (100, 1), (7, 6)], 0),
]


@pytest.mark.parametrize("window,kv_quant", [(None, None), (6, torch.int8), (1, None),
                                             (None, torch.float8_e4m3fn)],
                         ids=["full", "window6-int8", "window1", "full-fp8"])
@pytest.mark.parametrize("hq,hkv,d,bs,seqs,pad", CASES, ids=["mha", "gqa3", "gqa4", "decode"])
def test_varlen_matches_reference(device, dtype, randn, gen, poisoned_empty, hq, hkv, d, bs,
                                  seqs, pad, window, kv_quant):
    _run(randn, gen, device, dtype, hq, hkv, d, bs, seqs, pad, window, kv_quant)


@pytest.mark.parametrize("window,kv_quant,num_splits", [(None, None, 1), (6, torch.int8, 3)],
                         ids=["full", "window6-int8-S3"])
@pytest.mark.parametrize("hq,hkv,d,bs,seqs,pad", CASES[1:3], ids=["gqa3", "gqa4"])
def test_softcap_matches_reference(device, dtype, randn, gen, poisoned_empty, hq, hkv, d, bs,
                                   seqs, pad, window, kv_quant, num_splits):
    """Gemma 2's cap on the scores, on prompt chunks and decode tokens, in one split and
    across three; q scaled up so that the cap bites."""
    args = _run(randn, gen, device, dtype, hq, hkv, d, bs, seqs, pad, window, kv_quant,
                q_scale=8.0, softcap=3.0, num_splits=num_splits)
    capped, uncapped = varlen_attention_torch(*args, softcap=3.0), varlen_attention_torch(*args)
    assert (capped.float() - uncapped.float()).abs().max() > 0.1, "the cap changed nothing"


@pytest.mark.parametrize("block_m,block_n,window", [(16, 16, 4), (32, 64, None), (64, 32, 4)])
@pytest.mark.parametrize("hq,hkv", [(6, 2), (8, 2)], ids=["gqa3", "gqa4"])
def test_query_tiles(device, dtype, randn, gen, poisoned_empty, hq, hkv, block_m, block_n,
                     window):
    # sequences over several query tiles (16 // 3 = 5 tokens a tile at GQA 3), windows
    # shorter than a tile's queries; 4, 5 and 6 tokens: the most the short tiles take
    # (16 rows: 4 tokens at GQA 4, 5 at GQA 3) and one more
    seqs = [(0, 23), (11, 1), (9, 17), (0, 0), (30, 4), (3, 5), (8, 6)]
    _run(randn, gen, device, dtype, hq, hkv, 16, 8, seqs, 2, window, check_naive=False,
         block_m=block_m, block_n=block_n, num_warps=4, num_stages=2)


WIDE = 40  # table blocks: a graph captured for long contexts, replayed with short ones


FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("num_splits,fused,window,kv_quant", [
    (2, True, None, torch.int8), (5, True, 9, None), (5, False, None, None),
    (None, True, 9, torch.int8), (None, False, None, None), (3, False, 9, FP8)],
    ids=["S2-int8", "S5-window9", "S5-two-kernel", "Sauto-window9-int8", "Sauto-two-kernel",
         "S3-two-kernel-window9-fp8"])
def test_split_kv(device, dtype, randn, gen, poisoned_empty, shared_counters, num_splits, fused,
                  window, kv_quant):
    # long contexts in a wide table, short queries: the automatic plan splits on the
    # interpreter's 4 SMs; the (torch.empty) scratch is NaN
    _run(randn, gen, device, dtype, 8, 2, 16, 4, [(70, 1), (0, 1), (33, 3), (120, 1)], 1, window,
         kv_quant, width=WIDE, check_naive=False, num_splits=num_splits, fused_combine=fused)


def _combine_launches(monkeypatch) -> list:
    """Record launches of the second (combine) kernel."""
    launches, real = [], va._varlen_combine_kernel
    spy = type("Spy", (), {"__getitem__": lambda self, grid: launches.append(grid) or real[grid]})
    monkeypatch.setattr(va, "_varlen_combine_kernel", spy())
    return launches


@pytest.mark.parametrize("merge", ["default", "one-head", "too-big"])
def test_fused_merge_matches_two_kernels(device, randn, gen, poisoned_empty, monkeypatch,
                                         shared_counters, merge):
    # GQA 3 (a padding head in the merge), chunks whose tiles merge several tokens
    nsplit, d = 3, 24
    one_head = next_pow2(nsplit) * max(16, next_pow2(d))  # [1, S, D]: a loop over the group
    monkeypatch.setattr(va, "MERGE_ELEMS", {"default": va.MERGE_ELEMS, "one-head": one_head,
                                            "too-big": one_head - 1}[merge])
    launches = _combine_launches(monkeypatch)
    args, _ = _inputs(randn, gen, device, torch.float32, 6, 2, d, 5, [(30, 7), (2, 1)], 2)
    run = functools.partial(varlen_attention_triton, *args, num_splits=nsplit, block_m=16)
    fused = run(fused_combine=True)
    assert len(launches) == (merge == "too-big")  # else no second kernel
    two = run(fused_combine=False)
    assert len(launches) == 1 + (merge == "too-big")
    ref = varlen_attention_torch(*args)
    assert_close(fused, ref, "fused")
    assert_close(two, ref, "two kernels")
    assert_close(fused, two, "fused vs two kernels")


def test_padding_only_steps(device, randn, gen, poisoned_empty):
    k, v, _, _, tables, cu, ctx, _ = _step(randn, gen, [(4, 0), (0, 0)], 2, 16, 4,
                                           torch.float32, None, device)
    q = randn(5, 4, 16)
    for fn in (varlen_attention_triton, varlen_attention_torch):  # only padding: zeros
        assert (fn(q, k, v, tables, cu, ctx, 0.25) == 0).all()
        assert fn(q[:0], k, v, tables, cu, ctx, 0.25).shape == (0, 4, 16)
        none = torch.zeros(1, dtype=torch.int32, device=device)
        assert (fn(q, k, v, tables[:0], none, ctx[:0], 0.25) == 0).all()  # no sequence


def test_rejects_bad_inputs(device, randn, gen):
    k, v, _, _, tables, cu, ctx, _ = _step(randn, gen, [(3, 2), (0, 4)], 2, 16, 4,
                                           torch.float32, None, device)
    q = randn(7, 4, 16)
    bad = [((randn(6, 3, 16), k, v, tables, cu, ctx), "not a multiple of Hkv"),
           ((q[0], k, v, tables, cu, ctx), r"q must be \[T, Hq, D\]"),
           ((q.half(), k, v, tables, cu, ctx), "must equal q dtype"),
           ((q, k.to(torch.int8), v.to(torch.int8), tables, cu, ctx), "torch.int8 K/V need k_scale"),
           ((q, k, v[:, :, :1], tables, cu, ctx), "must both be"),
           ((q, k, v, tables[0], cu, ctx), "block_tables must be"),
           ((q, k, v, tables, cu[1:], ctx), r"cu_seqlens_q must be int32 \[3\]"),
           ((q, k, v, tables, cu.long(), ctx), "cu_seqlens_q must be int32"),
           ((q, k, v, tables, cu, ctx.float()), "context_lens must be")]
    for fn in (varlen_attention_triton, varlen_attention_torch):
        for args, match in bad:
            with pytest.raises(AssertionError, match=match):
                fn(*args, 0.25)
        with pytest.raises(AssertionError, match="window"):
            fn(q, k, v, tables, cu, ctx, 0.25, window=0)
    for knob, match in (({"num_splits": 0}, "num_splits"), ({"block_n": 24}, "block_n"),
                        ({"block_m": 8}, "block_m"), ({"block_m": 48}, "block_m")):
        with pytest.raises(AssertionError, match=match):
            varlen_attention_triton(q, k, v, tables, cu, ctx, 0.25, **knob)
    with pytest.raises(AssertionError, match="rise from 0"):  # the reference checks values
        varlen_attention_torch(q, k, v, tables, cu.flip(0).contiguous(), ctx, 0.25)
    with pytest.raises(AssertionError, match="context_lens 1 < its 2 query rows"):
        varlen_attention_torch(q, k, v, tables, cu, ctx - 4, 0.25)


H200 = dict(sms=132, head_dim=128, elem_bytes=2, quant=False)


def test_launch_rule_from_shapes():
    plan = functools.partial(varlen_plan, hkv=8, group=4, max_tokens=4096, window=None, **H200)
    # decode-heavy: the decode kernel's 16-row tile (and plan) for all; 8 long decodes split
    dec = plan(64, 64)
    assert (dec["block_m"], dec["block_q"], dec["short_m"]) == (16, 4, 0)
    assert plan(8, 8)["nsplit"] > 1 and plan(512, 256)["nsplit"] == 1
    # one fresh 512-token prompt: 64-row tiles, unsplit; the short tiles (up to 4 tokens
    # a sequence) beside them
    one = plan(512, 1)
    assert (one["block_m"], one["block_n"], one["nsplit"]) == (64, 64, 1)
    assert (one["short_m"], one["short_q"], one["short_n"]) == (16, 4, 64)
    # 256 decodes + a 1792-token chunk: the same two tiles; 128 rows when forced, 8 warps
    big = plan(2048, 257)
    assert (big["block_m"], big["short_m"], big["tune"]["num_warps"]) == (64, 16, 4)
    forced = plan(2048, 257, block_m=128)
    assert (forced["block_q"], forced["tune"]["num_warps"]) == (32, 8)
    # float32 or head_dim 256: 32-key tiles
    f32 = varlen_plan(2048, 1, 8, 4, 4096, None, 132, head_dim=128, elem_bytes=4, quant=False)
    assert (f32["block_m"], f32["block_n"], f32["short_n"]) == (64, 32, 32)
    assert varlen_plan(2048, 1, 8, 4, 4096, None, 132, head_dim=256, elem_bytes=2,
                       quant=False)["block_n"] == 32
    assert plan(2048, 1, num_splits=3, block_m=32)["nsplit"] == 3      # forced
    gqa32 = varlen_plan(8, 8, 1, 32, 4096, None, 132, **{k: v for k, v in H200.items()
                                                       if k != "sms"})
    assert (gqa32["block_m"], gqa32["block_q"]) == (32, 1)  # one token's 32 heads


def test_tiles_cover_every_split_of_the_rows():
    # sequence b's tiles start at cu[b] // BQ + b; they and the padding rows' tiles fit in
    # the grid for any lengths (here every split of up to 12 rows over 3 sequences)
    gen = torch.Generator().manual_seed(0)
    for block_q in (1, 3, 4, 5, 16):
        for ntok in range(0, 13):
            grid, _ = tile_counts(ntok, 3, block_q)
            assert tile_counts(ntok, 3, block_q, short=True)[0] == grid + 3  # + one a sequence
            for _ in range(20):
                cuts = sorted(torch.randint(0, ntok + 1, (3,), generator=gen).tolist())
                cu = [0] + cuts
                starts = [c // block_q + b for b, c in enumerate(cu)]
                for b in range(3):
                    need = -(-(cu[b + 1] - cu[b]) // block_q)
                    assert starts[b] + need <= starts[b + 1], (block_q, cu)
                assert starts[3] + -(-(ntok - cu[3]) // block_q) <= grid, (block_q, ntok, cu)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_one_graph_replays_other_lengths(shared_counters):
    # captured once for T rows over B sequences; replayed with other splits of the rows
    # and other contexts, it matches the reference of each (nothing read from values)
    gen = torch.Generator().manual_seed(1)
    randn = lambda *s, dtype=torch.float32: torch.randn(*s, generator=gen).to("cuda", dtype)  # noqa: E731
    steps = [[(0, 30), (50, 1), (7, 1), (0, 0)], [(200, 1), (3, 5), (0, 22), (90, 3)],
             [(0, 1), (0, 1), (0, 1), (600, 1)]]
    made = [_step(randn, gen, s, 2, 64, 16, torch.bfloat16, None, "cuda", width=48) for s in steps]
    k, v = torch.cat([m[0] for m in made]), torch.cat([m[1] for m in made])
    offset, tables = 0, []
    for m in made:
        tables.append(m[4] + offset)
        offset += m[0].shape[0]
    q = randn(40, 8, 64, dtype=torch.bfloat16)
    t_in, cu_in, ctx_in = tables[0].clone(), made[0][5].clone(), made[0][6].clone()
    for window in (None, 24):
        for num_splits in (None, 4):
            run = lambda: varlen_attention_triton(q, k, v, t_in, cu_in, ctx_in, 0.125, window,  # noqa: E731
                                                  num_splits=num_splits)
            run()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = run()
            for t, m in zip(tables, made):
                t_in.copy_(t), cu_in.copy_(m[5]), ctx_in.copy_(m[6])
                graph.replay()
                ref = varlen_attention_torch(q, k, v, t, m[5], m[6], 0.125, window)
                assert_close(out, ref, f"window={window} S={num_splits} cu={m[5].tolist()}")
