"""Before a build: which plugins ``plugins=[...]`` names (by kind), which policy claims
the model, and the dtype and device asked for, each refused with what is accepted."""
from __future__ import annotations

import difflib
import importlib.metadata
import re
from typing import Any, Iterable, Optional

import attrs
import torch

from .errors import PlanError, UnknownPluginError, UnsupportedModelError
from .plugin_manager import PluginManager
from .registry import SELECTABLE

DEFAULT_CACHE_BACKEND = "contiguous"
DEFAULT_PLANNER = "single"
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
# Architectures that a package in this repository's contrib/ supports: (its distribution,
# its plugin's name). A model that no registered policy claims is told where one is.
CONTRIB_FAMILIES = {"Qwen2ForCausalLM": ("infergraft-qwen", "qwen2"),
                    "Qwen3ForCausalLM": ("infergraft-qwen", "qwen3"),
                    "Qwen3MoeForCausalLM": ("infergraft-qwen", "qwen3_moe")}


@attrs.define
class Selection:
    """What ``plugins=[...]`` asked for, sorted by kind."""

    policy: Optional[str] = None
    cache_backend: Optional[str] = None
    planner: Optional[str] = None
    quantizers: list[str] = attrs.field(factory=list)


def resolve_dtype(dtype, default: torch.dtype) -> torch.dtype:
    if dtype is None:
        return default
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.lower() in DTYPES:
        return DTYPES[dtype.lower()]
    raise PlanError(f"unsupported dtype {dtype!r}; choose float32, bfloat16 or float16")


def resolve_device(device) -> torch.device:
    """``device`` (None: cuda if present, else cpu) as a torch.device this machine has."""
    here = "cpu" + (f", cuda:0..{torch.cuda.device_count() - 1}" if torch.cuda.is_available() else "")
    try:
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except (RuntimeError, TypeError, ValueError):
        raise PlanError(f"device {device!r} is not a device name; available here: {here}") from None
    if dev.type not in ("cpu", "cuda"):
        raise PlanError(f"device type {dev.type!r} is not supported; use cpu or cuda (here: {here})")
    if dev.type == "cuda" and (not torch.cuda.is_available() or
                               (dev.index or 0) >= torch.cuda.device_count()):
        raise PlanError(f"device {str(dev)!r} is not available here; available: {here}")
    return dev


def select_plugins(pm: PluginManager, plugins: Optional[Iterable[Any]]):
    """Resolve names and plugin objects; returns (manager, Selection)."""
    if plugins is not None and (isinstance(plugins, (bytes, dict))
                                or not isinstance(plugins, (str, Iterable))):
        raise UnknownPluginError(f"plugins must be a list of names and plugin objects, got "
                                 f"{type(plugins).__name__} {plugins!r}")
    plugins = [plugins] if isinstance(plugins, str) else list(plugins or [])
    objects = [p for p in plugins if not isinstance(p, str)]
    names = [p for p in plugins if isinstance(p, str)]
    if objects:
        before = {k: set(r.names()) for k, r in _selectable(pm).items()}
        pm = pm.copy_with(objects)
        for kind, reg in _selectable(pm).items():  # what the objects brought is selected
            names += sorted(set(reg.names()) - before[kind])
    regs = _selectable(pm)
    sel = Selection()
    for name in names:
        kinds = [k for k, r in regs.items() if name in r]
        if not kinds:
            known = "; ".join(f"{'policies' if k == 'policy' else k + 's'}: "
                              f"{', '.join(r.names()) or '-'}" for k, r in regs.items())
            raise pm.skipped_error(name) or UnknownPluginError(
                f"unknown plugin {name!r}. Registered {known}")
        kind = kinds[0]
        if kind == "quantizer":
            if name not in sel.quantizers:
                sel.quantizers.append(name)
            continue
        field = {"policy": "policy", "cache backend": "cache_backend", "planner": "planner"}[kind]
        if getattr(sel, field) not in (None, name):
            raise PlanError(f"plugins name two {kind}s, {getattr(sel, field)!r} and {name!r}; "
                            "choose one")
        setattr(sel, field, name)
    return pm, sel


