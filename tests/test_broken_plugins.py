"""Deliberately broken plugins: each fails loudly, with a message naming the plugin; an
installed (entry-point) one is skipped with a PluginWarning instead, and remembered."""
import importlib.metadata as md
import re
import sys
import types

import pytest

from infergraft import core
from infergraft.core.errors import (PluginError, UnknownPluginError, UnsupportedModelError,
                                    WeightLoadError)
from infergraft.core.hookspecs import CONTRACT_VERSION, hookimpl
from infergraft.core.plugin_manager import PluginManager, PluginWarning
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
def future_module(name="future_plugin", contract=f">={CONTRACT_VERSION + 1}"):
    mod = types.ModuleType(name)
    mod.INFERGRAFT_CONTRACT = contract

    @hookimpl
    def infergraft_register_policies(register):
        register(ForgetsBiasPolicy())

    mod.infergraft_register_policies = infergraft_register_policies
    return mod


def test_incompatible_contract_range_is_refused_at_register():
    pm = PluginManager()
    with pytest.raises(PluginError, match=named("future", "load") + ".*supports hook contract "
                       f">={CONTRACT_VERSION + 1}.*provides contract version {CONTRACT_VERSION}"):
        pm.register(future_module(), name="future")
    with pytest.raises(PluginError, match=named("garbled", "load") + ".*'one point oh'.*not a PEP 440"):
        pm.register(future_module(contract="one point oh"), name="garbled")
    assert not pm.info


def entry_point_installer(monkeypatch, reset_plugins):
    """``install(**modules)``: the modules, as if distributions declared them in the
    ``infergraft`` group (and no other entry point there); the manager is rebuilt."""
    real = md.entry_points

    def install(**modules):
        eps = []
        for ep_name, mod in modules.items():
            monkeypatch.setitem(sys.modules, mod.__name__, mod)
            eps.append(md.EntryPoint(ep_name, mod.__name__, "infergraft"))

        def entry_points(**kw):
            return eps if kw.get("group") == "infergraft" else real(**kw)

        monkeypatch.setattr(md, "entry_points", entry_points)
        reset_plugins()
    return install


@pytest.fixture
def fake_entry_points(monkeypatch, infergraft_reset_plugins):
    """Install modules as if distributions declared them in the ``infergraft`` group."""
    return entry_point_installer(monkeypatch, infergraft_reset_plugins)


def skipped(name, why, silence=None):
    """pytest.warns match: the warning names the plugin, its entry point, what was wrong
    and how to silence it."""
    silence = silence or f"set INFERGRAFT_DISABLE_PLUGINS={name} to silence this warning"
    return (f"skipped installed plugin '{name}' \\(entry point '{name} = .*' of 'unknown "
            f"distribution'\\), which failed in hook .*{why}.*; {re.escape(silence)}$")


def test_incompatible_contract_through_an_entry_point_is_skipped(fake_entry_points, tiny_llama):
    # one broken install must not make every command fail
    fake_entry_points(future=future_module())
    why = f"supports hook contract >={CONTRACT_VERSION + 1}"
    with pytest.warns(PluginWarning, match=skipped("future", why)):
        pm = core.get_plugin_manager()
    broken = pm.broken["future"]
    assert (broken.entry_point, broken.origin, broken.contract) == \
        ("future_plugin", "unknown distribution", f">={CONTRACT_VERSION + 1}")
    assert broken.reason.startswith(named("future", "load") + ": plugin (from distribution")
    assert "future" not in pm.info and "qwen2-nobias" not in pm.policies()
    assert core.build(tiny_llama, max_seq_len=16).plan.policy == "llama"  # the rest works
    err = pm.skipped_error("future")
    assert isinstance(err, UnknownPluginError) and err.__cause__ is broken.error
    assert re.search("plugin 'future' .*was skipped at load.*supports hook contract", str(err))
    assert pm.skipped_error("llama") is None


def test_build_naming_a_skipped_plugin_says_why(fake_entry_points, tiny_llama):
    fake_entry_points(future=future_module())
    with pytest.warns(PluginWarning):
        core.get_plugin_manager()
    with pytest.raises(UnknownPluginError, match="'future'.*skipped at load.*hook contract"):
        core.build(tiny_llama, plugins=["future"], max_seq_len=16)


def test_entry_point_that_fails_to_import_or_clashes_is_skipped(fake_entry_points):
    broken = future_module("broken_plugin", contract=">=1")
    fake_entry_points(broken=broken)
    del sys.modules["broken_plugin"]  # now importing it fails
    with pytest.warns(PluginWarning, match=skipped("broken", "importing 'broken_plugin'")):
        pm = core.get_plugin_manager()
    assert pm.broken["broken"].contract == "?" and "llama" in pm.policies()
    fake_entry_points(llama=future_module("other_llama", contract=">=1"))
    silence = ("to silence this warning, uninstall 'unknown distribution' or rename its entry "
               "point (INFERGRAFT_DISABLE_PLUGINS=llama would also block the plugin loaded "
               "from 'built-in')")
    with pytest.warns(PluginWarning, match=skipped("llama", "names must be unique", silence)):
        pm = core.get_plugin_manager()
    assert pm.info["llama"].origin == "built-in" and "llama" in pm.broken


