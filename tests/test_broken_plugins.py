"""Deliberately broken plugins, passed in-process: each fails loudly, with a message naming
the plugin (installed ones are skipped instead: tests/test_broken_entry_points.py)."""
import re
import types

import pytest

from infergraft import core
from infergraft.core import selection
from infergraft.core.errors import PluginError, UnsupportedModelError, WeightLoadError
from infergraft.core.hookspecs import hookimpl
from infergraft.core.plugin_manager import PluginManager
from infergraft.core.testing.models import random_model, tiny_llama_config, tiny_qwen2_config
from infergraft.core.testing.policy_kit import check_weights_consumed
from infergraft.policies.llama import LlamaPolicy, llama_like_spec, llama_like_weight_map


def named(plugin, hook=None):
    """pytest.raises match: the error names the plugin (and the hook)."""
    return f"plugin '{plugin}'" + (f" failed in hook '{hook}'" if hook else "")


def test_wrong_hook_argument_name_is_refused_at_register():
    class Plugin:
        @hookimpl
        def infergraft_register_policies(self, registrar):
            pass

    pm = PluginManager()
    with pytest.raises(PluginError, match=named("wrong-arg") + r"(.|\n)*registrar") as e:
        pm.register(Plugin(), name="wrong-arg")
    assert e.value.plugin == "wrong-arg" and "wrong-arg" not in pm.info


def test_misspelled_hook_fails_check_pending_with_a_suggestion():
    class Plugin:
        @hookimpl
        def infergraft_register_policy(self, register):
            pass

    pm = PluginManager()
    with pytest.raises(PluginError, match=named("typo", "check_pending")) as e:
        pm.register(Plugin(), name="typo")
    assert "did you mean 'infergraft_register_policies'" in str(e.value)
    assert "typo" not in pm.info  # refused as a whole, not half registered
    pm.check_pending()  # and the manager stays consistent


def test_hook_that_raises_names_plugin_and_hook(infergraft_plugin_manager):
    class Plugin:
        @hookimpl
        def infergraft_register_planners(self, register):
            raise RuntimeError("no GPUs found")

    infergraft_plugin_manager.register(Plugin(), name="raiser")
    with pytest.raises(PluginError, match=named("raiser", "infergraft_register_planners")
                       + ".*RuntimeError: no GPUs found"):
        infergraft_plugin_manager.planners()
    with pytest.raises(PluginError, match=named("raiser")):  # and so does every build
        core.build(random_model(tiny_llama_config()), max_seq_len=16)


def test_prepare_plan_raising_or_returning_junk_names_the_plugin(infergraft_plugin_manager, tiny_llama):
    class Junk:
        @hookimpl
        def infergraft_prepare_plan(self, plan, spec):
            return {"max_batch_size": 2}

    infergraft_plugin_manager.register(Junk(), name="junk")
    with pytest.raises(PluginError, match=named("junk", "infergraft_prepare_plan")
                       + ".*returned dict, expected Plan"):
        core.build(tiny_llama, max_seq_len=16)
    infergraft_plugin_manager.unregister("junk")

    class Raiser:
        @hookimpl
        def infergraft_prepare_plan(self, plan, spec):
            raise KeyError("tp")

    infergraft_plugin_manager.register(Raiser(), name="plan-raiser")
    with pytest.raises(PluginError, match=named("plan-raiser", "infergraft_prepare_plan")):
        core.build(tiny_llama, max_seq_len=16)


def test_invalid_or_clashing_registrations_name_the_plugin():
    class Nameless:
        @hookimpl
        def infergraft_register_cache_backends(self, register):
            register(types.SimpleNamespace(name="Bad Name!", create=None))

    class Impostor:
        @hookimpl
        def infergraft_register_policies(self, register):
            register(LlamaPolicy())  # "llama" already belongs to the built-in

    for plugin, name, why in ((Nameless(), "nameless", "invalid name 'Bad Name!'"),
                              (Impostor(), "impostor", "'llama' is already registered by plugin")):
        pm = PluginManager()
        pm.load_defaults()
        pm.register(plugin, name=name)
        with pytest.raises(PluginError, match=named(name) + ".*" + re.escape(why)):
            pm.registries()


