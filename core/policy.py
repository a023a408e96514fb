"""Injection-policy contract: HF config -> ModelSpec, and the declarative weight map."""
from __future__ import annotations

import re
from typing import Iterable, Optional, Sequence

import attrs

from .errors import UnsupportedModelError
from .spec import ModelSpec


@attrs.frozen
class WeightRule:
    """One HF state-dict key (``{i}`` = layer index) feeding one slot of our model.

    ``part`` indexes the slot's fused parts (q, k, v -> qkv: 0, 1, 2); None means the
    tensor fills the whole slot. ``transpose`` is for HF ``Conv1D`` ([in, out]) weights.
    ``stacked``: the tensor holds the slot's parts stacked along a leading dim (transformers
    5's experts in one tensor, [E, 2I, H], for the slot [E * 2I, H]); its first two dims
    are merged.
    """

    source: str
    slot: str
    part: Optional[int] = None
    transpose: bool = False
    stacked: bool = False

    def pattern(self) -> re.Pattern:
        return re.compile("^" + re.escape(self.source).replace(r"\{i\}", r"(\d+)") + "$")


@attrs.frozen
class WeightMap:
    rules: tuple[WeightRule, ...]
    #: HF keys that are expected but carry nothing we need (regexes), e.g. rotary buffers
    ignore: tuple[str, ...] = ()
    #: (alias, key): the alias may stand in for key, e.g. a tied LM head saved in place of
    #: the embedding; whichever arrives first is used, the other is skipped
    aliases: tuple[tuple[str, str], ...] = ()
    #: rules for another layout of the same weights, each filling a whole slot in place of
    #: the ``rules`` that fill it: a model in memory under transformers 5 holds its experts
    #: stacked in one tensor (``mlp.experts.gate_up_proj``) where its checkpoint has one
    #: tensor an expert (``mlp.experts.3.gate_proj.weight``)
    alternatives: tuple[WeightRule, ...] = ()


class Policy:
    """Base class for injection policies; subclasses set the class attributes and
    implement :meth:`describe` and :meth:`weight_map`.

    The engine's own fused decoder (``core.runner.model.DecoderModel``) is built from the
    ``ModelSpec``, so a new family usually needs no modelling code at all; one that does
    registers its layers (``infergraft_register_layers``, core/layer.py) and its spec
    names them (``ModelSpec.layers``).
    """

    name: str = ""
    architectures: tuple[str, ...] = ()
    model_types: tuple[str, ...] = ()

    def claims(self, config) -> bool:
        archs = getattr(config, "architectures", None) or ()
        return any(a in self.architectures for a in archs) or \
            getattr(config, "model_type", None) in self.model_types

    def check(self, config) -> None:
        """Raise UnsupportedModelError if this policy cannot serve ``config``."""
        if not self.claims(config):
            archs = getattr(config, "architectures", None) or [getattr(config, "model_type", "?")]
            raise UnsupportedModelError(
                f"policy {self.name!r} does not support {', '.join(archs)}; it supports "
                f"{', '.join(self.architectures)}")

    def describe(self, config) -> ModelSpec:
        raise NotImplementedError

    def weight_map(self, spec: ModelSpec) -> WeightMap:
        raise NotImplementedError


def expand_rules(rules: Iterable[WeightRule], num_layers: int) -> dict[str, WeightRule]:
    """HF key -> rule with ``{i}`` filled in for every layer."""
    out: dict[str, WeightRule] = {}
    for r in rules:
        layers: Sequence = range(num_layers) if "{i}" in r.source else [None]
        for i in layers:
            key = r.source.replace("{i}", str(i)) if i is not None else r.source
            slot = r.slot.replace("{i}", str(i)) if i is not None else r.slot
            out[key] = attrs.evolve(r, source=key, slot=slot)
    return out
