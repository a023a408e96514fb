"""RoPE scaling kinds (core/rope.py) against transformers' own rotary embeddings on the
same configs: each table row equals HF's cos / sin at that position; a kind we cannot
match is refused at build, naming itself and what is supported."""
import pytest
import torch

from infergraft import core
from infergraft.core.errors import UnsupportedModelError
from infergraft.core.rope import (long_rope_boundary, rope_cos_sin, rope_from_config,
                                  table_rows)
from infergraft.core.testing.models import (longrope_parameters, random_model, random_prompt,
                                            tiny_llama_config, tiny_phi3_config)
from infergraft.core.testing.parity import assert_logits_match

HEAD_DIM, MAX_POS = 16, 512  # tiny_llama_config's and tiny_phi3_config's
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
            original_max_position_embeddings=128)
LLAMA_KINDS = {
    "yarn": YARN,
    # its band and rounding moved, half of each head rotated, DeepSeek's mscale pair
    "yarn-partial-betas": dict(YARN, beta_fast=16, beta_slow=2, truncate=False,
                               partial_rotary_factor=0.5, mscale=0.8, mscale_all_dim=0.5),
    "yarn-attention-factor": dict(YARN, factor=2.5, attention_factor=1.3),
    "linear": dict(rope_type="linear", rope_theta=10000.0, factor=3.0),
    "llama3": dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=64),
    "dynamic": dict(rope_type="dynamic", rope_theta=10000.0, factor=1.7),
}


def hf_cos_sin(config, length: int):
    """HF's cos, sin [length, R/2] for one forward over positions 0 .. length-1."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    cls = Phi3RotaryEmbedding if config.model_type == "phi3" else LlamaRotaryEmbedding
    cos, sin = cls(config)(torch.zeros(1), torch.arange(length)[None])
    half = cos.shape[-1] // 2
    assert torch.equal(cos[0, :, :half], cos[0, :, half:])  # rotate-half: the same twice
    return cos[0, :, :half], sin[0, :, :half]


def ours(config, length: int, table_length: int = MAX_POS):
    """Our rows for the same forward: one sequence of ``length`` tokens."""
    rope = rope_from_config(config, HEAD_DIM)
    cos, sin = rope_cos_sin(rope, HEAD_DIM, table_length)
    rows = torch.arange(length)
    boundary = long_rope_boundary(rope, table_length)
    if boundary is not None:  # the sequence's length picks the table (core/long_rope.py)
        rows = table_rows(rows, boundary, torch.full((length,), length > boundary))
    return cos[rows], sin[rows]


@pytest.mark.parametrize("kind", sorted(LLAMA_KINDS))
def test_each_kind_equals_hf_rotary_embedding(kind):
    config = tiny_llama_config(rope_parameters=dict(LLAMA_KINDS[kind]))
    for got, want in zip(ours(config, 300), hf_cos_sin(config, 300)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("length", [1, 31, 32, 33, 200])
@pytest.mark.parametrize("rotary", [1.0, 0.75])
def test_longrope_takes_the_long_factors_past_the_original_length(length, rotary):
    """HF picks the table per forward: the short one up to 32 tokens, the long one (and
    the same attention factor) for every position of a longer one."""
    config = tiny_phi3_config(rope_parameters=longrope_parameters(
        int(HEAD_DIM * rotary), partial_rotary_factor=rotary))
    got, want = ours(config, length), hf_cos_sin(config, length)
    for g, w in zip(got, want):
        assert g.shape == (length, int(HEAD_DIM * rotary) // 2)
        torch.testing.assert_close(g, w, rtol=0, atol=1e-6)
    short, long = ours(config, 20, table_length=32)[0], ours(config, 40)[0][:20]
    assert (short - long).abs().max() > 0.1  # the two tables differ where both exist


def test_yarn_scales_cos_and_sin_by_its_attention_factor():
    rope = rope_from_config(tiny_llama_config(rope_parameters=dict(YARN)), HEAD_DIM)
    assert rope.attention_factor == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1)
    cos, sin = rope_cos_sin(rope, HEAD_DIM, 8)
    assert cos[0].tolist() == [pytest.approx(rope.attention_factor)] * (HEAD_DIM // 2)


def test_the_first_phi3_configs_su_is_longrope():
    config = tiny_phi3_config()
    config.rope_parameters = dict(config.rope_parameters, rope_type="su")
    rope = rope_from_config(config, HEAD_DIM)
    assert rope.type == "longrope" and rope.original_max_position == 32


def test_a_yarn_llama_matches_hf_through_the_engine():
    hf = random_model(tiny_llama_config(rope_parameters=dict(YARN)), seed=2, scale=5.0)
    engine = core.build(hf, plugins=["paged"], max_seq_len=300, max_batch_size=1)
    assert engine.spec.rope.type == "yarn"
    assert_logits_match(engine, hf, random_prompt(260, 256, 1), rtol=1e-4)


def test_dynamic_runs_up_to_max_position_embeddings_and_is_refused_past_it():
    config = tiny_llama_config(rope_parameters=dict(LLAMA_KINDS["dynamic"]),
                               max_position_embeddings=64)
    hf = random_model(config, seed=3, scale=5.0)
    engine = core.build(hf, max_seq_len=64, max_batch_size=1)
    assert_logits_match(engine, hf, random_prompt(64, 256, 2), rtol=1e-4)
    with pytest.raises(UnsupportedModelError, match=r"rope_type 'dynamic' \(dynamic NTK "
                                                    r"scaling\) runs here only up to "
                                                    r"max_position_embeddings=64 .* "
                                                    r"max_seq_len <= 64 \(asked: 65\)"):
        core.build(hf, max_seq_len=65)


def test_an_unknown_kind_is_refused_naming_the_supported_ones():
    config = tiny_llama_config()
    config.rope_parameters = {"rope_type": "mrope", "rope_theta": 10000.0}
    with pytest.raises(UnsupportedModelError, match="rope_type 'mrope' is not supported; "
                                                    "supported: default, linear, llama3, "
                                                    "yarn, longrope, dynamic"):
        core.get_plugin_manager().policies().get("llama").describe(config)


def test_longrope_factors_of_the_wrong_length_are_refused():
    config = tiny_phi3_config()
    config.rope_parameters = dict(config.rope_parameters, long_factor=[1.0] * 8)
    with pytest.raises(UnsupportedModelError, match=r"rope_type 'longrope' needs "
                                                    r"rope_parameters\['long_factor'\]: 6 "
                                                    r"positive numbers"):
        rope_from_config(config, HEAD_DIM)
