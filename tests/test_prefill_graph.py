"""A fresh prompt's prefill through the captured-graph path (core/runner/prefill_graph.py), the
contiguous cache's (the paged cache captures whole mixed steps instead: test_step_graph.py).

Run eagerly on the CPU through the runner's static, padded buffers (``use_graphs=False``):
the padded prefill must give the plain engine's logits, K/V and greedy tokens, write
nothing for its padding rows (another sequence's cache stays as it was), and leave
batched, resumed or over-long prefills to the eager path.
"""
import pytest
import torch

from infergraft import core
from infergraft.core.errors import PlanError
from infergraft.core.runner.prefill_graph import PrefillGraphRunner
from infergraft.core.request import SamplingParams
from infergraft.core.testing.models import (random_model, random_prompt, tiny_llama_config,
                                            tiny_mistral_config)

CFG = tiny_llama_config()
BUCKETS = (8, 16, 32)


@pytest.fixture(scope="module")
def hf():
    return random_model(CFG, seed=11, scale=5.0)


def with_prefill_graphs(hf, backend, max_seq_len=64, batch=2, **kw):
    # no decode graphs (hence no decode look-ahead) on a GPU either: steps stay in lockstep
    engine = core.build(hf, plugins=[backend], max_seq_len=max_seq_len, max_batch_size=batch,
                        cuda_graphs=False, **kw)
    runner = PrefillGraphRunner(engine.model, engine.cache, max_seq_len, buckets=BUCKETS,
                                use_graphs=False)
    engine.prefill_graphs = runner
    return engine, runner


def plain(hf, backend, max_seq_len=64, batch=2, **kw):
    return core.build(hf, plugins=[backend], max_seq_len=max_seq_len, max_batch_size=batch,
                      cuda_graphs=False, **kw)


def test_buckets_cover_prompts_up_to_max_seq_len(hf):
    engine = plain(hf, "contiguous")
    r = PrefillGraphRunner(engine.model, engine.cache, 20, buckets=BUCKETS, use_graphs=False)
    assert r.buckets == [8, 16, 20]
    r = PrefillGraphRunner(engine.model, engine.cache, 64, buckets=BUCKETS, use_graphs=False)
    assert r.buckets == [8, 16, 32]  # longer prompts run eagerly


@pytest.mark.parametrize("backend", ["contiguous"])
@pytest.mark.parametrize("n", [1, 5, 8, 13, 32])
def test_padded_prefill_equals_eager(hf, backend, n):
    prompt = random_prompt(n, CFG.vocab_size, seed=n)
    engine, runner = with_prefill_graphs(hf, backend)
    ref = plain(hf, backend)
    seq, seq_ref = engine.add_request(prompt), ref.add_request(prompt)
    engine.step(), ref.step()  # the prefill steps
    assert runner.replays == 1
    length = runner.buckets[[b >= n for b in runner.buckets].index(True)]
    assert list(runner.inputs) == [length]
    torch.testing.assert_close(runner.logits[length].cpu(), ref_logits(hf, prompt), rtol=1e-4,
                               atol=1e-4)
    for layer in range(CFG.num_hidden_layers):
        for got, want in zip(engine.cache.read(seq.id, layer), ref.cache.read(seq_ref.id, layer)):
            assert got.shape[0] == n
            torch.testing.assert_close(got.cpu(), want.cpu(), rtol=1e-5, atol=1e-5)
    while engine.has_unfinished() or ref.has_unfinished():
        engine.step(), ref.step()
    assert seq.output_ids == seq_ref.output_ids
    engine.cache.check_invariants()


def ref_logits(hf, prompt):
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0, -1:].float()


def _k_storage(cache):
    """The last layer's K storage: paged [blocks, BS, Hkv, D], contiguous [rows, Hkv, S, D].
    (Not layer 0: there a padding row's K depends only on its token and position, so a
    stray write would repeat the previous prompt's and go unseen.)"""
    return (cache.k[-1] if hasattr(cache, "allocator") else cache.kv.k[-1]).clone()


def _written(cache, before, seq_id):
    """Which storage entries changed, as the set of (block) or (row, column) touched."""
    after = _k_storage(cache)
    if hasattr(cache, "allocator"):  # paged
        return {(int(b),) for b in (after != before).flatten(1).any(1).nonzero()}, \
            {(b,) for b in cache._tables[seq_id]}
    changed = (after != before).any(-1).any(1).nonzero()  # [*, (row, column)]
    row, n = cache._row[seq_id], cache.length(seq_id)
    return {tuple(map(int, rc)) for rc in changed}, {(row, c) for c in range(n)}


