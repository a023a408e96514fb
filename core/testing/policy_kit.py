"""Conformance kit for injection policies (pandas ``extension.base`` style).

A policy's test suite subclasses :class:`PolicyTests` (or the single groups) and
provides two fixtures::

    @pytest.fixture
    def policy():          # the Policy object under test
    @pytest.fixture
    def hf_model():        # a tiny random HF model of an architecture the policy claims

Class attributes (``rtol``, ``greedy_tokens``, ...) may be overridden per suite.
"""
from __future__ import annotations

import re
from types import SimpleNamespace

import attrs
import pytest
import torch
from hypothesis import HealthCheck, given
from hypothesis import strategies as st

from ..errors import UnsupportedModelError, WeightLoadError
from ..hookspecs import hookimpl
from ..slots import slot_layout
from ..policy import expand_rules
from ..registry import _NAME
from ..loading.weights import alternative_rules, check_weight_map
from . import strategies
from .models import random_prompt
from .parity import (assert_logits_match, greedy_by_full_forwards, hf_greedy, hf_logits,
                     relative_error)


def check_weights_consumed(policy, spec, hf_shapes: dict[str, tuple]) -> None:
    """Every HF state-dict key is consumed exactly once (by a rule, an alias, an
    alternative or an ignore pattern), every rule finds its key (or its slot an
    alternative's), and every shape fits its slot.

    ``hf_shapes`` maps HF keys to shapes, e.g. ``{k: tuple(v.shape) for k, v in sd.items()}``.
    """
    who = f"policy {policy.name!r}"
    wmap = policy.weight_map(spec)
    try:
        rules = check_weight_map(policy.name, spec, wmap)
    except WeightLoadError as e:
        raise AssertionError(str(e)) from None
    alternatives = alternative_rules(spec, wmap)
    # expand_rules keeps one rule per key, so duplicates must be counted before it
    expanded = [k for r in wmap.rules + wmap.alternatives
                for k in expand_rules([r], spec.num_layers)]
    dup = sorted({k for k in expanded if expanded.count(k) > 1})
    assert not dup, f"{who} maps HF key(s) {dup[:5]} by more than one rule"
    aliases = dict(wmap.aliases)
    ignore = [re.compile(p) for p in wmap.ignore]
    problems = []
    for key in sorted(hf_shapes):
        by = [m for m, hit in (("a rule", key in rules),
                               ("an alias", aliases.get(key) in rules),
                               ("an alternative", key in alternatives),
                               ("an ignore pattern", any(p.match(key) for p in ignore))) if hit]
        if len(by) != 1:
            problems.append(f"{key!r} is consumed by {' and '.join(by) or 'nothing'}")
    replaced = {r.slot: key for key, r in alternatives.items() if key in hf_shapes}
    layout = slot_layout(spec)
    for key, rule in [*rules.items(), *((k, r) for k, r in alternatives.items()
                                        if k in hf_shapes)]:
        if key in rules and rule.slot in replaced:
            if key in hf_shapes:
                problems.append(f"{key!r} and {replaced[rule.slot]!r} both fill {rule.slot!r}")
            continue
        if key not in hf_shapes and not any(a in hf_shapes for a, k in aliases.items() if k == key):
            problems.append(f"{key!r} is mapped but the HF model has no such weight")
            continue
        shape = hf_shapes[key] if key in hf_shapes else next(
            hf_shapes[a] for a, k in aliases.items() if k == key and a in hf_shapes)
        shape = tuple(reversed(shape)) if rule.transpose else tuple(shape)
        if rule.stacked and len(shape) >= 2:
            shape = (shape[0] * shape[1],) + shape[2:]
        full, parts = layout[rule.slot]
        want = full if parts is None or rule.part is None else (parts[rule.part],) + full[1:]
        if shape != tuple(want):
            problems.append(f"{key!r} has shape {shape}, slot {rule.slot!r} wants {tuple(want)}")
    assert not problems, f"{who}: " + "; ".join(problems[:8])


class _PolicyPlugin:
    """Wraps a bare policy object as an inline plugin, for policies not registered yet."""

    def __init__(self, policy):
        self.INFERGRAFT_PLUGIN_NAME = f"kit-{policy.name}"
        self._policy = policy

    @hookimpl
    def infergraft_register_policies(self, register):
        register(self._policy)


def build_with_policy(policy, hf_model, **kwargs):
    """core.build with exactly this policy object, registered or not."""
    from .. import build, get_plugin_manager

    reg = get_plugin_manager().policies()
    if policy.name in reg and type(reg.get(policy.name)) is type(policy):
        return build(hf_model, plugins=[policy.name], **kwargs)
    return build(hf_model, plugins=[_PolicyPlugin(policy)], **kwargs)


class PolicyFixtures:
    rtol = 1e-4  # logits, relative to max |logit|
    greedy_tokens = 32
    prompt_lengths = (1, 7, 45)
    batch_lengths = (3, 17, 40)
    build_kwargs = dict(max_seq_len=160, max_batch_size=4)
    # HF's greedy tokens from one forward over the whole sequence a step instead of its
    # generate: for a family whose generate changed across transformers versions (Phi-3
    # past LongRoPE's original length: parity.greedy_by_full_forwards)
    hf_full_forwards = False

    def hf_greedy(self, hf_model, ids, max_new_tokens):
        reference = greedy_by_full_forwards if self.hf_full_forwards else hf_greedy
        return reference(hf_model, ids, max_new_tokens)

    @pytest.fixture
    def engine(self, policy, hf_model):
        return build_with_policy(policy, hf_model, **self.build_kwargs)

    @pytest.fixture
    def spec(self, policy, hf_model):
        return policy.describe(hf_model.config)


