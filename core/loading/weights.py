"""Stream HF tensors, one at a time, through a policy's weight map into our slots.

Fused slots (qkv, gate_up) are allocated once at the target dtype/device and filled
part by part; unfused tensors already in the right dtype/device are adopted as they
are. No second full copy of the model exists at any point.
"""
from __future__ import annotations

import re
from typing import Callable, Iterable, Optional

import torch
from torch import nn

from ..errors import WeightLoadError
from ..slots import slot_layout
from ..policy import WeightMap, expand_rules
from ..spec import ModelSpec


def check_weight_map(policy_name: str, spec: ModelSpec, wmap: WeightMap) -> dict:
    """Validate that the map's rules fill every slot exactly once; returns key -> rule."""
    layout = slot_layout(spec)
    rules = expand_rules(wmap.rules, spec.num_layers)
    filled: dict[str, set] = {}
    for key, r in rules.items():
        if r.slot not in layout:
            raise WeightLoadError(f"policy {policy_name!r} maps {key!r} to unknown slot {r.slot!r}")
        parts = layout[r.slot][1]
        part = r.part if parts is not None else None
        if part is not None and not 0 <= part < len(parts):
            raise WeightLoadError(f"policy {policy_name!r}: {key!r} names part {part} of "
                                  f"{r.slot!r}, which has {len(parts)} parts")
        seen = filled.setdefault(r.slot, set())
        # part None on a fused slot fills every part at once (GPT-2's c_attn -> qkv)
        fills = set(range(len(parts))) if parts is not None and part is None else {part}
        if seen & fills or (part is None and seen):
            raise WeightLoadError(f"policy {policy_name!r} fills {r.slot!r} twice")
        seen |= fills
    for slot, (_, parts) in layout.items():
        need = set(range(len(parts))) if parts else {None}
        if filled.get(slot, set()) != need:
            raise WeightLoadError(f"policy {policy_name!r} leaves slot {slot!r} unfilled")
    for key, r in alternative_rules(spec, wmap).items():
        if r.slot not in layout or r.part is not None or key in rules:
            raise WeightLoadError(
                f"policy {policy_name!r}: alternative {key!r} -> {r.slot!r} must fill a whole "
                "slot of the layout (part None) under a key no rule maps")
    return rules


def alternative_rules(spec: ModelSpec, wmap: WeightMap) -> dict:
    """HF key -> alternative rule (``WeightMap.alternatives``), ``{i}`` filled in."""
    return expand_rules(wmap.alternatives, spec.num_layers)


