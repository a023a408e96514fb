"""Gemma 2 and Gemma 3 (text) against HF on random configs (float32, CPU) that exercise
every feature: local layers with a window of 8 between global ones (prompts of up to 45
tokens), both softcaps, a query_pre_attn_scalar that is not head_dim, sandwich norms and
(1 + weight) RMSNorms with weights drawn around 0, the GELU-gated MLP, the embeddings
times sqrt(hidden), tied and untied heads, Gemma 3's q / k norms and its local and global
RoPE (linear scaling on the global one). Through the policy and layer kits, both caches,
chunked prefill and mixed steps, int8 weights, int8 K/V, prefix caching, and tensor and
pipeline parallel ranks; that each feature moves HF's logits: test_gemma_spec.py."""
import pytest
import torch

from infergraft import core
from infergraft.core.request import SamplingParams
from infergraft.core.testing.layer_kit import LayerTests
from infergraft.core.testing.models import (random_gemma, random_prompt, tiny_gemma2_config,
                                            tiny_gemma3_config)
from infergraft.core.testing.parity import (assert_greedy_match, assert_logits_match,
                                            hf_greedy, hf_logits, relative_error)
from infergraft.core.testing.policy_kit import PolicyTests

CONFIGS = {  # name -> (config maker, overrides)
    "gemma2-gqa-tied": (tiny_gemma2_config, {}),
    # exact GELU, biases, MHA, an untied head, the default scale (query_pre_attn_scalar 16)
    "gemma2-mha-untied-bias": (tiny_gemma2_config, dict(
        num_key_value_heads=4, tie_word_embeddings=False, attention_bias=True,
        hidden_activation="gelu", query_pre_attn_scalar=16)),
    "gemma3-gqa-tied": (tiny_gemma3_config, {}),
}


def gemma(make, seed: int = 1, **overrides):
    return random_gemma(make(**overrides), seed)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def gemma_model(request):
    make, overrides = CONFIGS[request.param]
    return gemma(make, **overrides)


@pytest.fixture
def policy(gemma_model):
    name = "gemma2" if gemma_model.config.model_type == "gemma2" else "gemma3"
    return core.get_plugin_manager().policies().get(name)


class TestGemmaPolicy(PolicyTests):
    @pytest.fixture
    def hf_model(self, gemma_model):
        return gemma_model


class TestGemmaNorm(LayerTests):
    @pytest.fixture
    def layer_impl(self):
        return core.get_plugin_manager().layers()["norm"].get("gemma_rms")

    @pytest.fixture
    def spec(self, policy, gemma_model):
        return policy.describe(gemma_model.config)


class TestGemma3Attention(LayerTests):
    @pytest.fixture
    def layer_impl(self):
        return core.get_plugin_manager().layers()["attention"].get("gemma3")

    @pytest.fixture
    def spec(self):
        return core.get_plugin_manager().policies().get("gemma3").describe(tiny_gemma3_config())


@pytest.mark.parametrize("make", [tiny_gemma2_config, tiny_gemma3_config], ids=["gemma2", "gemma3"])
@pytest.mark.parametrize("cache", ["contiguous", "paged"])
def test_chunked_prefill_and_mixed_steps_match_hf(cache, make):
    """Prompts fed 16 tokens a step (45: three chunks across the window and a rest), and a
    batch whose steps mix prompt chunks with decode tokens."""
    hf = gemma(make)
    engine = core.build(hf, plugins=[cache], max_seq_len=128, max_batch_size=4,
                        max_num_batched_tokens=16)
    assert engine.plan.cache_backend == cache and engine.plan.sliding_window is None
    for n, seed in ((1, 0), (45, 1)):
        assert_logits_match(engine, hf, random_prompt(n, 256, seed), rtol=1e-4)
    assert_greedy_match(engine, hf, random_prompt(12, 256, 2), 40)  # ends at 52 > 6 windows
    prompts = [random_prompt(n, 256, 20 + n) for n in (3, 17, 40)]
    outs = [c.token_ids for c in engine.generate(prompts, max_new_tokens=12)]
    assert outs == [hf_greedy(hf, p, 12) for p in prompts]
    assert len({t for o in outs for t in o}) >= 8, "degenerate output would make parity vacuous"


