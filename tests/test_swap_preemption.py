"""Preemption by swap: the paged cache's swap out and in (plugins/kv_swap.py), and whole
engines in a pool a quarter of what their batch wants: every request gets the float32
greedy tokens it gets alone and HF's (GQA, a sliding window, int8 K/V), swapped or
recomputed as asked. The cost model and the scheduler's side: test_swap_scheduler.py."""
import pytest
import torch

from infergraft import core
from infergraft.core.cache import CacheFullError
from infergraft.core.errors import PlanError
from infergraft.core.preemption import PreemptionPolicy, Rates
from infergraft.core.swap_schedule import swap_out
from infergraft.core.testing.cache_machine import cache_factory, tiny_cache_spec
from infergraft.core.testing.models import random_prompt
from infergraft.core.testing.parity import hf_greedy
from infergraft.plugins.block_allocator import blocks_for
from infergraft.plugins.paged import HOLE

BS = 4
FAST_LINK, SLOW_LINK = Rates(1e15, 1e6), Rates(1.0, 1e15)  # (link bytes/s, FLOP/s)


def fill(cache, sid, counts, seed=0):
    """Feed ``sid`` steps of ``counts`` tokens, random K/V in every layer."""
    g, s = torch.Generator().manual_seed(seed), cache.spec
    for n in counts:
        meta = cache.prepare([sid], [n])
        for layer in range(s.num_layers):
            k, v = (torch.randn(n, s.num_kv_heads, s.head_dim, generator=g) for _ in "kv")
            cache.attention(layer, torch.randn(n, s.num_heads, s.head_dim, generator=g), k, v,
                            meta)


def read_all(cache, sid):
    return [cache.read(sid, layer) for layer in range(cache.spec.num_layers)]


def paged(window=None, kv=None, **options):
    options = {"block_size": BS, "num_blocks": 12, **options}
    return cache_factory("paged", tiny_cache_spec(sliding_window=window), max_seq_len=24,
                         kv_quantizer=kv, **options)()


# -- the cache ---------------------------------------------------------------------------
@pytest.mark.parametrize("window,kv", [(None, None), (None, "kv-int8"), (None, "kv-fp8"),
                                       (6, None)], ids=["float32", "kv-int8", "kv-fp8", "window"])
def test_swap_out_and_in_restores_exactly_the_kv(window, kv):
    cache = paged(window, kv, num_blocks=8)
    cache.allocate(0, 7)
    fill(cache, 0, [7] + [1] * 9, seed=1)  # 16 tokens, 4 blocks (a window drops 2)
    before, table = read_all(cache, 0), list(cache._tables[0])
    assert (table.count(HOLE) > 0) == (window is not None)
    free = cache.stats()["blocks_free"]
    assert cache.can_swap_out(0) and cache.swap_bytes(0) > 0
    cache.swap_out(0)
    assert cache.swapped_ids() == [0] and cache.stats()["sequences"] == 0
    assert cache.stats()["blocks_free"] == free + len(table) - table.count(HOLE) == 8
    # other sequences overwrite every block the first one had, and hold the whole pool
    cache.allocate(1, 24)
    fill(cache, 1, [24], seed=2)
    cache.allocate(2, 8)
    assert not cache.can_swap_in(0)
    with pytest.raises(CacheFullError):
        cache.swap_in(0)
    cache.free(1)
    cache.free(2)
    cache.check_invariants()
    assert cache.can_swap_in(0)
    cache.swap_in(0)
    assert cache.swapped_ids() == [] and cache.length(0) == 16
    assert cache._tables[0].count(HOLE) == table.count(HOLE)
    for (k, v), (k0, v0) in zip(read_all(cache, 0), before):
        torch.testing.assert_close(k, k0, atol=0, rtol=0)
        torch.testing.assert_close(v, v0, atol=0, rtol=0)
    cache.check_invariants()
    fill(cache, 0, [1, 1], seed=3)  # and it grows as before
    assert cache.length(0) == 18 and cache.swap_stats()["swap_blocks_used"] == 0


