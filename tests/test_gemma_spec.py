"""Gemma 2 / 3 specs from their configs, that each feature the parity tests cover moves
HF's logits on those configs (so that parity there is not vacuous), the refusals, and
the caches' side: a backend that does not declare the attention features Gemma needs is
refused by name, every pipeline stage keeps the same blocks."""
import pytest
import torch

from infergraft import core
from infergraft.core.distributed.stages import PipelineStage, stage_spec
from infergraft.core.errors import UnsupportedModelError
from infergraft.core.hookspecs import hookimpl
from infergraft.core.spec import RopeSpec
from infergraft.core.request import SamplingParams
from infergraft.core.testing.models import (random_gemma, random_model, random_prompt,
                                            tiny_gemma2_config, tiny_gemma3_config,
                                            tiny_mistral_config)
from infergraft.core.testing.parity import hf_logits, relative_error
from infergraft.plugins.block_allocator import drop_window
from infergraft.plugins.contiguous import ContiguousBackend


def gemma(make, seed: int = 1, **overrides):
    return random_gemma(make(**overrides), seed)


def _policy(name):
    return core.get_plugin_manager().policies().get(name)


def test_gemma2_spec():
    spec = _policy("gemma2").describe(tiny_gemma2_config())
    assert [spec.layer_attention(i).window for i in range(4)] == [8, None, 8, None]
    assert {(x.attention, x.post_norms, x.rope) for x in spec.layers} == {("llama", True, None)}
    a = spec.layer_attention(0)
    assert (a.scale, a.softcap, spec.final_logit_softcap) == (24 ** -0.5, 5.0, 3.0)
    assert (spec.norm, spec.activation, spec.embed_scale, spec.tie_embeddings) == \
        ("gemma_rms", "gelu_tanh", 8.0, True)
    assert spec.kv_window is None and spec.sliding_window is None
    assert spec.attention_features == ("scale", "softcap", "layer_windows")
    # query_pre_attn_scalar = head_dim: the default scale, not a feature a cache must have
    same = _policy("gemma2").describe(tiny_gemma2_config(query_pre_attn_scalar=16))
    assert same.attention_scale is None and same.attention_features == ("softcap", "layer_windows")


def test_gemma3_spec_local_and_global_layers():
    spec = _policy("gemma3").describe(tiny_gemma3_config())
    windows = [spec.layer_attention(i).window for i in range(7)]
    assert windows == [8, 8, 8, 8, 8, None, 8]  # five local, one global (sliding_window_pattern 6)
    local = RopeSpec(theta=10_000.0, original_max_position=512)
    assert spec.rope == RopeSpec(theta=1_000_000.0, type="linear", factor=2.0,
                                 original_max_position=512)
    assert [x.rope for x in spec.layers] == [local] * 5 + [None, local]
    assert {(x.attention, x.slots) for x in spec.layers} == \
        {("gemma3", (("q_norm.weight", (16,)), ("k_norm.weight", (16,))))}
    assert spec.attn_logit_softcap is None and spec.final_logit_softcap == 3.0


def test_gemma3_ignores_attn_logit_softcapping_as_hf_does():
    """HF's Gemma 3 keeps the field but never caps its scores: neither do we."""
    hf = gemma(tiny_gemma3_config)
    capped = random_model(tiny_gemma3_config(attn_logit_softcapping=1.0), seed=1, scale=10.0)
    capped.load_state_dict(hf.state_dict())
    ids = random_prompt(20, 256, 1)
    assert torch.equal(hf_logits(capped, ids), hf_logits(hf, ids))
    assert _policy("gemma3").describe(capped.config).attn_logit_softcap is None