def _selectable(pm: PluginManager) -> dict:
    """The registries ``plugins=[...]`` picks from (the layer implementations a build
    takes are the ones its spec names: never selected by name)."""
    return {kind: reg for kind, reg in pm.registries().items() if kind in SELECTABLE}


def choose_policy(pm: PluginManager, config, forced: Optional[str]):
    registry = pm.policies()
    if forced is not None:
        policy = registry.get(forced)
        policy.check(config)
        return policy
    claimants = [p for p in registry if p.claims(config)]
    archs = getattr(config, "architectures", None) or [getattr(config, "model_type", "?")]
    if not claimants:
        supported = sorted({a for p in registry for a in p.architectures})
        raise UnsupportedModelError(
            f"no registered policy supports {', '.join(archs)}"
            f"{closest_hint(registry, archs, getattr(config, 'model_type', None))}; supported "
            f"architectures: {', '.join(supported) or '(none)'}{contrib_hint(pm, archs)}")
    if len(claimants) > 1:
        names = ", ".join(repr(p.name) for p in claimants)
        raise UnsupportedModelError(f"policies {names} (plugins {', '.join(registry.origin(p.name) for p in claimants)}) "
                                    f"all claim {', '.join(archs)}; pick one with plugins=[name]")
    return claimants[0]


def closest_supported(registry, archs, model_type=None, n: int = 3) -> list[str]:
    """The supported architectures nearest to ``archs`` and ``model_type`` by spelling,
    nearest first, each ``Arch (policy)``: those of the registered policies and those a
    contrib package has (``CONTRIB_FAMILIES``). Names are compared without their head
    (``Phi3SmallForCausalLM`` as ``phi3small``: near ``phi3``), model types with model
    types and those stems (difflib's ratio, at least 0.6)."""
    owners = {a: p.name for p in registry for a in p.architectures}
    for arch, (_, plugin) in CONTRIB_FAMILIES.items():
        owners.setdefault(arch, plugin)
    keys = [(_stem(a), a) for a in owners]  # (what is compared, the architecture it names)
    keys += [(t, a) for p in registry for t in p.model_types for a in p.architectures]
    words = [_stem(a) for a in archs] + ([model_type.lower()] if isinstance(model_type, str)
                                         else [])
    scored = {}
    for word in words:
        for key, arch in keys:
            score = difflib.SequenceMatcher(None, word, key).ratio()
            if score >= 0.6 and arch not in archs:
                scored[arch] = max(score, scored.get(arch, 0.0))
    best = sorted(scored, key=lambda a: (-scored[a], a))[:n]
    return [f"{a} ({owners[a]})" for a in best]


_HEADS = re.compile(r"(ForCausalLM|LMHeadModel|ForConditionalGeneration|Model)$")


def _stem(arch: str) -> str:
    """``Phi3ForCausalLM`` -> ``phi3``: the family part of an architecture's name."""
    return _HEADS.sub("", str(arch)).lower() or str(arch).lower()


def closest_hint(registry, archs, model_type=None) -> str:
    near = closest_supported(registry, archs, model_type)
    return f" (closest supported by name: {', '.join(near)})" if near else ""


def contrib_hint(pm: PluginManager, archs) -> str:
    """Where the policy of one of ``archs`` is, if a contrib package has it: how to install
    it, or why the installed one is not loaded; "" for an architecture none has."""
    for arch in archs:
        if arch not in CONTRIB_FAMILIES:
            continue
        package, plugin = CONTRIB_FAMILIES[arch]
        try:
            importlib.metadata.distribution(package)
        except importlib.metadata.PackageNotFoundError:
            return (f". The package {package} supports {arch}: from a checkout of "
                    f"infergraft, pip install ./contrib/{package}")
        broken = pm.broken.get(plugin)
        why = (f"it was skipped at load: {broken.reason}" if broken is not None else
               "INFERGRAFT_DISABLE_PLUGINS or INFERGRAFT_LOAD_PLUGINS leaves it out")
        return (f". The installed package {package} supports {arch}, but its plugin "
                f"{plugin!r} is not loaded: {why}")
    return ""
