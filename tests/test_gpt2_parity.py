"""GPT-2 policy against HF on random-initialised configs (float32, CPU)."""
import pytest
import safetensors.torch
import torch

from infergraft import core
from infergraft.core.errors import InvalidRequestError, PlanError, UnsupportedModelError
from infergraft.core.testing.models import random_model, random_prompt, tiny_gpt2_config
from infergraft.core.testing.parity import (assert_batch_matches_alone, assert_greedy_match,
                                            assert_logits_match)
from infergraft.kernels._triton import HAVE_TRITON, interpreting

CONFIGS = {  # name -> (config overrides, seed that gives varied greedy output)
    "gelu-new-tied": (dict(), 2),
    "exact-gelu-untied-n-inner": (dict(activation_function="gelu", tie_word_embeddings=False,
                                       n_inner=96, n_embd=48, n_head=6), 0),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request):
    overrides, seed = CONFIGS[request.param]
    hf = random_model(tiny_gpt2_config(**overrides), seed=seed, scale=5.0)
    return hf, core.build(hf, max_batch_size=4)  # max_seq_len: the 64 learned positions


def test_logits_match_hf(pair):
    hf, engine = pair
    for n in (1, 7, 45, 64):  # 64: every learned position
        assert_logits_match(engine, hf, random_prompt(n, 256, n), rtol=1e-4)


def test_32_greedy_tokens_match_hf(pair):
    hf, engine = pair
    outs = [assert_greedy_match(engine, hf, random_prompt(9 + s, 256, s), 32) for s in (3, 4)]
    assert len(set(outs[0] + outs[1])) >= 8, "degenerate output would make parity vacuous"


def test_batch_of_three_equals_each_alone(pair):
    hf, engine = pair
    prompts = [random_prompt(n, 256, 10 + n) for n in (3, 17, 40)]
    outs = assert_batch_matches_alone(engine, prompts, max_new_tokens=20)
    assert all(len(o) >= 1 for o in outs)


def test_too_long_prompt_is_refused_clearly(pair):
    hf, engine = pair
    assert engine.plan.max_seq_len == 64  # n_positions, taken by default
    with pytest.raises(InvalidRequestError, match=r"prompt of 70 tokens .* exceeds max_seq_len=64; "
                                                  r"the model has 64 learned positions") as e:
        engine.generate([random_prompt(70, 256, 1)], max_new_tokens=1)
    assert "larger max_seq_len" not in str(e.value)  # that advice cannot work here
    with pytest.raises(InvalidRequestError, match=r"60 tokens \+ max_new_tokens=5 = 65 exceeds "
                                                  r"max_seq_len=64"):
        engine.generate([random_prompt(60, 256, 1)], max_new_tokens=5)
    with pytest.raises(InvalidRequestError, match="65 tokens exceed max_seq_len=64"):
        engine.logits(random_prompt(65, 256, 1))
    # exactly the limit is accepted, and the refusals left the engine usable
    assert len(engine.generate([random_prompt(60, 256, 1)], max_new_tokens=4)[0].token_ids) >= 1
    # nor can the limit be raised past the learned positions
    with pytest.raises(PlanError, match="max_seq_len=65 exceeds the model's 64 learned positions"):
        core.build(hf, max_seq_len=65)


def test_fused_slots_hold_transposed_conv1d_weights():
    hf = random_model(tiny_gpt2_config(), seed=1)
    engine = core.build(hf, max_batch_size=1)
    block, ours = hf.transformer.h[1], engine.model.layers[1]
    assert torch.equal(ours.qkv.weight.cpu(), block.attn.c_attn.weight.t())  # [3H, H] = q|k|v
    assert torch.equal(ours.qkv.bias.cpu(), block.attn.c_attn.bias)
    assert torch.equal(ours.fc_in.weight.cpu(), block.mlp.c_fc.weight.t())
    assert torch.equal(ours.down.weight.cpu(), block.mlp.c_proj.weight.t())
    assert torch.equal(engine.model.pos_embed.weight.cpu(), hf.transformer.wpe.weight)
    assert engine.model.lm_head_weight is engine.model.embed.weight  # tied
    spec = engine.spec
    assert (spec.norm, spec.activation, spec.position, spec.gated_mlp) == \
        ("layer", "gelu_tanh", "learned", False)


def test_hub_layout_checkpoint_loads(tmp_path):
    """The original checkpoints: keys without 'transformer.', the attn.bias / masked_bias
    mask buffers, and no lm_head (tied)."""
    hf = random_model(tiny_gpt2_config(), seed=5, scale=5.0)
    hf.config.save_pretrained(tmp_path)
    sd = {k.removeprefix("transformer."): v.contiguous() for k, v in hf.state_dict().items()
          if k != "lm_head.weight"}
    for i in range(hf.config.n_layer):
        sd[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 64, 64))
        sd[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    safetensors.torch.save_file(sd, str(tmp_path / "model.safetensors"))
    engine = core.build(str(tmp_path), max_batch_size=1)
    assert_logits_match(engine, hf, random_prompt(20, 256, 2), rtol=1e-4)


@pytest.mark.parametrize("bad,match", [
    (dict(activation_function="relu"), "activation_function 'relu'"),
    (dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"),
    (dict(scale_attn_weights=False), "scale_attn_weights=False"),
])
def test_unsupported_configs_are_refused(bad, match):
    with pytest.raises(UnsupportedModelError, match=match):
        core.get_plugin_manager().policies().get("gpt2").describe(tiny_gpt2_config(**bad))


@pytest.mark.skipif(not (HAVE_TRITON and interpreting()), reason="needs TRITON_INTERPRET=1")
def test_triton_kernels_match_hf_under_interpreter():
    """The whole model on the Triton path (LayerNorm, GELU, kv_write) on the CPU."""
    hf = random_model(tiny_gpt2_config(), seed=2, scale=5.0)
    engine = core.build(hf, max_seq_len=16, max_batch_size=1, kernels="triton")
    assert engine.plan.kernels == "triton"
    assert_logits_match(engine, hf, random_prompt(6, 256, 9), rtol=1e-4)
