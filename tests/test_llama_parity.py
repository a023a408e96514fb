"""LLaMA policy against HF transformers on random-initialised configs (float32, CPU)."""
import pytest
import torch

from infergraft import core
from infergraft.core.testing.models import random_model, random_prompt, tiny_llama_config
from infergraft.core.testing.parity import (assert_batch_matches_alone, assert_greedy_match,
                                            assert_logits_match)

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
CONFIGS = {
    "mha-untied": dict(num_attention_heads=4, num_key_value_heads=4),
    "gqa-untied": dict(num_attention_heads=4, num_key_value_heads=2),
    "gqa-tied": dict(num_attention_heads=6, num_key_value_heads=2, hidden_size=48,
                     tie_word_embeddings=True),
    "mqa-llama3-rope": dict(num_attention_heads=4, num_key_value_heads=1,
                            rope_parameters=LLAMA3_ROPE, max_position_embeddings=256),
    "head-dim-override-bias": dict(head_dim=24, attention_bias=True, mlp_bias=True),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request):
    cfg = tiny_llama_config(**CONFIGS[request.param])
    hf = random_model(cfg, seed=len(request.param), scale=5.0)
    return hf, core.build(hf, max_seq_len=160, max_batch_size=4)


def test_logits_match_hf(pair):
    hf, engine = pair
    for n, seed in ((1, 0), (7, 1), (45, 2)):
        assert_logits_match(engine, hf, random_prompt(n, hf.config.vocab_size, seed), rtol=1e-4)


def test_32_greedy_tokens_match_hf(pair):
    hf, engine = pair
    for seed in (3, 4):
        assert_greedy_match(engine, hf, random_prompt(9 + seed, hf.config.vocab_size, seed), 32)


def test_batch_of_three_equals_each_alone(pair):
    hf, engine = pair
    prompts = [random_prompt(n, hf.config.vocab_size, 10 + n) for n in (3, 17, 40)]
    outs = assert_batch_matches_alone(engine, prompts, max_new_tokens=12)
    assert all(len(o) >= 1 for o in outs)


def test_spec_from_config_reads_rope_parameters():
    cfg = tiny_llama_config(num_key_value_heads=1, rope_parameters=LLAMA3_ROPE)
    spec = core.get_plugin_manager().policies().get("llama").describe(cfg)
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (4, 1, 16)
    assert spec.rope.type == "llama3" and spec.rope.theta == 500000.0 and spec.rope.factor == 8.0
    assert spec.rope.original_max_position == 64
    assert not spec.tie_embeddings and spec.norm == "rms" and spec.gated_mlp


def test_fused_slots_hold_hf_weights_in_order():
    cfg = tiny_llama_config()
    hf = random_model(cfg, seed=1)
    engine = core.build(hf, max_seq_len=32, max_batch_size=1)
    attn, mlp = hf.model.layers[1].self_attn, hf.model.layers[1].mlp
    qkv = engine.model.layers[1].qkv.weight.cpu()
    assert torch.equal(qkv, torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
    gate_up = engine.model.layers[1].gate_up.weight.cpu()
    assert torch.equal(gate_up, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
    # the build keeps no HF module: nothing in the engine's tree is an HF layer
    assert not any("transformers" in type(m).__module__ for m in engine.model.modules())


def test_device_decode_path_matches_host_path():
    """The tensor-only decode path that CUDA graphs capture gives the same tokens."""
    from infergraft.core.testing.models import tiny_mistral_config

    for cfg in (tiny_llama_config(), tiny_mistral_config(sliding_window=8)):
        hf = random_model(cfg, seed=2, scale=5.0)
        host = core.build(hf, max_seq_len=64, max_batch_size=4)
        dev = core.build(hf, max_seq_len=64, max_batch_size=4)
        dev.cache.device_decode = True
        prompts = [random_prompt(n, cfg.vocab_size, n) for n in (3, 12, 20)]
        want = [c.token_ids for c in host.generate(prompts, max_new_tokens=16)]
        assert [c.token_ids for c in dev.generate(prompts, max_new_tokens=16)] == want
