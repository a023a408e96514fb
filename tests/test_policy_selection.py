"""Which policy core.build() picks: from the config, forced by name, and on conflicts."""
import types

import pytest

from infergraft import core
from infergraft.core.build import choose_policy
from infergraft.core.errors import UnknownPluginError, UnsupportedModelError
from infergraft.core.policy import Policy
from infergraft.core.testing.models import (random_model, random_prompt, tiny_gpt2_config,
                                            tiny_llama_config, tiny_mistral_config,
                                            tiny_phi3_config)
from infergraft.policies.llama import llama_like_spec, llama_like_weight_map


class OtherLlama(Policy):
    """A third-party policy claiming the same architecture as the built-in one."""

    name = "other-llama"
    architectures = ("LlamaForCausalLM",)

    def describe(self, config):
        self.check(config)
        return llama_like_spec(config, architecture="LlamaForCausalLM")

    def weight_map(self, spec):
        return llama_like_weight_map(spec)


class OtherLlamaPlugin:
    INFERGRAFT_PLUGIN_NAME = "other-llama-plugin"

    @core.hookimpl
    def infergraft_register_policies(self, register):
        register(OtherLlama())


@pytest.fixture(scope="module")
def models():
    return {name: random_model(make(), seed=0) for name, make in
            (("llama", tiny_llama_config), ("mistral", tiny_mistral_config),
             ("gpt2", tiny_gpt2_config), ("phi3", tiny_phi3_config))}


@pytest.fixture
def rival():
    """OtherLlamaPlugin registered on the process-wide manager for one test."""
    pm = core.get_plugin_manager()
    name = pm.register(OtherLlamaPlugin())
    yield pm
    pm.unregister(name)
    assert "other-llama" not in pm.policies()


def _build(model, plugins=None):
    return core.build(model, plugins, max_seq_len=32, max_batch_size=1)


@pytest.mark.parametrize("family", ["llama", "mistral", "gpt2", "phi3"])
def test_architecture_picks_the_policy(models, family):
    engine = _build(models[family])
    assert engine.plan.policy == family
    assert engine.logits(random_prompt(5, 256, 0)).shape == (5, 256)


def test_model_type_is_the_fallback():
    pm = core.get_plugin_manager()
    for model_type in ("llama", "mistral", "gpt2", "phi3"):
        config = types.SimpleNamespace(architectures=None, model_type=model_type)
        assert choose_policy(pm, config, None).name == model_type


def test_unknown_architecture_lists_the_supported_ones():
    config = types.SimpleNamespace(architectures=["FalconForCausalLM"], model_type="falcon")
    with pytest.raises(UnsupportedModelError, match="FalconForCausalLM") as err:
        choose_policy(core.get_plugin_manager(), config, None)
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "GPT2LMHeadModel"):
        assert arch in str(err.value)


@pytest.mark.parametrize("archs,model_type,closest", [
    (["Phi3SmallForCausalLM"], "phi3small", "Phi3ForCausalLM (phi3)"),
    (["Phi3VForCausalLM"], "phi3_v", "Phi3ForCausalLM (phi3)"),
    (["LLaMAForCausalLM"], None, "LlamaForCausalLM (llama)"),  # case aside
    (["Llama4ForConditionalGeneration"], "llama4", "LlamaForCausalLM (llama)"),
    (["MistralModel"], "mistral3", "MistralForCausalLM (mistral)"),  # a head we do not run
    (["Qwen3NextForCausalLM"], "qwen3_next", "Qwen3MoeForCausalLM (qwen3_moe)")])  # contrib's
def test_an_unknown_architecture_names_the_closest_supported_ones(archs, model_type, closest):
    config = types.SimpleNamespace(architectures=archs, model_type=model_type)
    with pytest.raises(UnsupportedModelError) as err:
        choose_policy(core.get_plugin_manager(), config, None)
    assert str(err.value).startswith(f"no registered policy supports {archs[0]} (closest "
                                     f"supported by name: {closest}")
    supported = str(err.value).split("; supported architectures: ")[1].split(", ")
    assert supported == sorted(supported)
    assert {"GPT2LMHeadModel", "LlamaForCausalLM", "MistralForCausalLM"} <= set(supported)


def test_nothing_close_adds_no_guess():
    config = types.SimpleNamespace(architectures=["GPTNeoXForCausalLM"], model_type="gpt_neox")
    with pytest.raises(UnsupportedModelError, match=r"^no registered policy supports "
                                                    r"GPTNeoXForCausalLM; supported "):
        choose_policy(core.get_plugin_manager(), config, None)


def test_forced_policy_is_used(models):
    assert _build(models["mistral"], ["mistral"]).plan.policy == "mistral"
    assert _build(models["gpt2"], "gpt2").plan.policy == "gpt2"


@pytest.mark.parametrize("forced,family", [("mistral", "gpt2"), ("gpt2", "llama"),
                                           ("llama", "mistral")])
def test_forced_policy_that_does_not_fit_fails_clearly(models, forced, family):
    arch = models[family].config.architectures[0]
    with pytest.raises(UnsupportedModelError,
                       match=rf"policy '{forced}' does not support {arch}; it supports"):
        _build(models[family], [forced])


