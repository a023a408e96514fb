"""The plugin manager end to end: inline plugins for every hook, the shared fixtures,
environment switches, contract ranges, and the installed contrib Qwen2 entry point."""
import importlib.metadata as md

import attrs
import pytest

from infergraft import core
from infergraft.core.errors import UnsupportedModelError
from infergraft.core.hookspecs import CONTRACT_VERSION, hookimpl
from infergraft.core.plugin_manager import PluginManager
from infergraft.core.testing.fixtures import plugins_registered_during
from infergraft.core.testing.models import random_model, tiny_llama_config, tiny_qwen2_config
from infergraft.policies.llama import LlamaPolicy, llama_like_spec
from infergraft.plugins.contiguous import ContiguousBackend

pytest_plugins = ["pytester"]


class ShoutPolicy(LlamaPolicy):
    """LLaMA weights under another architecture name: a new family with no new code."""

    name = "shout"
    architectures = ("ShoutForCausalLM",)
    model_types = ("shout",)

    def describe(self, config):
        self.check(config)
        return llama_like_spec(config, architecture="ShoutForCausalLM")


class InlinePlugin:
    """One plugin implementing every hook of the contract."""

    INFERGRAFT_CONTRACT = f">={CONTRACT_VERSION},<{CONTRACT_VERSION + 1}"

    def __init__(self):
        self.seen_plans = []

    @hookimpl
    def infergraft_register_policies(self, register):
        register(ShoutPolicy())

    @hookimpl
    def infergraft_register_cache_backends(self, register):
        backend = ContiguousBackend()
        backend.name = "inline-cache"
        register(backend)

    @hookimpl
    def infergraft_register_quantizers(self, register):
        from test_conformance_kits import Int8PerChannel
        register(Int8PerChannel())

    @hookimpl
    def infergraft_register_planners(self, register):
        from test_conformance_kits import TensorPipelinePlanner
        register(TensorPipelinePlanner())

    @hookimpl
    def infergraft_register_layers(self, register):
        from infergraft.core.layer import LayerImpl
        from infergraft.policies.llama_layers import LlamaAttention
        register(LayerImpl("attention", "inline-attention", LlamaAttention))

    @hookimpl
    def infergraft_prepare_plan(self, plan, spec):
        self.seen_plans.append(plan)
        return attrs.evolve(plan, max_batch_size=3)


def shout_model():
    model = random_model(tiny_llama_config(), seed=2, scale=5.0)
    model.config.architectures, model.config.model_type = ["ShoutForCausalLM"], "shout"
    return model


def test_inline_plugin_serves_every_hook(infergraft_plugin_manager):
    plugin = InlinePlugin()
    infergraft_plugin_manager.register(plugin, name="inline")
    pm = infergraft_plugin_manager
    assert pm.policies().origin("shout") == "inline"
    assert "inline-cache" in pm.cache_backends() and "test-int8" in pm.quantizers()
    assert "test-tp-pp" in pm.planners()
    assert pm.layers()["attention"].origin("inline-attention") == "inline"
    # infergraft_prepare_plan: build picks the inline policy from the architecture alone
    engine = core.build(shout_model(), plugins=["inline-cache"], max_seq_len=32)
    assert (engine.plan.policy, engine.plan.cache_backend) == ("shout", "inline-cache")
    assert engine.plan.max_batch_size == 3 and plugin.seen_plans[0].max_batch_size == 8
    assert len(engine.generate([[5, 6, 7]], max_new_tokens=4)[0].token_ids) == 4


def test_prepare_plan_hooks_chain_last_loaded_first_and_none_keeps_the_plan():
    pm = PluginManager()
    pm.load_defaults()
    calls = []

    class Double:
        @hookimpl
        def infergraft_prepare_plan(self, plan, spec):
            calls.append(("double", plan.max_batch_size))
            return attrs.evolve(plan, max_batch_size=plan.max_batch_size * 2)

    class Watch:
        @hookimpl
        def infergraft_prepare_plan(self, plan):  # a hook may take fewer arguments
            calls.append(("watch", plan.max_batch_size))

    class First:
        @hookimpl(tryfirst=True)
        def infergraft_prepare_plan(self, plan):
            calls.append(("first", plan.max_batch_size))
            return attrs.evolve(plan, max_batch_size=plan.max_batch_size + 1)

    pm.register(First(), name="first")
    pm.register(Double(), name="double")
    pm.register(Watch(), name="watch")
    plan = core.build(random_model(tiny_llama_config()), max_seq_len=16, max_batch_size=2).plan
    out = pm.prepare_plan(plan, None)
    assert calls == [("first", 2), ("watch", 3), ("double", 3)] and out.max_batch_size == 6
    assert plan.max_batch_size == 2  # plans are frozen: hooks return new ones


