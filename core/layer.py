"""The layer-replacement contract: what ``infergraft_register_layers`` registers.

The runner composes each decoder layer (``core.runner.model.DecoderLayer``: norm ->
attention -> add -> norm -> MLP -> add, the pre-norm residual stream; with
``LayerSpec.post_norms`` a norm on each output before its add) from registered parts that
the policy's ModelSpec names: the attention and the MLP of each layer
(``LayerSpec.attention`` / ``.mlp``), the norm of the whole model (``ModelSpec.norm``).
The LLaMA parts every family reuses (``infergraft.policies.llama_layers``: attention
``llama``, MLPs ``gated`` and ``plain``, norms ``rms`` and ``layer``) register through
this hook like any plugin's.

A part's projections are the layer's children under slot names (``layers.3.qkv``: what a
policy's weight map fills, what quantisers, planners and the weight streamer see), so a
part adds them to the layer and runs them with the layer passed in, as vLLM's
``AttentionImpl.forward(layer, ...)`` does. What ``build`` returns:

``layer.layer_spec`` is the layer's own ``LayerSpec`` (set before its parts build: a
mixture-of-experts MLP reads its ``experts`` there).

* attention: ``build(layer, spec, ops)`` adds its projections to ``layer`` and returns an
  object with ``forward(layer, x, layer_idx, positions, rope, cache, meta) -> [T, H]``
  (x: the normed stream [T, H]; ``rope``: (cos, sin) tables, ``positions`` [T] the rows of
  them each token reads: its position, LongRoPE's table row past its boundary,
  core/rope.py ``table_rows``; where K/V go is the cache's ``meta``; the output before the
  tensor-parallel all-reduce, which the layer does), ``input_projection`` (the slot name of the projection its input norm
  feeds: the fused decode layer folds the norm's weight into it, unless the part sets
  ``folds_input_norm = False``: the norm then keeps its weight and the part's
  ``forward_fused`` applies it, as a mixture of experts whose experts read the normed row
  beside the router does), ``fuses`` (whether it
  runs in the fused decode layer) and, if it does, ``fusable(layer) -> bool`` (after
  loading: its projections in a form the fused GEMMs read) and ``forward_fused(layer,
  stream, sum_sq, layer_idx, positions, rope, cache, meta) -> (stream, sum_sq)``.
* mlp: the same with ``forward(layer, x) -> [T, H]`` and ``forward_fused(layer, stream,
  sum_sq, want_next) -> (stream, sum_sq or None)``.
* norm: ``build(spec, ops) -> nn.Module`` with buffers ``weight`` (and ``bias``) and
  ``forward(x, residual=None) -> (normed, x + residual)``; ``folds = True`` where it is
  an RMSNorm whose weight the fused decode layer may fold into the next projection;
  ``adds_partials`` where, given a residual, it also takes x as split-K partials.

An attention's or MLP's output projection may return split-K partials [S, T, H] only where
``layer.sums_partials`` (the norm after it adds them up: not before a post norm).

Weights a part adds beyond the LLaMA layer's slots are declared in the spec
(``LayerSpec.slots``), so that plans, planners and weight maps see them from the config
alone; a build refuses a spec whose declared slots its parts do not build, or that leaves
out a weight they build.
"""
from __future__ import annotations

import re
from typing import Any, Callable

import attrs

#: the parts a layer implementation can be
LAYER_KINDS = ("attention", "mlp", "norm")
_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]*$")  # as core.registry's


def _kind(instance, attribute, value) -> None:
    if value not in LAYER_KINDS:
        raise ValueError(f"LayerImpl kind must be one of {', '.join(LAYER_KINDS)}, got {value!r}")


def _name(instance, attribute, value) -> None:
    if not isinstance(value, str) or not _NAME.match(value):
        raise ValueError(f"LayerImpl name {value!r} is not valid (want lower-case letters, "
                         "digits, '-', '_' or '.')")


def _callable(instance, attribute, value) -> None:
    if not callable(value):
        raise ValueError(f"LayerImpl {instance.name!r}: build must be callable, got {value!r}")


@attrs.frozen
class LayerImpl:
    """One registered layer implementation: ``kind`` (attention, mlp or norm), the
    ``name`` a spec refers to it by (unique within its kind), and ``build`` (see the
    module docstring for each kind's signature)."""

    kind: str = attrs.field(validator=_kind)
    name: str = attrs.field(validator=_name)
    build: Callable[..., Any] = attrs.field(validator=_callable)
    description: str = ""
