"""The ``offload-weights`` planner: one device, and the decoder layers that do not fit its
budget kept in host memory (pinned on CUDA), copied to the device layer by layer each step
into a small ring of device slots, the next layer's copy overlapping the current layer's
compute (``core/runner/weight_stream.py``; docs/offload.md). The embeddings, norms, head
and the first layers that fit stay on the device. Composes with any cache backend and
quantiser (a quantised layer streams packed: packed on the host as it loads)::

    core.build(model, plugins=["offload-weights"], device_memory="16GiB")
    core.build(model, plugins=["offload-weights", "paged", "int8"], resident_layers=10)

Options: ``resident_layers`` (layers kept on the device; default: as many as fit beside
the K/V, the activations and the ring) and ``ring_size`` (device slots, >= 2; default 2).
A step then costs about the streamed bytes over the host-to-device bandwidth
(``infergraft plan --offload-weights`` measures it and prints the split).
"""
from __future__ import annotations

import math
import re

import torch

from infergraft.core.errors import PlanError
from infergraft.core.hookspecs import hookimpl
from infergraft.core.plan import WeightPlacement
from infergraft.core.runner.weight_stream import ALIGN, aligned
from infergraft.core.slots import slot_layout
from infergraft.core.units import fmt_bytes

from .single_device import SingleDevicePlanner

_LAYER_SLOT = re.compile(r"^layers\.(\d+)\.")


def layer_sizes(spec, element_bytes: int, quantizer=None, device=None,
                kernels=None) -> tuple[list[int], list[int]]:
    """(weight bytes of each layer, as the plan counts them; bytes of its packed host
    buffer, each tensor aligned: an upper bound of what ``WeightStreamer`` packs). A
    quantised slot counts ``packed_bytes_of`` and room for two more aligned tensors (int8:
    its scales; int4: its scales and zero-points), and the dequantised copy the quantiser
    keeps on ``device`` with ``kernels`` (``held_bytes_of``)."""
    sizes, packed = [0] * spec.num_layers, [0] * spec.num_layers
    for slot, (shape, _) in slot_layout(spec).items():
        m = _LAYER_SLOT.match(slot)
        if m is None:
            continue
        i = int(m[1])
        if quantizer is not None and quantizer.quantizes(slot):
            n = quantizer.packed_bytes_of(shape, element_bytes)
            packed[i] += aligned(n) + 2 * ALIGN
            dense = quantizer.held_bytes_of(shape, element_bytes, device, kernels) - n
            packed[i] += aligned(dense) if dense else 0
            n += dense
        else:
            n = math.prod(shape) * element_bytes
            packed[i] += aligned(n)
        sizes[i] += n
    return sizes, packed


def _check(spec, resident_layers, ring_size) -> None:
    n = spec.num_layers
    if resident_layers is not None and (isinstance(resident_layers, bool) or not isinstance(
            resident_layers, int) or not 0 <= resident_layers <= n):
        raise PlanError(f"planner 'offload-weights': resident_layers={resident_layers!r} must "
                        f"be an integer from 0 to {n} (the model's layers), or None for as "
                        "many as fit")
    if isinstance(ring_size, bool) or not isinstance(ring_size, int) or ring_size < 2:
        raise PlanError(f"planner 'offload-weights': ring_size={ring_size!r} must be an "
                        "integer >= 2 (device slots the streamed layers take turns in)")


class OffloadWeightsPlanner(SingleDevicePlanner):
    name = "offload-weights"
    options = {"resident_layers": None, "ring_size": 2}

    def plan(self, spec, world_size=1, resident_layers=None, ring_size=2, **options):
        _check(spec, resident_layers, ring_size)
        if world_size != 1:
            raise PlanError(f"planner 'offload-weights' runs on one device, got "
                            f"world_size={world_size}")
        return super().plan(spec, world_size)

    def place_weights(self, plan, spec, budget, kv_device_bytes, weight_quantizer=None,
                      resident_layers=None, ring_size=2, **options) -> WeightPlacement:
        """The first layers that fit ``budget`` beside the K/V (``kv_device_bytes``), the
        activations, the embeddings, norms and head, and a ring of ``ring_size`` slots of
        the largest streamed layer; the rest stream. ``plan``: a ``core.plan.Plan`` or a
        ``core.memory.MemoryPlan`` (``weight_bytes``, ``activation_bytes``, ``dtype``)."""
        _check(spec, resident_layers, ring_size)
        n = spec.num_layers
        sizes, packed = layer_sizes(spec, getattr(torch, plan.dtype).itemsize,
                                    weight_quantizer, getattr(plan, "device", None),
                                    getattr(plan, "kernels", None))
        fixed = plan.weight_bytes - sum(sizes)  # embeddings, final norm, head

        def keep(k: int, why: str) -> WeightPlacement:
            if n - k <= ring_size:  # no more layers than slots: resident, they take no more room
                if k < n:
                    why = "; ".join(filter(None, (why, f"the {n - k} layer(s) left are no more "
                                                  f"than the {ring_size} ring slots: they stay")))
                return WeightPlacement(tuple(range(n)), (), tuple(sizes), note=why)
            return WeightPlacement(tuple(range(k)), tuple(range(k, n)), tuple(sizes),
                                   max(packed[k:]), ring_size)

        if resident_layers is not None:
            return keep(resident_layers, f"resident_layers={resident_layers}")
        if budget is None:
            return keep(n, "no device budget to fit")
        room = budget - kv_device_bytes - plan.activation_bytes - fixed
        if sum(sizes) <= room:
            return keep(n, "every layer fits the budget")
        fits = [k for k in range(n) if sum(sizes[:k]) + ring_size * max(packed[k:]) <= room]
        if not fits:
            ring = ring_size * max(packed)
            need = fixed + ring + kv_device_bytes + plan.activation_bytes
            raise PlanError(
                f"planner 'offload-weights': {plan.model} does not fit even with every layer "
                f"in host memory: embeddings, norms and head {fmt_bytes(fixed)} + a "
                f"{ring_size}-slot ring {fmt_bytes(ring)} (the largest layer "
                f"{fmt_bytes(max(packed))} each) + K/V {fmt_bytes(kv_device_bytes)} + "
                f"activations {fmt_bytes(plan.activation_bytes)} = {fmt_bytes(need)} > the "
                f"budget {fmt_bytes(budget)}. Lower max_batch_size, max_seq_len or "
                "max_num_batched_tokens, or give a larger device_memory")
        return keep(max(fits), "")


@hookimpl
def infergraft_register_planners(register):
    register(OffloadWeightsPlanner())