def test_fixture_unregisters_what_a_test_registered():
    pm = PluginManager()
    pm.load_defaults()
    with plugins_registered_during(pm):
        pm.register(InlinePlugin(), name="inline")
        assert "shout" in pm.policies()
    assert "inline" not in pm.info and "shout" not in pm.policies()


def test_pytest11_entry_point_provides_the_fixtures(pytester):
    assert any(ep.value == "infergraft.core.testing.fixtures"
               for ep in md.entry_points(group="pytest11"))
    pytester.makepyfile("""
        from infergraft.core.hookspecs import hookimpl
        from infergraft.policies.llama import LlamaPolicy, llama_like_spec

        class P(LlamaPolicy):
            name = "temp-policy"

        class Plugin:
            @hookimpl
            def infergraft_register_policies(self, register):
                register(P())

        def test_register(infergraft_plugin_manager, tiny_llama, infergraft_seed):
            infergraft_plugin_manager.register(Plugin(), name="temp")
            assert "temp-policy" in infergraft_plugin_manager.policies()
            assert tiny_llama.config.architectures == ["LlamaForCausalLM"]

        def test_gone_afterwards(infergraft_plugin_manager):
            assert "temp-policy" not in infergraft_plugin_manager.policies()
    """)
    pytester.runpytest_inprocess("-p", "no:cacheprovider").assert_outcomes(passed=2)


def test_disable_and_load_switches(monkeypatch, infergraft_reset_plugins):
    monkeypatch.setenv("INFERGRAFT_DISABLE_PLUGINS", "gpt2, single_device")
    pm = core.get_plugin_manager()
    assert "gpt2" not in pm.info and "single_device" not in pm.info and "llama" in pm.info
    infergraft_reset_plugins()  # a built-in also by the name it registers (int8: weight_int8)
    monkeypatch.setenv("INFERGRAFT_DISABLE_PLUGINS", "int8,kv-int8")
    pm = core.get_plugin_manager()
    assert "weight_int8" not in pm.info and "kv_int8" not in pm.info and "paged" in pm.info
    assert "int8" not in pm.quantizers() and "kv-int8" not in pm.quantizers()
    infergraft_reset_plugins()  # a name no plugin has blocks nothing, and says so
    monkeypatch.setenv("INFERGRAFT_DISABLE_PLUGINS", "int-8")
    with pytest.warns(UserWarning, match=r"names \['int-8'\].*'int8'"):
        pm = core.get_plugin_manager()
    assert "weight_int8" in pm.info
    infergraft_reset_plugins()
    monkeypatch.delenv("INFERGRAFT_DISABLE_PLUGINS")
    monkeypatch.setenv("INFERGRAFT_LOAD_PLUGINS", "")  # allow no entry-point plugin
    pm = core.get_plugin_manager()
    assert "qwen2" not in pm.info and "llama" in pm.info


def test_declared_contract_range_is_recorded():
    pm = PluginManager()
    pm.register(InlinePlugin(), name="inline")
    assert pm.info["inline"].contract == f">={CONTRACT_VERSION},<{CONTRACT_VERSION + 1}"
    pm.register(type("Bare", (), {})(), name="bare")  # undeclared: accepted, shown as such
    assert pm.info["bare"].contract == "any (undeclared)"


# -- the installed contrib package (pip install ./contrib/infergraft-qwen) --------------
def _qwen2_entry_point():
    eps = [ep for ep in md.entry_points(group="infergraft") if ep.name == "qwen2"]
    assert eps, "infergraft-qwen is not installed: pip install ./contrib/infergraft-qwen"
    return eps[0]


def test_installed_qwen2_entry_point_is_loaded_with_its_distribution():
    ep = _qwen2_entry_point()
    assert ep.value == "infergraft_qwen.qwen2" and ep.dist.metadata["Name"] == "infergraft-qwen"
    info = core.get_plugin_manager().info["qwen2"]
    assert (info.origin, info.version, info.contract) == ("infergraft-qwen", ep.dist.version,
                                                          ">=1,<2")


def test_qwen2_with_sliding_window_layers_is_refused_clearly():
    _qwen2_entry_point()
    cfg = tiny_qwen2_config(use_sliding_window=True, sliding_window=16, max_window_layers=1)
    assert cfg.layer_types == ["full_attention", "sliding_attention"]
    with pytest.raises(UnsupportedModelError, match=r"'qwen2'.*sliding-window.*layers \[1\]"):
        core.build(random_model(cfg))