def load_weights(model: nn.Module, spec: ModelSpec, wmap: WeightMap,
                 tensors: Iterable[tuple[str, torch.Tensor]], *, policy_name: str, device,
                 dtype: torch.dtype, on_slot_ready: Optional[Callable] = None,
                 place: Optional[Callable] = None, device_of: Optional[Callable] = None) -> None:
    """``spec`` is the whole model's; ``place(slot, tensor)``, when given, maps each whole
    slot to (this rank's slot, its piece), or None where the rank holds none
    (core/distributed/ranks.py). ``device_of(slot)``, when given, is the device a slot loads to
    instead of ``device`` where it returns one (the host, for layers streamed to the
    device step by step: plugins/offload_weights.py)."""
    rules = check_weight_map(policy_name, spec, wmap)
    alternatives = alternative_rules(spec, wmap)
    layout = slot_layout(spec)
    # slot -> the first key that filled it (or a part), and -> the alternative that did
    started: dict[str, str] = {}
    replaced: dict[str, str] = {}
    ignore = [re.compile(p) for p in wmap.ignore]
    pending: dict[str, set] = {}  # slot -> parts still missing
    buffers: dict[str, torch.Tensor] = {}
    prequantized: dict[str, dict] = {}  # slot -> part -> a pre-quantised part (gptq.py)
    aliases = dict(wmap.aliases)
    seen, unexpected = set(), []
    for key, tensor in tensors:
        if key in aliases:  # a stand-in for another key, used only if that one is absent
            if aliases[key] in seen:
                continue
            key = aliases[key]
        elif key in seen and key in aliases.values():
            continue  # the alias already supplied it
        rule = rules.get(key) or alternatives.get(key)
        if rule is None:
            if any(p.match(key) for p in ignore):
                continue
            unexpected.append(key)
            continue
        if key in seen:
            raise WeightLoadError(f"weight {key!r} arrived twice")
        seen.add(key)
        other = replaced.get(rule.slot) or (key in alternatives and started.get(rule.slot))
        if other:  # one layout of a slot's weights, or the other
            raise WeightLoadError(f"weights {other!r} and {key!r} both fill {rule.slot!r}: "
                                  "a checkpoint holds one layout of them, not both")
        started.setdefault(rule.slot, key)
        if key in alternatives:
            replaced[rule.slot] = key
        shape, parts = layout[rule.slot]
        pre = getattr(tensor, "prequantized", False)  # GPTQ / AWQ / fp8 (gptq.py)
        if pre and (rule.transpose or rule.stacked or place is not None or on_slot_ready is None):
            raise WeightLoadError(f"weight {key!r} is pre-quantised: it loads on one device "
                                  "(no tp / pp), as an [out, in] projection, through the "
                                  "checkpoint's weight quantiser ('int4', 'fp8')")
        t = tensor.t() if rule.transpose else tensor
        if rule.stacked and t.dim() >= 2:  # [E, 2I, H] -> the slot's [E * 2I, H]
            t = t.flatten(0, 1)
        whole = parts is None or rule.part is None
        want = shape if whole else (parts[rule.part],) + tuple(shape[1:])
        if tuple(t.shape) != tuple(want):
            raise WeightLoadError(f"weight {key!r} has shape {tuple(t.shape)}, policy "
                                  f"{policy_name!r} expects {tuple(want)} for {rule.slot!r}")
        to = (device_of and device_of(rule.slot)) or device
        if pre:  # fused parts concatenated along N once all are in
            t = t.to(device=to, dtype=dtype)
            if whole:
                _install(model, rule.slot, t, on_slot_ready, place)
                continue
            got = prequantized.setdefault(rule.slot, {})
            got[rule.part] = t
            if len(got) == len(parts):
                _install(model, rule.slot, type(t).cat([got[i] for i in range(len(parts))]),
                         on_slot_ready, place)
                del prequantized[rule.slot]
            continue
        if whole:
            _install(model, rule.slot, t.to(device=to, dtype=dtype).contiguous(), on_slot_ready,
                     place)
            continue
        buf = buffers.get(rule.slot)
        if buf is None:
            buf = buffers[rule.slot] = torch.empty(shape, device=to, dtype=dtype)
            pending[rule.slot] = set(range(len(parts)))
        start = sum(parts[:rule.part])
        buf[start:start + parts[rule.part]].copy_(t)
        pending[rule.slot].discard(rule.part)
        if not pending[rule.slot]:
            _install(model, rule.slot, buffers.pop(rule.slot), on_slot_ready, place)
    if unexpected:
        raise WeightLoadError(f"policy {policy_name!r} left {len(unexpected)} weight(s) "
                              f"unconsumed: {', '.join(unexpected[:5])}"
                              f"{' ...' if len(unexpected) > 5 else ''}")
    missing = sorted(k for k in set(rules) - seen if rules[k].slot not in replaced)
    if missing:
        instead = {r.slot: k for k, r in alternatives.items()}
        alt = next((instead[rules[k].slot] for k in missing if rules[k].slot in instead), None)
        raise WeightLoadError(f"{len(missing)} weight(s) that policy {policy_name!r} needs are "
                              f"missing from the checkpoint: {', '.join(missing[:5])}"
                              f"{' ...' if len(missing) > 5 else ''}"
                              + (f" (or, stacked, {alt!r} and the like)" if alt else ""))


def _install(model: nn.Module, slot: str, tensor: torch.Tensor, on_slot_ready,
             place=None) -> None:
    if place is not None:
        placed = place(slot, tensor)
        if placed is None:  # another rank's
            return
        slot, tensor = placed
    path, attr = slot.rsplit(".", 1)
    module = model.get_submodule(path)
    if on_slot_ready is not None:
        replacement = on_slot_ready(slot, module, tensor)
        if replacement is not None:  # a quantiser swapped the module
            parent, name = path.rsplit(".", 1) if "." in path else ("", path)
            setattr(model.get_submodule(parent) if parent else model, name, replacement)
            return
    setattr(module, attr, tensor)
