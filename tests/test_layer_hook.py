"""The layer-replacement hook (``infergraft_register_layers``): layer implementations
registered by name, composed into each decoder layer from the names a spec gives, refused
clearly where a name or a declared weight has no implementation; the LLaMA layers as
the first registrations."""
import json
from types import SimpleNamespace

import attrs
import pytest

from infergraft import core
from infergraft.core.cli import main
from infergraft.core.distributed.stages import PipelineStage, stage_spec
from infergraft.core.errors import PluginError, UnsupportedModelError
from infergraft.core.hookspecs import hookimpl
from infergraft.core.layer import LayerImpl
from infergraft.core.slots import slot_layout
from infergraft.core.spec import LayerSpec
from infergraft.core.testing.models import random_model, random_prompt, tiny_llama_config
from infergraft.core.testing.parity import assert_greedy_match, assert_logits_match
from infergraft.policies.llama import LlamaPolicy
from infergraft.policies.llama_layers import LlamaAttention


class CountingAttention(LlamaAttention):
    """The LLaMA attention, counting the layers it runs for."""

    calls: list = []

    def forward(self, layer, x, layer_idx, *args):
        CountingAttention.calls.append(layer_idx)
        return super().forward(layer, x, layer_idx, *args)


class LayeredPolicy(LlamaPolicy):
    """LLaMA whose spec names ``attention`` for the layers in ``on`` (the others: llama),
    each of them with ``slots``."""

    name = "layered"
    architectures = ("LayeredForCausalLM",)
    model_types = ()

    def __init__(self, attention="counting", on=(1,), slots=()):
        self.attention, self.on, self.slots = attention, on, slots

    def describe(self, config):
        spec = super().describe(config)
        layers = tuple(LayerSpec(self.attention, slots=self.slots) if i in self.on
                       else LayerSpec() for i in range(spec.num_layers))
        return attrs.evolve(spec, architecture="LayeredForCausalLM", layers=layers)


class LayeredPlugin:
    def __init__(self, policy=None):
        self.policy = policy or LayeredPolicy()

    @hookimpl
    def infergraft_register_layers(self, register):
        register(LayerImpl("attention", "counting", CountingAttention, "counts its calls"))

    @hookimpl
    def infergraft_register_policies(self, register):
        register(self.policy)


def layered_model():
    hf = random_model(tiny_llama_config(num_hidden_layers=3), seed=5, scale=5.0)
    hf.config.architectures, hf.config.model_type = ["LayeredForCausalLM"], "layered"
    return hf


def test_a_plugin_replaces_the_attention_of_the_layers_its_spec_names(infergraft_plugin_manager):
    infergraft_plugin_manager.register(LayeredPlugin(), name="layered-plugin")
    reg = infergraft_plugin_manager.layers()["attention"]
    assert reg.origin("counting") == "layered-plugin" and reg.origin("llama") == "llama_layers"
    hf = layered_model()
    engine = core.build(hf, max_seq_len=64, max_batch_size=2)
    assert engine.plan.policy == "layered"
    parts = [type(layer.attention) for layer in engine.model.layers]
    assert parts == [LlamaAttention, CountingAttention, LlamaAttention]
    CountingAttention.calls.clear()
    assert_logits_match(engine, hf, random_prompt(9, hf.config.vocab_size, 1))
    assert CountingAttention.calls == [1]  # layer 1 alone, once for the whole prompt
    assert_greedy_match(engine, hf, random_prompt(7, hf.config.vocab_size, 2), 8)


def test_an_unknown_layer_name_is_refused_at_build_naming_the_registered_ones(
        infergraft_plugin_manager):
    infergraft_plugin_manager.register(LayeredPlugin(LayeredPolicy(attention="nope")),
                                       name="layered-plugin")
    with pytest.raises(UnsupportedModelError, match=r"LayeredForCausalLM: layer 1 names the "
                       r"attention implementation 'nope', which no loaded plugin registers; "
                       r"registered attention implementations: counting, gemma3, llama"):
        core.build(layered_model(), max_seq_len=32)


def test_a_declared_weight_no_part_builds_is_refused(infergraft_plugin_manager):
    policy = LayeredPolicy(attention="llama", on=(2,), slots=(("scale.weight", (16,)),))
    infergraft_plugin_manager.register(LayeredPlugin(policy), name="layered-plugin")
    spec = policy.describe(layered_model().config)
    assert slot_layout(spec)["layers.2.scale.weight"] == ((16,), None)
    with pytest.raises(UnsupportedModelError, match=r"slot\(s\) \['layers.2.scale.weight'\] "
                       r"that the model .* does not build \(layer 2: attention 'llama'"):
        core.build(layered_model(), max_seq_len=32)


