"""Conformance kit for layer implementations (``infergraft_register_layers``,
core/layer.py): an attention, an MLP or a norm.

A layer's suite subclasses :class:`LayerTests` and provides two fixtures::

    @pytest.fixture
    def layer_impl():      # the LayerImpl under test (e.g. from get_plugin_manager().layers())
    @pytest.fixture
    def spec():            # a ModelSpec that names it (its family's policy.describe(config))

The kit checks the registration object, that the spec's layers compose with it (every
slot the spec lays out built, the attributes the runner reads present) and, for a norm,
its forward on the CPU. Numerical parity is the family's: the policy kit compares the
whole model with HF transformers (``policy_kit.PolicyTests``).
"""
from __future__ import annotations

import pytest
import torch

from ..layer import LAYER_KINDS
from ..registry import _NAME, Registry
from ..slots import slot_layout


def registries_with(layer_impl) -> dict[str, Registry]:
    """The process-wide layer registries, ``layer_impl`` in its kind's in place of any
    implementation of its name (so that one not registered yet composes too)."""
    from .. import get_plugin_manager

    out = {}
    for kind, reg in get_plugin_manager().layers().items():
        new = Registry(kind, reg.hook, reg.required)
        for name in reg.names():
            if not (kind == layer_impl.kind and name == layer_impl.name):
                new.add(reg.get(name), reg.origin(name))
        if kind == layer_impl.kind:
            new.add(layer_impl, "under-test")
        out[kind] = new
    return out


def compose(layer_impl, spec):
    """The runner's model of ``spec`` on the CPU (torch ops), weights not loaded."""
    from infergraft.kernels.dispatch import get_ops

    from ..runner.model import DecoderModel

    return DecoderModel(spec, get_ops("cpu", "torch"), torch.device("cpu"),
                        layers=registries_with(layer_impl))


class LayerContractTests:
    """The registration object and the spec that names it."""

    def test_kind_name_and_build_are_valid(self, layer_impl):
        assert layer_impl.kind in LAYER_KINDS, layer_impl.kind
        assert isinstance(layer_impl.name, str) and _NAME.match(layer_impl.name), layer_impl.name
        assert callable(layer_impl.build), layer_impl.build

    def test_the_spec_names_it(self, layer_impl, spec):
        if layer_impl.kind == "norm":
            assert spec.norm == layer_impl.name, (spec.norm, layer_impl.name)
            return
        used = [i for i in range(spec.num_layers)
                if getattr(spec.layer(i), layer_impl.kind) == layer_impl.name]
        assert used, f"no layer of the spec names {layer_impl.kind} {layer_impl.name!r}"


class LayerCompositionTests:
    """The spec's layers composed with it, as ``core.build`` composes them."""

    def test_every_slot_the_spec_lays_out_is_built(self, layer_impl, spec):
        model = compose(layer_impl, spec)  # DecoderModel refuses a slot no module holds
        for slot in slot_layout(spec):
            path, attr = slot.rsplit(".", 1)
            assert attr in model.get_submodule(path)._buffers, slot

    def test_the_parts_carry_what_the_runner_reads(self, layer_impl, spec):
        model = compose(layer_impl, spec)
        for i, layer in enumerate(model.layers):
            for part in (layer.attention, layer.mlp):
                proj = part.input_projection
                assert isinstance(proj, str) and isinstance(getattr(layer, proj, None),
                                                            torch.nn.Module), (i, proj)
                assert isinstance(part.fuses, bool), (i, part)
                if part.fuses:
                    assert callable(part.forward_fused) and callable(part.fusable), (i, part)
            for norm, proj in layer.norm_feeds:
                assert hasattr(layer, norm) and hasattr(layer, proj), (i, norm, proj)

    def test_a_norm_returns_the_normed_rows_and_the_residual(self, layer_impl, spec):
        if layer_impl.kind != "norm":
            pytest.skip("for norms: attention and MLPs are compared with HF by the policy kit")
        from infergraft.kernels.dispatch import get_ops

        norm = layer_impl.build(spec, get_ops("cpu", "torch"))
        h = spec.hidden_size
        g = torch.Generator().manual_seed(0)
        norm.weight = 1 + 0.1 * torch.randn(h, generator=g)
        if "bias" in norm._buffers:
            norm.bias = 0.1 * torch.randn(h, generator=g)
        x, residual = torch.randn(3, h, generator=g), torch.randn(3, h, generator=g)
        normed, stream = norm(x)
        assert normed.shape == x.shape and torch.isfinite(normed).all() and torch.equal(stream, x)
        normed2, stream2 = norm(x, residual)
        assert torch.allclose(stream2, x + residual) and normed2.shape == x.shape
        assert torch.allclose(normed2, norm(x + residual)[0], atol=1e-5)


class LayerRegistrationTests:
    """The installed plugin registers it: what a spec naming it gets at build."""

    def test_registered_under_its_kind_and_name(self, layer_impl):
        from .. import get_plugin_manager

        reg = get_plugin_manager().layers()[layer_impl.kind]
        assert layer_impl.name in reg, f"{layer_impl.kind} {layer_impl.name!r} is not registered"
        assert reg.get(layer_impl.name) == layer_impl


class LayerTests(LayerContractTests, LayerCompositionTests, LayerRegistrationTests):
    """Everything a layer implementation must pass; subclass it with ``layer_impl`` and
    ``spec``."""
