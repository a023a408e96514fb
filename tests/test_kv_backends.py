"""Paged, offload and kv-int8 backends through the engine: token-identical to contiguous,
preemption under block pressure, n samples through fork, int8 (paged and contiguous):
bytes, closeness to float K/V, the device decode path, perplexity."""
import types

import pytest
import torch

from infergraft import core
from infergraft.core.errors import InvalidRequestError, PlanError
from infergraft.core.hookspecs import hookimpl
from infergraft.core.testing.cache_machine import cache_factory
from infergraft.core.testing.models import (random_model, random_prompt, tiny_llama_config,
                                            tiny_mistral_config)

from demo_support import demo_engine, float_reference, perplexity

LENGTHS = (3, 17, 40, 9, 26)  # a batch of mixed lengths, some crossing block edges
CONFIGS = {
    "llama-gqa": lambda: tiny_llama_config(),
    "llama-mqa-tied": lambda: tiny_llama_config(num_attention_heads=6, num_key_value_heads=1,
                                                hidden_size=48, tie_word_embeddings=True),
    "mistral-window16": lambda: tiny_mistral_config(sliding_window=16),
}
BACKENDS = {  # name -> (plugins, options): small pools so that blocks move and run out
    "paged": (["paged"], dict(block_size=4)),
    "paged-odd-blocks": (["paged"], dict(block_size=5)),
    "paged-preempting": (["paged"], dict(block_size=4, num_blocks=30)),
    "offload": (["offload"], dict(block_size=4, num_blocks=60, fast_blocks=26)),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def reference(request):
    hf = random_model(CONFIGS[request.param](), seed=1, scale=5.0)
    engine = core.build(hf, max_seq_len=96, max_batch_size=4)
    prompts = [random_prompt(n, 256, 100 + n) for n in LENGTHS]
    return hf, engine, prompts, [c.token_ids for c in engine.generate(prompts, max_new_tokens=40)]


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_greedy_and_logits_match_contiguous(reference, backend):
    hf, contiguous, prompts, want = reference
    plugins, options = BACKENDS[backend]
    engine = core.build(hf, plugins=plugins, max_seq_len=96, max_batch_size=4, **options)
    got = [c.token_ids for c in engine.generate(prompts, max_new_tokens=40)]
    assert got == want
    assert len({len(t) for t in got}) > 1 or len(got[0]) == 40  # the outputs are not trivial
    for ids in prompts[1:3]:
        torch.testing.assert_close(engine.logits(ids), contiguous.logits(ids), atol=1e-5, rtol=1e-5)
    st = engine.cache.stats()
    assert st["sequences"] == 0 and st["blocks_free"] == st["blocks_total"]
    engine.cache.check_invariants()
    sched = engine.scheduler
    if getattr(hf.config, "sliding_window", None):  # out-of-window blocks go back: pools suffice
        assert sched.num_preemptions == 0 and st.get("swapped_out", 0) == 0
    elif backend == "paged-preempting":  # 30 blocks of 4 cannot hold 4 sequences of ~80 tokens
        assert sched.num_preemptions > 0
    elif backend == "offload":
        assert st["swapped_out"] > 0 and st["swapped_in"] > 0 and sched.num_paused > 0


def test_offload_moves_paused_blocks_to_the_slow_pool_and_back():
    hf = random_model(tiny_llama_config(), seed=3)
    engine = core.build(hf, plugins=["offload"], max_seq_len=64, max_batch_size=2,
                        block_size=4, fast_blocks=16)
    cache = engine.cache
    ids = random_prompt(30, 256, 7)  # 8 blocks
    cache.allocate("a", len(ids))
    engine.model(torch.tensor(ids, device=engine.device), cache, cache.prepare(["a"], [len(ids)]))
    before = [t.clone() for t in cache.read("a", 1)]
    assert cache.stats()["fast_blocks_used"] == 8
    cache.pause("a")
    st = cache.stats()
    assert (st["fast_blocks_used"], st["slow_blocks_used"], st["swapped_out"]) == (0, 8, 8)
    for a, b in zip(cache.read("a", 1), before):  # readable from the slow pool
        assert torch.equal(a, b)
    cache.prepare(["a"], [1])  # a step brings every block back before it is read
    st = cache.stats()
    assert (st["fast_blocks_used"], st["slow_blocks_used"], st["swapped_in"]) == (8, 0, 8)
    cache.check_invariants()
    cache.free("a")
    assert cache.stats()["fast_blocks_used"] == 0
    assert st["bytes_fast"] < st["bytes_slow"]  # 16 fast blocks, 32 in the slow pool


def test_n_samples_share_the_prompt_through_fork(monkeypatch):
    hf = random_model(tiny_llama_config(), seed=2, scale=5.0)
    engine = core.build(hf, plugins=["paged"], max_seq_len=96, max_batch_size=4, block_size=4)
    prompt = random_prompt(10, 256, 5)  # 2 full blocks + a partial one
    shared = []
    real_fork = engine.cache.fork

    def spy(parent, child):
        real_fork(parent, child)
        shared.append(engine.cache.stats()["blocks_shared"])
    monkeypatch.setattr(engine.cache, "fork", spy)
    outs = engine.generate(prompt, max_new_tokens=12, temperature=1.0, seed=11, n=3)
    assert shared == [2, 2]  # the two full blocks, shared by all three samples
    alone = [engine.generate(prompt, max_new_tokens=12, temperature=1.0, seed=11 + i)[0]
             for i in range(3)]
    assert [o.token_ids for o in outs] == [a.token_ids for a in alone]
    assert len({tuple(o.token_ids) for o in outs}) > 1  # different seeds, different samples
    assert all(o.prompt_token_ids == prompt for o in outs)
    assert engine.cache.stats()["blocks_used"] == 0
    two = engine.generate([prompt, prompt[:4]], max_new_tokens=5, n=2)  # prompt-major order
    assert [len(c.prompt_token_ids) for c in two] == [10, 10, 4, 4]
    assert two[0].token_ids == two[1].token_ids  # greedy samples agree
    with pytest.raises(InvalidRequestError, match="n .samples per prompt. must be"):
        engine.generate(prompt, n=0)


def test_n_samples_without_fork_support_prefill_each():
    from infergraft.core.cache import KVCache

    hf = random_model(tiny_llama_config(), seed=2, scale=5.0)
    engine = core.build(hf, max_seq_len=64, max_batch_size=2)
    prompt = random_prompt(7, 256, 5)
    want = [c.token_ids for c in engine.generate(prompt, max_new_tokens=6, temperature=0.8,
                                                 seed=3, n=3)]
    engine.cache.fork = lambda p, c: KVCache.fork(engine.cache, p, c)  # NotImplementedError
    got = [c.token_ids for c in engine.generate(prompt, max_new_tokens=6, temperature=0.8,
                                                seed=3, n=3)]
    assert got == want and len(got) == 3  # 3 samples with only 2 rows: one waited


@pytest.mark.parametrize("backend,options", [("paged", dict(block_size=8)), ("contiguous", {})])
def test_kv_int8_halves_kv_bytes_and_stays_close(backend, options):
    cfg = tiny_llama_config(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                            hidden_size=128)
    hf = random_model(cfg, seed=4)
    kw = dict(max_seq_len=64, max_batch_size=2, **options)
    bf16 = core.build(hf, plugins=[backend], dtype="bfloat16", **kw)
    int8 = core.build(hf, plugins=[backend, "kv-int8"], **kw)
    f32 = core.build(hf, plugins=[backend], **kw)
    L, hkv, d = 2, 2, 32
    assert int8.plan.kv_dtype == "int8" and int8.plan.quantizers == ("kv-int8",)
    assert int8.plan.cache_backend == backend
    assert int8.plan.kv_bytes_per_token == 2 * L * hkv * (d + 4)
    assert bf16.plan.kv_bytes_per_token == 2 * L * hkv * d * 2
    slots = 2 * 64  # paged default pool and contiguous rows: max_batch_size x max_seq_len
    assert int8.cache.stats()["bytes"] == slots * int8.plan.kv_bytes_per_token
    assert bf16.cache.stats()["bytes"] == slots * bf16.plan.kv_bytes_per_token
    assert int8.cache.stats()["bytes"] / bf16.cache.stats()["bytes"] == (d + 4) / (2 * d)
    ids = random_prompt(50, 256, 1)
    a, b = int8.logits(ids), f32.logits(ids)
    assert 0 < (a - b).abs().max() / b.abs().max() < 0.02  # quantised, but only just
    assert (a.argmax(-1) == b.argmax(-1)).all()


# greedy int8 need not be token-identical to float (a near tie flips, and the continuation
# then differs); what must hold: every position's logits, teacher-forced on the float
# continuation, within this of float K/V (max |int8 - float| / max |float|; measured
# 0.003 - 0.016 on these models), and the very same tokens as paged + int8, which stores
# the same quantised values
INT8_LOGITS_RTOL = 0.03


def test_contiguous_kv_int8_generates_close_to_float(reference):
    hf, f32, prompts, want = reference
    kw = dict(max_seq_len=96, max_batch_size=4)
    int8 = core.build(hf, plugins=["kv-int8"], **kw)  # contiguous: the default backend
    assert (int8.plan.cache_backend, int8.plan.kv_dtype) == ("contiguous", "int8")
    got = [c.token_ids for c in int8.generate(prompts, max_new_tokens=40)]
    paged = core.build(hf, plugins=["paged", "kv-int8"], block_size=4, **kw)
    assert got == [c.token_ids for c in paged.generate(prompts, max_new_tokens=40)]
    agree = total = 0
    for p, cont in zip(prompts, want):
        ids = p + cont[:-1]  # longer than the window of the Mistral config
        a, b = int8.logits(ids), f32.logits(ids)
        err = ((a - b).abs().max() / b.abs().max()).item()
        assert 0 < err < INT8_LOGITS_RTOL, err  # quantised, but only just
        agree += (a.argmax(-1) == b.argmax(-1)).sum().item()
        total += len(ids)
    assert agree / total > 0.9, agree / total
    assert int8.cache.stats()["sequences"] == 0


@pytest.mark.parametrize("kv,stored", [("kv-int8", torch.int8), ("kv-fp8", torch.float8_e4m3fn)],
                         ids=["int8", "fp8"])
@pytest.mark.parametrize("cfg", [tiny_llama_config(), tiny_mistral_config(sliding_window=8)],
                         ids=["llama", "mistral-window8"])
def test_contiguous_quantised_kv_device_decode_matches_host_path(cfg, kv, stored, monkeypatch):
    """The tensor-only decode (what CUDA graphs capture) reads int8 / e4m3 through the
    scales."""
    hf = random_model(cfg, seed=2, scale=5.0)
    kw = dict(plugins=[kv], max_seq_len=64, max_batch_size=4)
    host, dev = core.build(hf, **kw), core.build(hf, **kw)
    dev.cache.device_decode = True
    scales, real = [], dev.cache.ops.paged_attention

    def spy(q, k, v, tables, lens, scale, window, k_scale, v_scale, *, softcap, counters):
        scales.append((k.dtype, v.dtype, k_scale.dtype, v_scale.shape == k.shape[:3]))
        assert counters is dev.cache.counters and softcap is None  # the cache's own counters
        return real(q, k, v, tables, lens, scale, window, k_scale, v_scale, counters=counters)
    monkeypatch.setattr(dev.cache, "ops", types.SimpleNamespace(**{**vars(dev.cache.ops),
                                                                  "paged_attention": spy}))
    prompts = [random_prompt(n, cfg.vocab_size, n) for n in (3, 12, 20)]
    want = [c.token_ids for c in host.generate(prompts, max_new_tokens=16)]
    assert [c.token_ids for c in dev.generate(prompts, max_new_tokens=16)] == want
    assert scales and set(scales) == {(stored, stored, torch.float32, True)}
    assert host.cache.counters is not dev.cache.counters  # one pool per cache (KVCache)


class FloatRowsPlugin:
    """A cache backend that stores float K/V only (no ``quantized_kv``)."""

    @hookimpl
    def infergraft_register_cache_backends(self, register):
        from infergraft.plugins.contiguous import ContiguousBackend

        backend = ContiguousBackend()
        backend.name, backend.quantized_kv = "float-rows", ()
        register(backend)


def test_kv_int8_needs_a_backend_that_stores_it():
    hf = random_model(tiny_llama_config(), seed=4)
    with pytest.raises(PlanError, match="cache backend 'float-rows' cannot store int8 K/V"):
        core.build(hf, plugins=[FloatRowsPlugin(), "kv-int8"], max_seq_len=32)
    int4 = types.SimpleNamespace(name="kv-int4", kv_dtype="int4")  # a format nobody stores
    with pytest.raises(PlanError, match="contiguous: cannot store K/V as 'int4'.*supported: int8"):
        cache_factory("contiguous", kv_quantizer=int4)()


@pytest.mark.parametrize("options,match", [
    (dict(block_size=0), "block_size must be an integer >= 1"),
    (dict(block_size=16, num_blocks=3), r"num_blocks must be an integer >= 4"),
    (dict(plugins=["offload"], fast_blocks=2), r"fast_blocks must be an integer in \[4, 16\]"),
])
def test_bad_pool_options_are_refused(options, match):
    hf = random_model(tiny_llama_config(), seed=4)
    plugins = options.pop("plugins", ["paged"])
    with pytest.raises(PlanError, match=match):
        core.build(hf, plugins=plugins, max_seq_len=64, max_batch_size=4, **options)


@pytest.mark.slow
def test_demo_model_perplexity_with_int8_kv_within_one_percent():
    ids, p_float, _ = float_reference()
    assert len(ids) >= 2000
    assert 1.0 < p_float < 100.0  # the model reads this text sensibly
    for backend in ("paged", "contiguous"):
        int8 = demo_engine([backend, "kv-int8"])
        p_int8 = perplexity(int8, ids)
        print(f"perplexity over {len(ids)} tokens: float K/V {p_float:.4f}, "
              f"{backend} int8 K/V {p_int8:.4f}")
        assert abs(p_int8 - p_float) / p_float < 0.01, backend
        spec = int8.spec
        bf16_per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 2
        assert int8.plan.kv_bytes_per_token == \
            2 * spec.num_layers * spec.num_kv_heads * (spec.head_dim + 4)
        assert int8.plan.kv_bytes_per_token / bf16_per_token <= 0.55
        assert int8.cache.stats()["bytes"] == 2048 * int8.plan.kv_bytes_per_token
        del int8
