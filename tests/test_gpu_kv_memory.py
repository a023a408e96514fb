"""KV memory for serving on the GPU (issue 24): prefix hits through the Triton varlen
kernel and the mixed-step CUDA graphs, swap preemption through the copy stream, a pool
sized to the device. float32 greedy tokens against HF.

Skipped cleanly without CUDA (CI); run on the GPU machine, results in docs/BENCHMARKS.md.
"""
import pytest
import torch

from infergraft import core
from infergraft.core.testing.models import random_model, random_prompt, tiny_llama_config
from infergraft.core.testing.parity import hf_greedy

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CFG = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=3,
           num_attention_heads=8, num_key_value_heads=2, vocab_size=1024)


@pytest.fixture(scope="module")
def hf():
    return random_model(tiny_llama_config(**CFG), seed=5, scale=5.0).cuda()


def _shared(n_prefix, tails, seed):
    prefix = random_prompt(n_prefix, 1024, seed)
    return [prefix + random_prompt(t, 1024, seed + 1 + i) for i, t in enumerate(tails)]


@pytest.mark.parametrize("kv", [None, "kv-int8"], ids=["fp32-kv", "int8-kv"])
def test_prefix_hits_through_the_varlen_kernel_and_step_graphs(hf, kv):
    plugins = ["paged"] + ([kv] if kv else [])
    kw = dict(device="cuda", dtype=torch.float32, max_seq_len=512, max_batch_size=8,
              block_size=16)
    engine = core.build(hf, plugins=plugins, **kw)
    plain = core.build(hf, plugins=plugins, prefix_caching=False, **kw)
    prompts = _shared(100, [3, 17, 40, 64], seed=1)  # 100: six full blocks and a partial
    engine.generate([prompts[0]], max_new_tokens=4)
    got = [c.token_ids for c in engine.generate(prompts, max_new_tokens=24)]
    assert got == [c.token_ids for c in plain.generate(prompts, max_new_tokens=24)]
    if kv is None:
        assert got == [hf_greedy(hf, p, 24) for p in prompts]
    assert engine.stats()["prefix_cache_hits"] >= 4 * 96
    engine.cache.check_invariants()


@pytest.mark.parametrize("preemption", ["swap", "recompute"])
def test_an_oversubscribed_pool_gives_every_request_its_tokens_alone(hf, preemption):
    # 8 sequences of 40 + 80 tokens want 64 blocks of 16; the pool holds 16
    engine = core.build(hf, plugins=["paged"], device="cuda", dtype=torch.float32,
                        max_seq_len=160, max_batch_size=8, block_size=16, num_blocks=16,
                        preemption=preemption)
    prompts = [random_prompt(40, 1024, 10 + i) for i in range(8)]
    got = [c.token_ids for c in engine.generate(prompts, max_new_tokens=80)]
    assert got == [hf_greedy(hf, p, 80) for p in prompts]
    st = engine.stats()
    key = "num_swapped_out" if preemption == "swap" else "num_recomputed"
    assert st[key] > 0 and st["num_preemptions"] == st[key], st
    if preemption == "swap":  # the copies timed by their events, for "auto"'s later choices
        torch.cuda.synchronize()
        assert engine.cache._copy_rate() > 0 and not engine.cache._timings
    engine.cache.check_invariants()


def test_the_default_pool_is_sized_to_the_device(hf):
    free, _ = torch.cuda.mem_get_info()
    # 256 x 8192 tokens would want 3.2 GB: 1% of the device binds first
    engine = core.build(hf, plugins=["paged"], device="cuda", dtype=torch.float32,
                        max_seq_len=8192, max_batch_size=256, gpu_memory_utilization=0.01)
    pool = engine.stats()["kv_blocks_total"] * engine.cache.block_size * \
        engine.plan.kv_bytes_per_token
    assert 0.005 * free < pool <= 0.01 * free, (pool, free)
    prompt = random_prompt(30, 1024, 3)
    assert engine.generate([prompt], max_new_tokens=16)[0].token_ids == hf_greedy(hf, prompt, 16)