def test_gemma3_untied_mqa_with_its_own_layer_pattern_on_the_paged_cache():
    """Gemma 3 of another shape: MQA, an untied head, layer_types given (global, local,
    local, global), unscaled global RoPE, no final softcap."""
    types = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
    hf = gemma(tiny_gemma3_config, seed=2, num_hidden_layers=4, num_key_value_heads=1,
               tie_word_embeddings=False, layer_types=types, final_logit_softcapping=None,
               rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
                                "full_attention": {"rope_type": "default", "rope_theta": 50_000.0}})
    engine = core.build(hf, plugins=["paged"], max_seq_len=96, max_batch_size=2)
    spec = engine.spec
    assert [spec.layer_attention(i).window for i in range(4)] == [None, 8, 8, None]
    assert not spec.tie_embeddings and spec.num_kv_heads == 1
    for n in (7, 40):
        assert_logits_match(engine, hf, random_prompt(n, 256, n), rtol=1e-4)
    assert_greedy_match(engine, hf, random_prompt(10, 256, 5), 30)


def test_int8_weights_match_hf_on_the_dequantised_weights():
    """int8 rows (one scale per output row, so q, k, v and gate, up quantise apart as they
    do fused): our engine against HF holding the same dequantised projections."""
    hf = gemma(tiny_gemma3_config)
    int8 = core.get_plugin_manager().quantizers().get("int8")
    engine = core.build(hf, plugins=["paged", "int8"], max_seq_len=64, max_batch_size=2)
    assert engine.plan.quantizers == ("int8",)
    ids = random_prompt(30, 256, 1)
    before = hf_logits(hf, ids)
    with torch.no_grad():
        for name, module in hf.named_modules():
            if name.endswith("_proj"):
                module.weight.copy_(int8.unpack(int8.pack(module.weight)))
    assert relative_error(hf_logits(hf, ids), before) > 1e-3  # the rounding shows
    assert_logits_match(engine, hf, ids, rtol=1e-4)
    assert_greedy_match(engine, hf, random_prompt(10, 256, 2), 16)


@pytest.mark.parametrize("cache", ["contiguous", "paged"])
def test_int8_kv_greedy_matches_hf_storing_int8_kv(cache):
    hf = gemma(tiny_gemma3_config)
    engine = core.build(hf, plugins=[cache, "kv-int8"], max_seq_len=96, max_batch_size=2)
    ids = random_prompt(30, 256, 3)
    ours = engine.generate([ids], max_new_tokens=16)[0].token_ids
    assert ours == hf_greedy(hf, ids, 16, kv_int8=True)


def test_prefix_cache_hits_keep_hf_tokens_with_global_layers():
    """A second prompt sharing 32 tokens (four windows) with the first: its cached blocks
    are reused, none dropped (the global layers read them), and the tokens are HF's."""
    hf = gemma(tiny_gemma2_config)
    engine = core.build(hf, plugins=["paged"], max_seq_len=96, max_batch_size=2, block_size=8)
    shared = random_prompt(32, 256, 7)
    first, second = shared + random_prompt(5, 256, 8), shared + random_prompt(9, 256, 9)
    assert engine.generate([first], max_new_tokens=8)[0].token_ids == hf_greedy(hf, first, 8)
    seq = engine.add_request(second, SamplingParams(max_new_tokens=8))
    while engine.has_unfinished():
        engine.step()
    assert seq.num_cached_tokens >= 24 and seq.output_ids == hf_greedy(hf, second, 8)


def test_two_tensor_parallel_and_two_pipeline_ranks_match_hf():
    """tp: the post norms after the all-reduce, the q / k norms replicated; pp: Gemma 3's
    first stage holds three local layers only (blocks fall behind all its windows), yet it
    keeps every block as the stage with the global layer must, so both schedule alike."""
    from infergraft.core.testing.distributed import run_ranks, tp_parity_cases

    prompts = [[1, 5, 9, 33, 7, 80, 12, 40, 41, 42, 43, 44], [1, 200, 3]]
    cases = [dict(config=tiny_gemma2_config(), plugins=["tp", "paged"], prompts=prompts),
             dict(config=tiny_gemma3_config(), plugins=["tp", "contiguous"], prompts=prompts),
             dict(config=tiny_gemma3_config(num_hidden_layers=6), plugins=["pp", "paged"],
                  prompts=prompts)]
    ranks = run_ranks(tp_parity_cases, 2, cases, timeout=600)
    for i, case in enumerate(cases):
        r0, r1 = ranks[0][i], ranks[1][i]
        tp = "tp" in case["plugins"]
        assert (r0["tensor_parallel"], r0["stages"]) == ((2, 1) if tp else (1, 2))
        assert max(r0["errors"]) < 1e-4 and r0["errors"] == r1["errors"], (i, r0["errors"])
        assert r0["ours"] == r0["hf"] == r1["ours"], i