def test_registrations_are_checked(infergraft_plugin_manager):
    with pytest.raises(ValueError, match="kind must be one of attention, mlp, norm"):
        LayerImpl("attn", "x", LlamaAttention)

    class WrongKind:
        @hookimpl
        def infergraft_register_layers(self, register):
            register(SimpleNamespace(kind="attn", name="x", build=LlamaAttention))

    class Clash:
        @hookimpl
        def infergraft_register_layers(self, register):
            register(LayerImpl("attention", "llama", CountingAttention))
            register(LayerImpl("norm", "counting", CountingAttention))  # another kind's name

    infergraft_plugin_manager.register(WrongKind(), name="wrong-kind")
    with pytest.raises(PluginError, match="plugin 'wrong-kind'.*accepted kinds: attention, "
                                          "mlp, norm"):
        infergraft_plugin_manager.layers()
    infergraft_plugin_manager.unregister("wrong-kind")
    infergraft_plugin_manager.register(Clash(), name="clash")
    with pytest.raises(PluginError, match="plugin 'clash'.*attention name 'llama' is already "
                                          "registered by plugin 'llama_layers'"):
        infergraft_plugin_manager.layers()


def test_disabling_the_llama_policy_keeps_the_layers_every_family_uses(
        monkeypatch, infergraft_reset_plugins):
    from infergraft.core.testing.models import tiny_mistral_config

    monkeypatch.setenv("INFERGRAFT_DISABLE_PLUGINS", "llama")
    infergraft_reset_plugins()
    pm = core.get_plugin_manager()
    assert "llama" not in pm.policies() and "llama" in pm.layers()["attention"]
    assert core.build(random_model(tiny_mistral_config()), max_seq_len=16).plan.policy == "mistral"
    # the layers' own plugin blocked: a build says which implementation is missing
    monkeypatch.setenv("INFERGRAFT_DISABLE_PLUGINS", "llama_layers")
    infergraft_reset_plugins()
    with pytest.raises(UnsupportedModelError, match="ModelSpec.norm names the norm "
                       "implementation 'rms', which no loaded plugin registers"):
        core.build(random_model(tiny_llama_config()), max_seq_len=16)


def test_infergraft_plugins_lists_the_layer_implementations(capsys):
    assert main(["plugins", "--json"]) == 0
    rows = {(r["kind"], r["name"]): r for r in json.loads(capsys.readouterr().out)}
    for key in [("attention", "llama"), ("mlp", "gated"), ("mlp", "plain"), ("norm", "rms"),
                ("norm", "layer")]:
        assert (rows[key]["plugin"], rows[key]["origin"]) == ("llama_layers", "built-in"), key
    assert rows["attention", "llama"]["hooks"] == ["infergraft_register_layers"]
    qwen3 = rows["attention", "qwen3"]  # a third party's, from its own package
    assert (qwen3["plugin"], qwen3["origin"]) == ("qwen3", "infergraft-qwen")


def _spec(**kw):
    return core.get_plugin_manager().policies().get("llama").describe(tiny_llama_config(**kw))


def test_layer_specs_are_validated_and_frozen():
    spec = _spec(num_hidden_layers=2)
    with pytest.raises(UnsupportedModelError, match="layers holds 3 entries for num_layers=2"):
        attrs.evolve(spec, layers=(LayerSpec(),) * 3)
    for bad in ([("qkv.weight", (4,))], [("q_norm.weight", (0,))], [("q_norm", (4,))],
                [("q_norm.weight", (4,)), ("q_norm.weight", (4,))]):
        with pytest.raises(UnsupportedModelError, match="LayerSpec"):
            LayerSpec(slots=bad)
    layer = LayerSpec("x", slots=[["q_norm.weight", [4]]])  # lists become tuples: hashable
    with_slots = attrs.evolve(spec, layers=[layer, LayerSpec()])
    assert hash(with_slots) and with_slots.layers[0].slots == (("q_norm.weight", (4,)),)
    assert with_slots.param_count == spec.param_count + 4
    assert (spec.layer(0).attention, spec.layer(0).mlp) == ("llama", "gated")
    gpt2 = attrs.evolve(spec, gated_mlp=False)
    assert gpt2.layer(1).mlp == "plain"


def test_a_pipeline_stage_keeps_each_layers_parts():
    spec = _spec(num_hidden_layers=4)
    spec = attrs.evolve(spec, layers=[LayerSpec("a"), LayerSpec("b"), LayerSpec("c"),
                                      LayerSpec("d", slots=[("q_norm.weight", (8,))])])
    stage = PipelineStage(1, 2, (2, 4))
    part = stage_spec(spec, stage)
    assert [x.attention for x in part.layers] == ["c", "d"] and part.num_layers == 2
    assert "layers.1.q_norm.weight" in slot_layout(part)


class ScaledAttention(LlamaAttention):
    """Adds a weight of its own (``scale``), declared or not by the spec."""

    def __init__(self, layer, spec, ops):
        super().__init__(layer, spec, ops)
        from infergraft.policies.llama_layers import Norm
        layer.scale = Norm("rms", spec.norm_eps, ops)


def test_a_weight_a_part_builds_undeclared_is_refused(infergraft_plugin_manager):
    class Plugin(LayeredPlugin):
        @hookimpl
        def infergraft_register_layers(self, register):
            register(LayerImpl("attention", "scaled", ScaledAttention))

    infergraft_plugin_manager.register(Plugin(LayeredPolicy(attention="scaled")), name="scaled")
    with pytest.raises(UnsupportedModelError, match=r"lacks slot\(s\) \['layers.1.scale.weight'\] "
                       r"that its layer implementations build \(layer 1: attention 'scaled'"):
        core.build(layered_model(), max_seq_len=32)