@pytest.mark.parametrize("kv", [None, "kv-int8"], ids=["float32", "kv-int8"])
def test_host_blocks_are_made_a_chunk_at_a_time_and_copies_cross_chunks(kv):
    cache = paged(kv=kv, num_blocks=12)
    cache._host.chunk = 3  # blocks a chunk: a sequence of 4 blocks spans two
    assert cache._host.made == 0  # nothing pinned before the first swap out
    want = {}
    for sid, seed in ((0, 1), (1, 2)):
        cache.allocate(sid, 14)
        fill(cache, sid, [14], seed=seed)  # 4 blocks each
        want[sid] = read_all(cache, sid)
    cache.swap_out(0)
    assert cache._host.made == 6 and len(cache._host.chunks) == 2  # host ids 0-3
    cache.swap_out(1)
    assert cache._host.made == 9 and cache._swapped[1].host == [4, 5, 6, 7]
    cache.check_invariants()
    cache.allocate(2, 24)  # overwrites the device blocks both had
    fill(cache, 2, [24], seed=3)
    cache.free(2)
    for sid in (1, 0):
        cache.swap_in(sid)
        for (k, v), (k0, v0) in zip(read_all(cache, sid), want[sid]):
            torch.testing.assert_close(k, k0, atol=0, rtol=0)
            torch.testing.assert_close(v, v0, atol=0, rtol=0)
    cache.check_invariants()
    assert cache._host.made == 9 and len(cache._host.free) == cache.swap_blocks


def test_a_prompt_swapped_mid_prefill_keeps_its_reservation():
    cache = paged()
    cache.allocate(0, 14)
    fill(cache, 0, [5])  # 5 of 14 tokens fed: 4 blocks reserved, 2 written
    assert cache.swap_bytes(0) == 2 * cache._swap_block_bytes
    cache.swap_out(0)
    cache.swap_in(0)
    assert len(cache._tables[0]) == 4 and cache.length(0) == 5
    fill(cache, 0, [9])
    cache.check_invariants()


def test_freeing_a_swapped_sequence_returns_its_host_blocks():
    cache = paged()
    cache.allocate(0, 9)
    fill(cache, 0, [9])
    cache.swap_out(0)
    stats = cache.swap_stats()
    assert stats == {"swap_blocks_total": cache.swap_blocks, "swap_blocks_used": 3,
                     "swap_blocks_made": cache.swap_blocks, "sequences_swapped": 1,
                     "swap_bytes_per_s": stats["swap_bytes_per_s"]}
    assert stats["swap_bytes_per_s"] > 0 and cache.stats()["swap_blocks_used"] == 3
    cache.free_swapped(0)
    assert cache.swap_stats()["swap_blocks_used"] == 0 and cache.swapped_ids() == []
    assert cache.stats()["blocks_free"] == 12
    cache.check_invariants()


def test_without_host_room_nothing_is_swapped():
    cache = paged(swap_space=0)
    cache.allocate(0, 5)
    fill(cache, 0, [5])
    assert not cache.can_swap_out(0)
    with pytest.raises(CacheFullError, match="host blocks"):
        cache.swap_out(0)
    assert cache.length(0) == 5
    cache.check_invariants()


@pytest.mark.parametrize("bad", [-1, "lots", 1.5, True])
def test_a_bad_swap_space_is_refused_naming_what_is_accepted(bad):
    with pytest.raises(PlanError, match="swap_space must be a byte count >= 0"):
        paged(swap_space=bad)
    with pytest.raises(PlanError, match="swap_space=4 bytes is less than one block"):
        paged(swap_space=4)  # vLLM's GiB


def test_swap_space_takes_sizes_and_defaults_to_a_small_host_pool():
    assert paged(swap_space="1KiB").swap_blocks == 1024 // paged()._swap_block_bytes
    cache = paged()
    assert cache.swap_blocks == 2 * 12 and cache._host.made == 0  # made as swaps need it


# -- whole engines -----------------------------------------------------------------------
PROMPTS = [random_prompt(5 + i, 256, 80 + i) for i in range(8)]
NEW, MAX_SEQ_LEN = 16, 32