class RaisingHook:
    @hookimpl
    def infergraft_register_planners(self, register):
        raise RuntimeError("no GPUs found")


class Misspelled:
    @hookimpl
    def infergraft_register_policy(self, register):
        pass


class TakesLlama:
    @hookimpl
    def infergraft_register_policies(self, register):
        register(LlamaPolicy())


def as_module(name, plugin):
    mod = types.ModuleType(name)
    for hook in dir(plugin):
        if hook.startswith("infergraft_"):
            setattr(mod, hook, getattr(plugin, hook))
    return mod


@pytest.mark.parametrize("plugin, why", [
    (RaisingHook(), "'infergraft_register_planners': RuntimeError: no GPUs found"),
    (Misspelled(), "did you mean 'infergraft_register_policies'"),
    (TakesLlama(), "'llama' is already registered by plugin 'llama'"),
])
def test_entry_point_whose_hooks_fail_is_skipped(fake_entry_points, plugin, why):
    fake_entry_points(bad=as_module("bad_plugin", plugin), good=future_module("good", ">=1"))
    with pytest.warns(PluginWarning, match=skipped("bad", re.escape(why))):
        pm = core.get_plugin_manager()
    assert "bad" not in pm.info and set(pm.broken) == {"bad"}
    assert pm.policies().origin("llama") == "llama" and "single" in pm.planners()
    assert pm.policies().origin("qwen2-nobias") == "good"  # loaded after the broken one
    pm.check_pending()  # nothing of it left behind


def test_one_module_under_two_entry_point_names_skips_the_second(fake_entry_points):
    mod = future_module("twice_plugin", contract=">=1")
    fake_entry_points(first=mod, second=mod)
    with pytest.warns(PluginWarning, match=skipped("second", "already loaded as plugin 'first'")):
        pm = core.get_plugin_manager()
    assert pm.policies().origin("qwen2-nobias") == "first" and set(pm.broken) == {"second"}


def test_disabling_a_broken_entry_point_silences_it(fake_entry_points, monkeypatch, recwarn):
    monkeypatch.setenv("INFERGRAFT_DISABLE_PLUGINS", "gpt2")
    fake_entry_points(future=future_module())
    with pytest.warns(PluginWarning, match=re.escape("INFERGRAFT_DISABLE_PLUGINS=future,gpt2")):
        core.get_plugin_manager()
    monkeypatch.setenv("INFERGRAFT_DISABLE_PLUGINS", "future,gpt2")
    fake_entry_points(future=future_module())
    assert not core.get_plugin_manager().broken
    assert not [w for w in recwarn if w.category is PluginWarning]


def test_a_failing_built_in_stays_a_loud_error(fake_entry_points, monkeypatch):
    from infergraft.policies import gpt2

    def raises(register):
        raise RuntimeError("our bug")

    def registers_junk(register):
        register(types.SimpleNamespace(name="gpt2-junk"))

    monkeypatch.setattr(gpt2, "infergraft_register_policies", hookimpl(raises))
    fake_entry_points()
    with pytest.raises(PluginError, match=named("gpt2", "infergraft_register_policies")
                       + ": RuntimeError: our bug"):
        core.get_plugin_manager()
    monkeypatch.setattr(gpt2, "infergraft_register_policies", hookimpl(registers_junk))
    fake_entry_points(good=future_module("good", ">=1"))  # found while loading "good"
    with pytest.raises(PluginError, match=named("gpt2") + ".*lacks required attribute"):
        core.get_plugin_manager()
    fake_entry_points()  # with no entry point, at the first lookup
    with pytest.raises(PluginError, match=named("gpt2") + ".*lacks required attribute"):
        core.get_plugin_manager().policies()


def test_compatible_entry_point_loads(fake_entry_points, tiny_llama):
    fake_entry_points(current=future_module("current_plugin", contract=f"=={CONTRACT_VERSION}"))
    pm = core.get_plugin_manager()
    assert pm.policies().origin("qwen2-nobias") == "current"
    assert pm.info["current"].origin == "unknown distribution"  # a bare EntryPoint has none


# -- the real installed contrib plugin -----------------------------------------------
def test_disabling_qwen2_makes_qwen2_models_unsupported(monkeypatch, infergraft_reset_plugins):
    hf = random_model(tiny_qwen2_config(), seed=1)
    assert core.build(hf, max_seq_len=16).plan.policy == "qwen2"  # installed: found unnamed
    monkeypatch.setenv("INFERGRAFT_DISABLE_PLUGINS", "qwen2")
    infergraft_reset_plugins()
    with pytest.raises(UnsupportedModelError, match="no registered policy supports "
                                                    "Qwen2ForCausalLM; supported architectures: "
                                                    ".*LlamaForCausalLM"):
        core.build(hf, max_seq_len=16)
