"""The paged cache under a sliding window: blocks whose tokens no later query sees go
back to the pool, so a small pool serves long generations without preempting, and the
tokens stay identical to the contiguous cache's rolling buffer (itself HF-checked)."""
import pytest
import torch

from infergraft import core
from infergraft.core.testing.models import random_model, random_prompt, tiny_mistral_config
from infergraft.plugins.paged import HOLE

W, BS = 8, 4


@pytest.fixture(scope="module")
def hf():
    return random_model(tiny_mistral_config(sliding_window=W), seed=3, scale=5.0)


# 24 blocks: one max_seq_len sequence; four ~90-token sequences need 90 without drops
@pytest.mark.parametrize("backend,options", [
    ("paged", {"num_blocks": 24}), ("offload", {"num_blocks": 48, "fast_blocks": 24})],
    ids=["paged", "offload"])
def test_long_generation_in_a_pool_of_one_sequence(hf, backend, options):
    kw = dict(max_seq_len=96, max_batch_size=4)
    want_engine = core.build(hf, **kw)  # contiguous rolling buffer
    engine = core.build(hf, plugins=[backend], block_size=BS, **options, **kw)
    prompts = [random_prompt(n, 256, n) for n in (5, 30, 11, 19)]
    peak, real = [], engine.cache._advance

    def advance(seq_ids, counts):
        starts = real(seq_ids, counts)
        cache = engine.cache
        for s, start in zip(seq_ids, starts):
            live = cache._live_blocks(s)
            # what the step's queries see: from start - W + 1, whole blocks, to its end
            assert len(live) <= -(-(cache.length(s) - max(0, start - W + 1) // BS * BS) // BS), \
                (s, start, cache._tables[s])
        peak.append(cache.stats()["blocks_used"])
        return starts
    engine.cache._advance = advance
    want = [c.token_ids for c in want_engine.generate(prompts, max_new_tokens=60)]
    got = [c.token_ids for c in engine.generate(prompts, max_new_tokens=60)]
    assert got == want
    assert engine.scheduler.num_preemptions == 0
    assert max(peak) <= 4 * (W // BS + 2) + 30 // BS, max(peak)  # the 30-token prompt prefills whole
    assert engine.cache.stats()["blocks_free"] == options["num_blocks"]
    assert engine.cache.stats().get("swapped_out", 0) == 0
    engine.cache.check_invariants()


def test_read_and_fork_keep_the_window(hf):
    engine = core.build(hf, plugins=["paged"], block_size=BS, max_seq_len=64, max_batch_size=2)
    cache = engine.cache
    cache.allocate("a", 20)
    meta = cache.prepare(["a"], [20])
    assert cache._tables["a"].count(HOLE) == 0  # a fresh prompt: every query sees from 0 on
    s = cache.spec
    for layer in range(s.num_layers):
        k = torch.randn(20, s.num_kv_heads, s.head_dim)
        cache.attention(layer, torch.randn(20, s.num_heads, s.head_dim), k, k.clone(), meta)
    cache.prepare(["a"], [1])  # the step at 20 sees from 13: blocks 0-2 (tokens 0-11) go
    assert cache._tables["a"][:3] == [HOLE] * 3 and HOLE not in cache._tables["a"][3:]
    k, v = cache.read("a", 0)
    assert k.shape[0] == 21 - 12 and v.shape[0] == 9
    cache.fork("a", "b")
    assert cache._tables["b"][:3] == [HOLE] * 3
    cache.check_invariants()
    cache.free("a")
    cache.free("b")
    assert cache.stats()["blocks_free"] == cache.stats()["blocks_total"]


@pytest.mark.parametrize("backend", ["paged", "offload"])
def test_default_pool_holds_windows_not_full_lengths(hf, backend):
    # one max_seq_len sequence (a prompt holds its blocks until it decodes) + the window's
    # blocks for each other slot: 24 + 3 * (8/4 + 2) = 36 blocks, not 4 * 24
    kw = dict(max_seq_len=96, max_batch_size=4)
    engine = core.build(hf, plugins=[backend], block_size=BS, **kw)
    assert engine.cache.allocator.num_blocks == 24 + 3 * (W // BS + 2)
    want_engine = core.build(hf, **kw)
    prompts = [random_prompt(n, 256, n) for n in (40, 45, 7, 41)]  # 10+12+2+11 > 36 blocks
    want = [c.token_ids for c in want_engine.generate(prompts, max_new_tokens=50)]
    assert [c.token_ids for c in engine.generate(prompts, max_new_tokens=50)] == want
    assert engine.cache.stats()["blocks_free"] == engine.cache.allocator.num_blocks
    engine.cache.check_invariants()


@pytest.mark.parametrize("window,bs,prompt", [(8, 4, 3), (8, 4, 30), (5, 4, 17), (7, 3, 9),
                                              (16, 16, 40), (1, 4, 6)])
def test_a_decoding_sequence_holds_at_most_held_blocks(window, bs, prompt):
    from infergraft.plugins.block_allocator import held_blocks
    from infergraft.plugins.paged import PagedCache
    hf_model = random_model(tiny_mistral_config(sliding_window=window), seed=1)
    engine = core.build(hf_model, plugins=["paged"], block_size=bs, max_seq_len=120,
                        max_batch_size=1)
    cache = engine.cache
    assert isinstance(cache, PagedCache)
    limit = held_blocks(engine.plan, bs)
    cache.allocate("s", prompt)
    cache.prepare(["s"], [prompt])
    peak = 0
    real_take = cache.allocator.take

    def take(n):
        nonlocal peak
        out = real_take(n)
        peak = max(peak, cache.allocator.num_blocks - cache.allocator.num_free)
        return out
    cache.allocator.take = take
    for _ in range(120 - prompt):
        cache.prepare(["s"], [1])
        used = cache.allocator.num_blocks - cache.allocator.num_free
        assert used <= limit, (cache.length("s"), cache._tables["s"])
    assert 0 < peak <= limit
    assert limit == min(-(-120 // bs), -(-window // bs) + 2)
