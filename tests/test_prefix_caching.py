"""Automatic prefix caching end to end: a prompt that starts with blocks another request
computed takes them and prefills only the rest, and its float32 greedy tokens stay
exactly HF's (exact block boundaries, a prefix ending mid-block, a prompt cached whole,
forks, recompute preemption, GQA, sliding windows, int8 K/V)."""
import pytest

from infergraft import core
from infergraft.core.testing.models import random_prompt
from infergraft.core.testing.parity import hf_greedy

BS = 4


def _engine(hf, *plugins, **kw):
    return core.build(hf, plugins=["paged", *plugins], block_size=BS, max_seq_len=96,
                      max_batch_size=4, **kw)


def _shared(n_prefix, tails, seed=0):
    prefix = random_prompt(n_prefix, 256, seed)
    return [prefix + random_prompt(t, 256, seed + 1 + i) for i, t in enumerate(tails)]


@pytest.mark.parametrize("n_prefix", [8, 10], ids=["block-boundary", "mid-block"])
def test_a_cached_prefix_is_taken_and_tokens_stay_hf(llama, n_prefix):
    engine = _engine(llama)
    first, second = _shared(n_prefix, [3, 5])
    want = [hf_greedy(llama, p, 12) for p in (first, second)]
    assert engine.generate([first], max_new_tokens=12)[0].token_ids == want[0]
    before = engine.stats()
    assert engine.generate([second], max_new_tokens=12)[0].token_ids == want[1]
    after = engine.stats()
    # the shared prefix's full blocks: 8 tokens either way (10 ends mid-block)
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] == 8
    assert after["prefix_cache_queries"] - before["prefix_cache_queries"] == len(second)


@pytest.mark.parametrize("length", [12, 13], ids=["whole-blocks", "partial-last-block"])
def test_a_prompt_cached_whole_recomputes_its_last_token(llama, length):
    engine = _engine(llama)
    prompt = random_prompt(length, 256, 9)
    want = hf_greedy(llama, prompt, 10)
    for _ in range(2):
        before = engine.stats()["prefix_cache_hits"]
        assert engine.generate([prompt], max_new_tokens=10)[0].token_ids == want
    # the second run: every full block but one whose last token must be fed for logits
    assert engine.stats()["prefix_cache_hits"] - before == (length - 1) // BS * BS
    engine.cache.check_invariants()


def test_requests_in_one_batch_share_a_prefix_computed_before(llama):
    engine = _engine(llama)
    prompts = _shared(16, [1, 4, 6, 9], seed=20)
    engine.generate([prompts[0]], max_new_tokens=4)
    got = [c.token_ids for c in engine.generate(prompts, max_new_tokens=10)]
    assert got == [hf_greedy(llama, p, 10) for p in prompts]
    assert engine.stats()["prefix_cache_hits"] >= 4 * 16


def test_off_shares_nothing_and_gives_the_same_tokens(llama):
    on, off = _engine(llama), _engine(llama, prefix_caching=False)
    prompts = _shared(12, [2, 7], seed=30)
    for engine in (on, off):
        engine.generate([prompts[0]], max_new_tokens=3)
    got = [[c.token_ids for c in e.generate(prompts, max_new_tokens=8)] for e in (on, off)]
    assert got[0] == got[1]
    assert off.stats()["prefix_cache_hits"] == 0 and on.stats()["prefix_cache_hits"] > 0
    assert "blocks_cached" not in off.cache.stats()


def test_forks_of_a_cached_prompt(llama):
    engine, plain = _engine(llama), _engine(llama, prefix_caching=False)
    prompt = random_prompt(14, 256, 40)
    engine.generate([prompt], max_new_tokens=2)
    kw = dict(max_new_tokens=8, n=3, temperature=0.9, seed=7)
    done = engine.generate([prompt], **kw)
    assert [c.token_ids for c in done] == [c.token_ids for c in plain.generate([prompt], **kw)]
    assert engine.stats()["prefix_cache_hits"] == 12
    # the samples forked from the prompt hold its K/V: each reports its cached tokens
    assert [c.num_cached_tokens for c in done] == [12] * 3
    engine.cache.check_invariants()


def test_a_completion_counts_the_prompt_tokens_served_from_the_cache(llama):
    # a shared prefix of 10 tokens: 2 full blocks of 4, then 2 tokens of a third
    first, second = _shared(10, [3, 5], seed=90)
    engines = {"paged": (_engine(llama), 8), "off": (_engine(llama, prefix_caching=False), 0),
               "contiguous": (core.build(llama, max_seq_len=96, max_batch_size=4), 0)}
    for name, (engine, shared) in engines.items():
        a, b = (engine.generate([p], max_new_tokens=4)[0] for p in (first, second))
        again = engine.generate([first], max_new_tokens=4)[0]  # 13 tokens, 3 blocks keyed
        assert (a.num_cached_tokens, b.num_cached_tokens, again.num_cached_tokens) == \
            (0, shared, 12 if shared else 0), name
        assert again.token_ids == a.token_ids, name


def test_a_recomputed_request_keeps_its_first_admissions_cached_count(llama):
    engine = _engine(llama)
    first, second = _shared(8, [1, 5], seed=95)
    engine.generate([first], max_new_tokens=2)  # keys the 2 blocks of the shared prefix
    seq = engine.add_request(second, core.SamplingParams(max_new_tokens=12))
    while len(seq.output_ids) < 6:
        engine.step()
    assert (seq.num_cached_tokens, seq.num_admissions) == (8, 1)
    hits = engine.stats()["prefix_cache_hits"]
    engine.scheduler.preempt(seq)  # recompute: its prompt's 3 full blocks stay keyed
    while not seq.finished:
        engine.step()
    # re-admitted on its own 12 keyed prompt tokens; what it was served stays 8
    assert engine.stats()["prefix_cache_hits"] - hits == 12
    assert (seq.num_cached_tokens, seq.num_admissions) == (8, 2)
    assert seq.output_ids == hf_greedy(llama, second, 12)


