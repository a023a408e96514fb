"""Which policy core.build() picks: from the config, forced by name, and on conflicts."""
import types

import pytest

from infergraft import core
from infergraft.core.build import choose_policy
from infergraft.core.errors import UnknownPluginError, UnsupportedModelError
from infergraft.core.policy import Policy
from infergraft.core.testing.models import (random_model, random_prompt, tiny_gpt2_config,
                                            tiny_llama_config, tiny_mistral_config)
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
             ("gpt2", tiny_gpt2_config))}


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


@pytest.mark.parametrize("family", ["llama", "mistral", "gpt2"])
def test_architecture_picks_the_policy(models, family):
    engine = _build(models[family])
    assert engine.plan.policy == family
    assert engine.logits(random_prompt(5, 256, 0)).shape == (5, 256)


def test_model_type_is_the_fallback():
    pm = core.get_plugin_manager()
    for model_type in ("llama", "mistral", "gpt2"):
        config = types.SimpleNamespace(architectures=None, model_type=model_type)
        assert choose_policy(pm, config, None).name == model_type


def test_unknown_architecture_lists_the_supported_ones():
    config = types.SimpleNamespace(architectures=["FalconForCausalLM"], model_type="falcon")
    with pytest.raises(UnsupportedModelError, match="FalconForCausalLM") as err:
        choose_policy(core.get_plugin_manager(), config, None)
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "GPT2LMHeadModel"):
        assert arch in str(err.value)


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
    assert "quantizers: int8, kv-int8" in str(err.value)


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