class PolicyContractTests(PolicyFixtures):
    """Naming, claiming and ``describe()``."""

    def test_name_is_valid(self, policy):
        assert isinstance(policy.name, str) and _NAME.match(policy.name), policy.name

    def test_claims_the_models_architecture(self, policy, hf_model):
        archs = hf_model.config.architectures
        assert policy.claims(hf_model.config), f"{policy.name!r} does not claim {archs}"
        assert set(archs) & set(policy.architectures), (archs, policy.architectures)

    def test_refuses_a_foreign_architecture(self, policy, hf_model):
        foreign = SimpleNamespace(**{**hf_model.config.to_dict(), "model_type": "not-a-model",
                                     "architectures": ["NotAModelForCausalLM"]})
        assert not policy.claims(foreign)
        with pytest.raises(UnsupportedModelError, match=re.escape(repr(policy.name))):
            policy.describe(foreign)

    def test_describe_is_deterministic_frozen_and_pure(self, policy, hf_model):
        before = hf_model.config.to_dict()
        a, b = policy.describe(hf_model.config), policy.describe(hf_model.config)
        assert a == b and hash(a) == hash(b)
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            a.num_layers = a.num_layers + 1
        assert hf_model.config.to_dict() == before, "describe() changed the HF config"

    def test_spec_matches_config(self, policy, hf_model, spec):
        cfg = hf_model.config
        assert spec.architecture in policy.architectures
        assert (spec.num_layers, spec.hidden_size, spec.num_heads, spec.vocab_size) == \
            (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.vocab_size)
        assert spec.num_kv_heads == (getattr(cfg, "num_key_value_heads", None) or spec.num_heads)

    def test_param_count_matches_hf(self, hf_model, spec):
        # the plan's weight bytes come from this number
        hf = sum(p.numel() for p in hf_model.parameters())  # shared (tied) tensors once
        assert spec.param_count == hf, f"spec counts {spec.param_count} parameters, HF has {hf}"


class PolicyWeightMapTests(PolicyFixtures):
    """The declarative weight map against the HF state dict."""

    def test_every_slot_filled_once(self, policy, spec):
        check_weight_map(policy.name, spec, policy.weight_map(spec))

    def test_every_hf_weight_consumed_exactly_once(self, policy, hf_model, spec):
        shapes = {k: tuple(v.shape) for k, v in hf_model.state_dict().items()}
        check_weights_consumed(policy, spec, shapes)

    def test_weight_map_is_deterministic(self, policy, spec):
        assert policy.weight_map(spec) == policy.weight_map(spec)


class PolicyParityTests(PolicyFixtures):
    """Our engine against HF transformers on the same weights (float32, CPU)."""

    def test_logits_match_hf(self, engine, hf_model):
        for n in self.prompt_lengths:
            assert_logits_match(engine, hf_model, random_prompt(n, hf_model.config.vocab_size, n),
                                rtol=self.rtol)

    @strategies.kit_settings(max_examples=8, deadline=None,
                             suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                    HealthCheck.differing_executors])
    @given(data=st.data())
    def test_logits_match_hf_on_drawn_prompts(self, engine, hf_model, data):
        ids = data.draw(strategies.prompts(hf_model.config.vocab_size, max_len=40), "prompt")
        err = relative_error(engine.logits(ids), hf_logits(hf_model, ids))
        assert err <= self.rtol, f"prompt {ids}: relative error {err:.2e}"

    def test_greedy_tokens_match_hf(self, engine, hf_model):
        for seed in (3, 4):
            ids = random_prompt(9 + seed, hf_model.config.vocab_size, seed)
            ours = engine.generate([ids], max_new_tokens=self.greedy_tokens)[0].token_ids
            ref = self.hf_greedy(hf_model, ids, self.greedy_tokens)
            assert ours == ref, f"greedy tokens differ from HF:\n ours {ours}\n HF   {ref}"

    def test_mixed_batch_matches_hf(self, engine, hf_model):
        prompts = [random_prompt(n, hf_model.config.vocab_size, 10 + n) for n in self.batch_lengths]
        outs = [c.token_ids for c in engine.generate(prompts, max_new_tokens=12)]
        refs = [self.hf_greedy(hf_model, p, 12) for p in prompts]
        assert outs == refs, f"batched greedy differs from HF:\n ours {outs}\n HF   {refs}"
        assert torch.is_tensor(engine.logits(prompts[0]))  # the engine is still usable


class PolicyRegistrationTests(PolicyFixtures):
    """The installed plugin is what ``core.build`` picks without being told."""

    def test_build_selects_policy_without_naming_it(self, policy, hf_model):
        from .. import build

        engine = build(hf_model, **self.build_kwargs)
        assert engine.plan.policy == policy.name


class PolicyTests(PolicyContractTests, PolicyWeightMapTests, PolicyParityTests,
                  PolicyRegistrationTests):
    """Everything a policy must pass; subclass this with ``policy`` and ``hf_model``."""