GLOBAL_1M = {"rope_type": "default", "rope_theta": 1_000_000.0}
ABLATIONS = {  # feature -> (config maker, the config without it)
    "gemma2-attention-softcap": (tiny_gemma2_config, dict(attn_logit_softcapping=None)),
    "gemma2-final-softcap": (tiny_gemma2_config, dict(final_logit_softcapping=None)),
    "gemma2-window": (tiny_gemma2_config, dict(sliding_window=64)),
    "gemma2-global-layers": (tiny_gemma2_config, dict(layer_types=["sliding_attention"] * 4)),
    "gemma2-query-pre-attn-scalar": (tiny_gemma2_config, dict(query_pre_attn_scalar=16)),
    "gemma3-window": (tiny_gemma3_config, dict(sliding_window=64)),
    "gemma3-local-rope-base": (tiny_gemma3_config, dict(rope_parameters={
        "sliding_attention": GLOBAL_1M,
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0}})),
    "gemma3-global-rope-scaling": (tiny_gemma3_config, dict(rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": GLOBAL_1M})),
}


@pytest.mark.parametrize("feature", sorted(ABLATIONS))
def test_each_feature_moves_hfs_logits_on_the_parity_configs(feature):
    make, without = ABLATIONS[feature]
    hf = gemma(make)
    other = random_model(make(**without), seed=1, scale=10.0)
    other.load_state_dict(hf.state_dict())
    ids = random_prompt(45, 256, 45)  # the parity tests' longest prompt
    assert relative_error(hf_logits(other, ids), hf_logits(hf, ids)) > 0.05


@pytest.mark.parametrize("overrides,match", [
    (dict(use_bidirectional_attention=True), "bidirectional attention"),
    (dict(hidden_activation="relu"), "hidden_activation 'relu' is not supported"),
    (dict(sliding_window=None), "sliding_window must be a positive integer"),
], ids=["bidirectional", "activation", "no-window"])
def test_refusals_name_the_feature(overrides, match):
    config = tiny_gemma2_config()
    for key, value in overrides.items():  # past the config's own checks
        setattr(config, key, value)
    with pytest.raises(UnsupportedModelError, match=match):
        _policy("gemma2").describe(config)


def test_gemma3_refusals_name_the_feature():
    config = tiny_gemma3_config()
    config.layer_types = ["sliding_attention"] * 6 + ["chunked_attention"]
    with pytest.raises(UnsupportedModelError, match="layer_types must name 7 layers"):
        _policy("gemma3").describe(config)
    config = tiny_gemma3_config(rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "yarn", "factor": 8.0, "rope_theta": 1e6}})
    with pytest.raises(UnsupportedModelError, match=r"global layers.*rope_type 'yarn'"):
        _policy("gemma3").describe(config)
    from transformers import Gemma3Config

    from infergraft.core.selection import choose_policy

    multimodal = Gemma3Config()
    multimodal.architectures = ["Gemma3ForConditionalGeneration"]
    policy = choose_policy(core.get_plugin_manager(), multimodal, None)  # what build picks
    with pytest.raises(UnsupportedModelError, match=r"vision tower\) is not supported.*"
                       "Gemma3ForCausalLM"):
        policy.describe(multimodal)


class _PlainContiguous(ContiguousBackend):
    """A cache written before per-layer attention: LLaMA's scale, one window, no cap."""

    name = "plain-contiguous"
    attention_features = ()


class _PlainPlugin:
    @hookimpl
    def infergraft_register_cache_backends(self, register):
        register(_PlainContiguous())


def test_a_backend_without_the_features_is_refused_naming_them(infergraft_plugin_manager):
    infergraft_plugin_manager.register(_PlainPlugin(), name="plain-cache")
    with pytest.raises(UnsupportedModelError, match=r"Gemma2ForCausalLM needs an attention "
                       r"scale other than.*a softcap on the attention scores.*a sliding window "
                       r"on some layers only.*'plain-contiguous' does not declare.*backends "
                       r"that do: contiguous, offload, paged"):
        core.build(gemma(tiny_gemma2_config), plugins=["plain-contiguous"], max_seq_len=32)
    mistral = random_model(tiny_mistral_config(), seed=0)  # one model-wide window: served
    engine = core.build(mistral, plugins=["plain-contiguous"], max_seq_len=32, max_batch_size=1)
    assert engine.plan.cache_backend == "plain-contiguous"


def test_caches_keep_every_block_and_full_rows_where_a_layer_is_global():
    hf = gemma(tiny_gemma2_config)
    contiguous = core.build(hf, max_seq_len=64, max_batch_size=1)
    assert contiguous.cache.stats()["slots_per_row"] == 64  # no ring: the global layers
    paged = core.build(hf, plugins=["paged"], max_seq_len=64, max_batch_size=1, block_size=4)
    assert paged.cache.window is None
    seq = paged.add_request(random_prompt(40, 256, 0), SamplingParams(max_new_tokens=4))
    paged.step()  # the prompt's 40 tokens
    paged.step()  # and the first sampled one: one window would keep 3 of its 11 blocks
    assert paged.cache.stats()["blocks_used"] == 11 and paged.cache.length(seq.id) == 41
    while paged.has_unfinished():
        paged.step()
    assert len(seq.output_ids) == 4


def test_every_pipeline_stage_keeps_the_blocks_the_whole_model_keeps():
    spec = _policy("gemma3").describe(tiny_gemma3_config(num_hidden_layers=6))
    first = stage_spec(spec, PipelineStage(0, 2, (0, 3)))  # three local layers only
    assert first.kv_window == 8 and spec.kv_window is None
    assert drop_window(first, spec.kv_window) is None  # kept, as the stage with the global
    mistral = _policy("mistral").describe(tiny_mistral_config(sliding_window=16))
    assert drop_window(mistral, mistral.kv_window) == 16


def test_embeddings_are_scaled_by_sqrt_hidden_rounded_to_the_model_dtype():
    """bfloat16: HF multiplies by sqrt(48) rounded to bfloat16 (6.9375, not 6.928...)."""
    hf = gemma(tiny_gemma2_config, hidden_size=48, head_dim=12).to(torch.bfloat16)
    engine = core.build(hf, dtype="bfloat16", max_seq_len=32, max_batch_size=1)
    seen = []
    hook = engine.model.layers[0].register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    ids = random_prompt(9, 256, 2)
    engine.logits(ids)
    hook.remove()
    with torch.no_grad():
        want = hf.model.embed_tokens(torch.tensor([ids]))[0]
    assert torch.equal(seen[0], want)
    assert not torch.equal(want, hf.model.embed_tokens.weight[ids] * 48 ** 0.5)