class ForgetsBiasPolicy(LlamaPolicy):
    """Claims Qwen2 but describes it as LLaMA: the q/k/v biases are left over."""

    name = "qwen2-nobias"
    architectures = ("Qwen2ForCausalLM",)
    model_types = ()

    def describe(self, config):
        return llama_like_spec(config, architecture="Qwen2ForCausalLM")

    def weight_map(self, spec):
        return llama_like_weight_map(spec)


class ForgetsBiasPlugin:
    INFERGRAFT_PLUGIN_NAME = "qwen2-nobias"

    @hookimpl
    def infergraft_register_policies(self, register):
        register(ForgetsBiasPolicy())


def test_policy_that_leaves_weights_unconsumed_is_named():
    hf = random_model(tiny_qwen2_config())
    with pytest.raises(WeightLoadError, match=r"policy 'qwen2-nobias' left 6 weight\(s\) "
                                              r"unconsumed: model\.layers\.0\.self_attn\.q_proj\.bias"):
        core.build(hf, plugins=[ForgetsBiasPlugin()], max_seq_len=16)
    # the conformance kit finds the same before any build
    policy, shapes = ForgetsBiasPolicy(), {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    with pytest.raises(AssertionError, match="'qwen2-nobias'.*q_proj.bias' is consumed by nothing"):
        check_weights_consumed(policy, policy.describe(hf.config), shapes)


# -- contract versions ----------------------------------------------------------------
def test_disabling_qwen2_makes_qwen2_models_unsupported(monkeypatch, infergraft_reset_plugins):
    hf = random_model(tiny_qwen2_config(), seed=1)
    assert core.build(hf, max_seq_len=16).plan.policy == "qwen2"  # installed: found unnamed
    monkeypatch.setenv("INFERGRAFT_DISABLE_PLUGINS", "qwen2")
    infergraft_reset_plugins()
    with pytest.raises(UnsupportedModelError, match="no registered policy supports "
                                                    r"Qwen2ForCausalLM \(closest .*\); "
                                                    "supported architectures: "
                                                    ".*LlamaForCausalLM") as e:
        core.build(hf, max_seq_len=16)
    assert str(e.value).endswith(  # the contrib package that has it, and why it is not used
        "The installed package infergraft-qwen supports Qwen2ForCausalLM, but its plugin "
        "'qwen2' is not loaded: INFERGRAFT_DISABLE_PLUGINS or INFERGRAFT_LOAD_PLUGINS leaves "
        "it out")


def test_a_family_of_a_contrib_package_not_installed_says_how_to_install_it(
        monkeypatch, infergraft_reset_plugins):
    # as on a fresh clone: no qwen2 plugin loaded, and its package (here one of another
    # name, so that the installed one does not count) not installed
    monkeypatch.setenv("INFERGRAFT_DISABLE_PLUGINS", "qwen2")
    infergraft_reset_plugins()
    monkeypatch.setitem(selection.CONTRIB_FAMILIES, "Qwen2ForCausalLM",
                        ("infergraft-qwen-absent", "qwen2"))
    with pytest.raises(UnsupportedModelError) as e:
        core.build(random_model(tiny_qwen2_config(), seed=1), max_seq_len=16)
    assert str(e.value).endswith("The package infergraft-qwen-absent supports "
                                 "Qwen2ForCausalLM: from a checkout of infergraft, pip install "
                                 "./contrib/infergraft-qwen-absent")
    other = random_model(tiny_qwen2_config(), seed=1)
    other.config.architectures = ["FalconForCausalLM"]
    with pytest.raises(UnsupportedModelError) as e:  # a family no package here has
        core.build(other, max_seq_len=16)
    assert "pip install" not in str(e.value) and "package" not in str(e.value)