def test_unknown_policy_name_fails_clearly(models):
    with pytest.raises(UnknownPluginError, match="unknown plugin 'mistrall'") as err:
        _build(models["mistral"], ["mistrall"])
    # what is registered, by kind, to pick from
    assert "Registered policies: " in str(err.value) and "llama, mistral" in str(err.value)
    assert "quantizers: fp8, int4, int8, kv-fp8, kv-int8" in str(err.value)


def test_two_claimants_without_a_choice_name_both(models, rival):
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM") as err:
        _build(models["llama"])
    msg = str(err.value)
    assert "'llama'" in msg and "'other-llama'" in msg and "other-llama-plugin" in msg
    assert "plugins=[name]" in msg
    # other families are unaffected by the clash
    assert _build(models["mistral"]).plan.policy == "mistral"


@pytest.mark.parametrize("named", ["llama", "other-llama"])
def test_two_claimants_the_named_one_wins(models, rival, named):
    engine = _build(models["llama"], [named])
    assert engine.plan.policy == named


def test_plugin_object_passed_to_build_is_the_named_choice(models):
    # an object in plugins=[...] is registered for this build only, and selected
    engine = _build(models["llama"], [OtherLlamaPlugin()])
    assert engine.plan.policy == "other-llama"
    assert "other-llama" not in core.get_plugin_manager().policies()
    assert _build(models["llama"]).plan.policy == "llama"


# -- sizes: ModelSpec refuses what no policy should hand the planner or the model --------

def _spec(**sizes):
    from infergraft.core.spec import ModelSpec

    kw = dict(architecture="X", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
              head_dim=16, intermediate_size=128, vocab_size=256, max_position=512)
    return ModelSpec(**{**kw, **sizes})


@pytest.mark.parametrize("field", ["num_layers", "hidden_size", "num_heads", "num_kv_heads",
                                   "head_dim", "intermediate_size", "vocab_size",
                                   "max_position", "sliding_window"])
@pytest.mark.parametrize("value", [0, -1, 2.0, True, "8"])
def test_model_spec_refuses_sizes_that_are_not_positive_integers(field, value):
    with pytest.raises(UnsupportedModelError,
                       match=rf"^X: {field} must be an integer >= 1, got {value!r}") as err:
        _spec(**{field: value})
    assert isinstance(err.value, ValueError) and "config.json: " in str(err.value)


def test_model_spec_takes_numpy_integers_and_refuses_on_evolve():
    import attrs
    import numpy as np

    spec = _spec(num_layers=np.int64(3), sliding_window=None)
    with pytest.raises(UnsupportedModelError, match="num_layers must be an integer >= 1, got 0"):
        attrs.evolve(spec, num_layers=0)  # e.g. a stage of no layers


def test_kv_heads_that_do_not_divide_are_an_infergraft_error():
    from infergraft.core.errors import InfergraftError

    with pytest.raises(UnsupportedModelError, match=r"X: num_heads=4 is not a multiple of "
                       r"num_kv_heads=3; accepted: num_key_value_heads dividing") as err:
        _spec(num_kv_heads=3)
    assert isinstance(err.value, InfergraftError) and isinstance(err.value, ValueError)


def test_head_dim_derived_from_a_hidden_size_the_heads_do_not_divide_is_refused():
    # a config without head_dim (a stand-in: transformers' LlamaConfig always sets one)
    config = types.SimpleNamespace(hidden_size=66, num_attention_heads=4, head_dim=None)
    with pytest.raises(UnsupportedModelError, match=r"Y: hidden_size=66 is not a multiple of "
                       r"num_heads=4, so head_dim cannot be derived; accepted: "):
        llama_like_spec(config, architecture="Y")
    config = types.SimpleNamespace(hidden_size=64, num_attention_heads=0, head_dim=None)
    with pytest.raises(UnsupportedModelError, match="Y: num_heads must be an integer >= 1, got 0"):
        llama_like_spec(config, architecture="Y")


@pytest.mark.parametrize("make,key,value,message", [
    (tiny_llama_config, "num_hidden_layers", -1, "num_layers must be an integer >= 1, got -1"),
    (tiny_llama_config, "num_key_value_heads", 0, "num_kv_heads must be an integer >= 1, got 0"),
    (tiny_llama_config, "head_dim", 0, "head_dim must be an integer >= 1, got 0"),
    (tiny_mistral_config, "intermediate_size", -8, "intermediate_size must be an integer >= 1"),
    (tiny_gpt2_config, "n_head", 0, "num_heads must be an integer >= 1, got 0"),
    (tiny_gpt2_config, "n_inner", 0, "intermediate_size must be an integer >= 1, got 0"),
    (tiny_llama_config, "num_key_value_heads", 3, "num_heads=4 is not a multiple of "
                                                  "num_kv_heads=3"),
])
def test_build_refuses_a_config_with_sizes_that_cannot_be_built(models, make, key, value,
                                                               message):
    family = {tiny_llama_config: "llama", tiny_mistral_config: "mistral",
              tiny_gpt2_config: "gpt2"}[make]
    hf = models[family]
    before = getattr(hf.config, key)
    setattr(hf.config, key, value)  # the model exists; its config now says otherwise
    try:
        with pytest.raises(UnsupportedModelError, match=message):
            _build(hf)
    finally:
        setattr(hf.config, key, before)