def tight(hf, *plugins, **kw):
    """An engine whose pool is a quarter of the blocks the 8 requests want at once."""
    want = sum(blocks_for(len(p) + NEW, BS) for p in PROMPTS)
    num_blocks = max(want // 4, blocks_for(MAX_SEQ_LEN, BS))
    assert num_blocks <= want / 4 + 1
    return core.build(hf, plugins=["paged", *plugins], block_size=BS, num_blocks=num_blocks,
                      max_seq_len=MAX_SEQ_LEN, max_batch_size=8, **kw)


def generate(engine, prompts=PROMPTS):
    return [c.token_ids for c in engine.generate(prompts, max_new_tokens=NEW)]


@pytest.fixture(scope="module")
def hf_tokens(llama):
    return [hf_greedy(llama, p, NEW) for p in PROMPTS]


@pytest.fixture(scope="module")
def alone(llama):
    """Each prompt alone, in a pool that holds it whole."""
    engine = core.build(llama, plugins=["paged"], block_size=BS, max_seq_len=MAX_SEQ_LEN)
    return [generate(engine, [p])[0] for p in PROMPTS]


def settled(engine):
    st = engine.stats()
    assert st["kv_blocks_free"] == st["kv_blocks_total"] and st["num_waiting"] == 0
    assert engine.cache.swap_stats()["swap_blocks_used"] == 0
    engine.cache.check_invariants()
    return st


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_an_oversubscribed_batch_gets_its_tokens_alone_and_hfs(llama, mode, alone, hf_tokens):
    engine = tight(llama, preemption=mode)
    got = generate(engine)
    st = settled(engine)
    if mode == "swap":
        assert st["num_swapped_out"] > 0 and st["num_recomputed"] == 0, st
    else:
        assert st["num_recomputed"] > 0 and st["num_swapped_out"] == 0, st
    assert st["num_preemptions"] == st["num_swapped_out"] + st["num_recomputed"]
    assert got == alone
    assert got == hf_tokens


@pytest.mark.parametrize("rates,swaps", [(FAST_LINK, True), (SLOW_LINK, False)],
                         ids=["fast-link", "slow-link"])
def test_auto_swaps_where_swapping_is_cheaper(llama, rates, swaps, hf_tokens):
    engine = tight(llama)
    engine.scheduler.preemption = PreemptionPolicy("auto", engine.spec, rates=rates)
    got = generate(engine)
    st = settled(engine)
    assert (st["num_swapped_out"] > 0, st["num_recomputed"] > 0) == (swaps, not swaps), st
    assert got == hf_tokens


def test_sliding_window_sequences_swap_with_their_holes(mistral):
    # blocks that left the window go back to the pool, so a windowed batch rarely finds
    # that none fits, and then early, before any hole: once one has holes it is swapped
    # out here as the scheduler would, and comes back when there is room
    engine = core.build(mistral, plugins=["paged"], block_size=BS, num_blocks=8,
                        max_seq_len=MAX_SEQ_LEN, max_batch_size=8, preemption="swap")
    prompts = [random_prompt(4 + i % 3, 256, 90 + i) for i in range(8)]
    seqs = [engine.add_request(p, core.SamplingParams(max_new_tokens=24)) for p in prompts]
    sched, holed = engine.scheduler, None
    while engine.has_unfinished():
        engine.step()
        if holed is None:
            holed = next((s for s in sched.running if len(sched.running) > 1
                          and engine.cache._tables[s.id].count(HOLE)), None)
            if holed is not None:
                swap_out(sched, holed)
    assert holed is not None and holed.finish_reason == "length"
    assert settled(engine)["num_swapped_out"] > 1  # and the tight pool's own
    assert [s.output_ids for s in seqs] == [hf_greedy(mistral, p, 24) for p in prompts]


def test_int8_kv_swaps_its_scales_too(llama):
    engine = tight(llama, "kv-int8", preemption="swap")
    got = generate(engine)
    assert settled(engine)["num_swapped_out"] > 0
    # the same engine's tokens with room for the whole batch: no preemption
    roomy = core.build(llama, plugins=["paged", "kv-int8"], block_size=BS,
                       max_seq_len=MAX_SEQ_LEN, max_batch_size=8)
    assert got == generate(roomy) and roomy.stats()["num_preemptions"] == 0


def test_aborting_a_swapped_request_by_id(llama, hf_tokens):
    engine = tight(llama, preemption="swap")
    seqs = [engine.add_request(p, core.SamplingParams(max_new_tokens=NEW)) for p in PROMPTS]
    while not engine.scheduler.swapped:
        engine.step()
    victim = engine.scheduler.swapped[0]
    assert engine.abort(victim.id) == [victim] and victim.finish_reason == "abort"
    while engine.has_unfinished():
        engine.step()
    settled(engine)
    assert [s.output_ids for s in seqs if s is not victim] == \
        [t for s, t in zip(seqs, hf_tokens) if s is not victim]


def test_a_bad_preemption_is_refused_before_anything_loads(llama):
    with pytest.raises(PlanError, match="preemption must be one of"):
        core.build(llama, plugins=["paged"], preemption="swap-ish")


def test_the_config_key_is_checked_and_passed_on():
    from infergraft.core.config import resolve_config
    from infergraft.core.errors import ConfigError

    assert resolve_config({"preemption": "swap"})["preemption"] == "swap"
    with pytest.raises(ConfigError, match='preemption="sometimes" is not valid; accepted: "auto"'):
        resolve_config({"preemption": "sometimes"})
