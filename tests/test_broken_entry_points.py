"""Installed plugins (entry points) that are broken are skipped, not fatal: an incompatible
contract, an import that fails, a name clash, hooks that raise, misspell or register a
taken name; each warns with how to silence it, is remembered in ``pm.broken``, and is
named when a build selects it. A built-in that fails stays a loud error."""
import importlib.metadata as md
import re
import sys
import types

import pytest

from test_broken_plugins import ForgetsBiasPolicy, named

from infergraft import core
from infergraft.core.errors import PluginError, UnknownPluginError
from infergraft.core.hookspecs import CONTRACT_VERSION, hookimpl
from infergraft.core.plugin_manager import PluginManager, PluginWarning
from infergraft.policies.llama import LlamaPolicy


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