def test_padding_rows_write_nothing_and_others_are_unchanged(hf):
    # b's prompt (11 tokens, bucket 16) is prefilled through the runner while a is
    # mid-decode: only b's own slots change, and a's output matches an engine that never
    # saw b (a step that carries a's token runs eagerly: the graph takes a prompt alone)
    a, b = random_prompt(9, CFG.vocab_size, 1), random_prompt(11, CFG.vocab_size, 2)
    eng, runner = with_prefill_graphs(hf, "contiguous")
    ref = plain(hf, "contiguous")
    sa, ra = (e.add_request(a, SamplingParams(max_new_tokens=12)) for e in (eng, ref))
    for _ in range(4):
        eng.step(), ref.step()
    before = _k_storage(eng.cache)
    eng.cache.allocate("b", len(b))
    logits = runner.prefill("b", b)
    changed, own = _written(eng.cache, before, "b")
    assert changed and changed <= own, f"wrote outside b's slots: {sorted(changed - own)}"
    torch.testing.assert_close(logits.cpu(), ref_logits(hf, b), rtol=1e-4, atol=1e-4)
    eng.cache.free("b")
    while eng.has_unfinished() or ref.has_unfinished():
        eng.step(), ref.step()
    assert sa.output_ids == ra.output_ids
    eng.cache.check_invariants()


def test_batched_and_long_prefills_run_eagerly(hf):
    engine, runner = with_prefill_graphs(hf, "contiguous", batch=3)
    prompts = [random_prompt(n, CFG.vocab_size, n) for n in (4, 6)]
    seqs = [engine.add_request(p, SamplingParams(max_new_tokens=3)) for p in prompts]
    engine.step()  # both admitted in one prefill step
    assert runner.replays == 0 and all(len(s.output_ids) == 1 for s in seqs)
    long = engine.add_request(random_prompt(40, CFG.vocab_size, 3),
                              SamplingParams(max_new_tokens=2))  # > the largest bucket (32)
    while engine.has_unfinished():
        engine.step()
    assert runner.replays == 0 and len(long.output_ids) == 2


def test_which_caches_can_capture_a_prefill(hf):
    supported = PrefillGraphRunner.supported
    assert supported(plain(hf, "contiguous").cache)
    assert not supported(plain(hf, "paged").cache)  # it captures whole mixed steps instead
    # int8 K/V: the prefill attends over the dequantised cache, sized by the real length
    assert not supported(core.build(hf, plugins=["paged", "kv-int8"], max_seq_len=64).cache)
    assert not supported(core.build(hf, plugins=["kv-int8"], max_seq_len=64).cache)
    assert not supported(core.build(hf, plugins=["offload"], max_seq_len=64).cache)
    window = random_model(tiny_mistral_config(sliding_window=6), seed=1)
    assert not supported(plain(window, "contiguous").cache)  # ring buffer


def test_prefill_graphs_need_decode_graphs(hf):
    with pytest.raises(PlanError, match="prefill_graphs=True needs decode CUDA graphs"):
        core.build(hf, max_seq_len=64, cuda_graphs=False, prefill_graphs=True)
    assert core.build(hf, max_seq_len=64, device="cpu").prefill_graphs is None  # off on CPU


@pytest.mark.parametrize("backend", ["contiguous"])
def test_prepare_prefill_into_refuses_what_a_bucket_cannot_take(hf, backend):
    cache = plain(hf, backend).cache
    meta = cache.static_prefill_meta(8)
    cache.allocate("a", 12)
    with pytest.raises(ValueError, match="fresh sequence of 1..8 tokens.*adding 9"):
        cache.prepare_prefill_into(meta, "a", 9)  # longer than the bucket
    cache.prepare_prefill_into(meta, "a", 5)
    assert cache.length("a") == 5
    with pytest.raises(ValueError, match="holds 5"):
        cache.prepare_prefill_into(meta, "a", 3)  # no longer fresh
    cache.check_invariants()


def test_capture_ahead_takes_the_buckets_of_given_lengths(hf):
    engine, runner = with_prefill_graphs(hf, "contiguous")
    assert runner.capture([5, 8, 9, 30]) == [8, 16, 32]
    assert sorted(runner.inputs) == [8, 16, 32]
    with pytest.raises(ValueError, match=r"prompt lengths \[40\] have no prefill graph bucket"):
        runner.capture([40])
    assert runner.capture() == [8, 16, 32]  # every bucket (already captured: nothing new)
    prompt = random_prompt(7, CFG.vocab_size, 9)
    got = engine.generate(prompt, max_new_tokens=4)[0].token_ids
    assert runner.replays == 1 and got == plain(hf, "contiguous").generate(prompt, max_new_tokens=4)[0].token_ids