@pytest.mark.parametrize("fixture", ["llama", "mistral"])
def test_a_finished_answer_serves_the_next_turn(fixture, request):
    """A conversation's second turn repeats the first's prompt and answer: the full blocks
    of both are keyed when the first finishes (its last token was never fed: no K/V). A
    window (mistral's 8 tokens) drops the blocks behind it as decode runs: those are gone."""
    hf = request.getfixturevalue(fixture)
    engine = _engine(hf)
    prompt = random_prompt(10, 256, 97)
    answer = engine.generate([prompt], max_new_tokens=12)[0]
    turn = prompt + answer.token_ids + random_prompt(3, 256, 98)  # 25 tokens
    got = engine.generate([turn], max_new_tokens=8)[0]
    assert got.token_ids == hf_greedy(hf, turn, 8)
    # 10 + 11 fed tokens: 5 full blocks (the window keeps only the prompt's 2 + 0 after)
    assert got.num_cached_tokens == (20 if fixture == "llama" else 8), got.num_cached_tokens
    engine.cache.check_invariants()


def test_recompute_preemption_takes_its_own_blocks_back(llama):
    # 12 blocks of 4: four sequences of 5 + 30 tokens want 36, so some are preempted
    engine = _engine(llama, num_blocks=24, preemption="recompute")
    prompts = [random_prompt(5, 256, 50 + i) for i in range(4)]
    got = [c.token_ids for c in engine.generate(prompts, max_new_tokens=30)]
    assert got == [hf_greedy(llama, p, 30) for p in prompts]
    st = engine.stats()
    assert st["num_recomputed"] > 0 and st["prefix_cache_hits"] > 0, st


def test_sliding_window(mistral):
    engine = _engine(mistral)
    prompts = _shared(20, [3, 6], seed=60)
    want = [hf_greedy(mistral, p, 16) for p in prompts]
    assert [engine.generate([p], max_new_tokens=16)[0].token_ids for p in prompts] == want
    assert engine.stats()["prefix_cache_hits"] == 20


def test_int8_kv_hits_give_what_a_fresh_prefill_gives(llama):
    engine, plain = _engine(llama, "kv-int8"), _engine(llama, "kv-int8", prefix_caching=False)
    prompts = _shared(12, [2, 5], seed=70)
    got = [[e.generate([p], max_new_tokens=10)[0].token_ids for p in prompts]
           for e in (engine, plain)]
    assert got[0] == got[1]
    assert got[0] == [hf_greedy(llama, p, 10, kv_int8=True) for p in prompts]
    assert engine.stats()["prefix_cache_hits"] == 12


def test_a_failed_step_leaves_no_half_written_block_to_reuse(llama):
    engine = _engine(llama)
    prompt = random_prompt(13, 256, 80)
    real, calls = engine.model.forward, []

    def failing(*args, **kwargs):  # the step's blocks are keyed (prepare ran), then it fails
        calls.append(1)
        raise RuntimeError("injected step failure")
    engine.model.forward = failing
    engine.runner.step_graphs = None
    with pytest.raises(RuntimeError, match="injected"):
        engine.generate([prompt], max_new_tokens=4)
    engine.model.forward = real
    assert calls and len(engine.cache.prefix) == 0  # its keys went with it
    engine.abort([s for s in list(engine.scheduler.waiting)])
    before = engine.stats()["prefix_cache_hits"]
    assert engine.generate([prompt], max_new_tokens=8)[0].token_ids == hf_greedy(llama, prompt, 8)
    assert engine.stats()["prefix_cache_hits"] == before  # nothing was taken from the failed step
    engine.cache.check_invariants()


@pytest.mark.parametrize("caching", [True, False], ids=["cached", "uncached"])
def test_auto_preemption_counts_a_cached_prefix_as_no_recompute(caching):
    import torch

    from infergraft.core.preemption import PreemptionPolicy, Rates, recompute_flops
    from infergraft.core.request import SamplingParams, Sequence
    from infergraft.core.testing.cache_machine import cache_factory

    make = cache_factory("paged", block_size=BS, num_blocks=12, prefix_caching=caching)
    cache, seq = make(), Sequence(list(range(3, 23)), SamplingParams())  # 20 tokens: 5 blocks
    assert cache.allocate_cached(seq.id, seq.prompt_ids) == 0
    meta, s = cache.prepare([seq.id], [20]), make.spec
    for layer in range(s.num_layers):
        kv = torch.randn(20, s.num_kv_heads, s.head_dim)
        cache.attention(layer, torch.randn(20, s.num_heads, s.head_dim), kv, kv, meta)
    seq.num_prefill_tokens = seq.num_computed_tokens = 20
    assert cache.cached_tokens(seq.id) == (20 if caching else 0)
    # a link at which a swap costs half of prefilling all 20 tokens again
    link = 2 * cache.swap_bytes(seq.id) / (recompute_flops(s, 20) / 2)
    policy = PreemptionPolicy("auto", s, rates=Rates(link, 1.0))
    assert policy.choose(cache, seq) == ("recompute" if caching else "swap")
