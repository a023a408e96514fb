"""A config for ``core.build``: a JSON file (or a dict) of build's own keyword arguments and
plugin options, with DeepSpeed's inference keys mapped onto them (docs/config.md).

    engine = core.build(model, config="ds_config.json", max_batch_size=8)

``resolve_config`` reads every key before anything is built: a wrong value is a
``ConfigError`` naming the key, the value and what is accepted; training-only keys are
ignored with one ``ConfigWarning`` naming them all; an unknown key is a ``ConfigWarning``
naming the closest known key. Arguments given to ``build`` itself win over the config."""
from __future__ import annotations

import inspect
import json
import os
import warnings
from pathlib import Path

from ..errors import ConfigError, ConfigWarning
from ..loading.checkpoint import describe_checkpoint
from ..plugin_manager import get_plugin_manager
from .deepspeed import MAPPERS
from .own import OWN_HANDLERS, OWN_KEYS, PASSED
from .parallel import decide_parallel
from .table import DEEPSPEED_KEYS, TRAINING_KEYS
from .values import Resolution, show
from .weights import offload_hint

__all__ = ["load_config", "resolve_config", "explicit_arguments", "DEEPSPEED_KEYS", "OWN_KEYS",
           "ConfigError", "ConfigWarning"]


def load_config(source) -> dict:
    """The config ``source`` holds: a path to a JSON file (an object at its top), or a dict
    (copied). ConfigError for a missing file, text that is not JSON (its line and column)
    or a top level that is not an object."""
    if isinstance(source, dict):
        return _copy(source)
    if not isinstance(source, (str, os.PathLike)):
        raise ConfigError(f"config must be a path to a JSON file or a dict, got "
                          f"{type(source).__name__} {source!r}")
    path = Path(source).expanduser()
    if not path.is_file():
        why = "is a directory" if path.is_dir() else "does not exist"
        raise ConfigError(f"config file {path} {why}; give a JSON file such as "
                          f"docs/examples/ds_config.json")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {path} cannot be read: {e}") from None
    try:
        data = json.loads(text, object_pairs_hook=lambda pairs: _object(path, pairs))
    except json.JSONDecodeError as e:
        raise ConfigError(f"config file {path} is not JSON: line {e.lineno}, column {e.colno}: "
                          f"{e.msg}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} holds {show(data)[:40]}, not a JSON object such "
                          "as {\"dtype\": \"fp16\", \"max_seq_len\": 2048}")
    return data


def resolve_config(source, overrides: dict | None = None) -> dict:
    """``core.build``'s keyword arguments from the config ``source`` (``load_config``), with
    ``overrides`` (build's explicit arguments) winning key by key; ``plugins`` (always a
    list) is the config's plugins followed by the overrides', each once."""
    data = load_config(source)
    pm = get_plugin_manager()
    r, options = Resolution(pm), _plugin_options(pm)
    for key, value in data.items():
        if key in OWN_HANDLERS:
            if value is not None:
                OWN_HANDLERS[key](r, key, value)
        elif key in MAPPERS:
            MAPPERS[key](r, key, value)
        elif key in TRAINING_KEYS:
            r.training.append(key)
            hint = offload_hint(key, value)
            r.notes += [hint] if hint else []
        elif key in options:
            r.claim(key, value, key)
        else:
            r.unknown_key(key, [*OWN_KEYS, *MAPPERS, *TRAINING_KEYS, *options])
    kwargs = _decide(r, options)
    _warn(r)
    overrides = dict(overrides or {})
    plugins = kwargs.pop("plugins") + _as_list(overrides.pop("plugins", None))
    return {**kwargs, **overrides, "plugins": _once(plugins)}


def explicit_arguments(fn, values: dict) -> dict:
    """The arguments in ``values`` (``fn``'s locals on entry) that differ from ``fn``'s
    defaults, ``**`` ones included: what a caller passed on purpose (``config`` left out)."""
    out = {}
    for name, p in inspect.signature(fn).parameters.items():
        if name == "config" or name not in values:
            continue
        if p.kind is p.VAR_KEYWORD:
            out.update(values[name])
        elif not (values[name] is p.default or type(values[name]) is type(p.default)
                  and values[name] == p.default):
            out[name] = values[name]
    return out


def _decide(r: Resolution, options) -> dict:
    """The build arguments the gathered claims come to (conflicts raise here)."""
    out = {k: r.value(k) for k in PASSED if r.has(k)}
    if r.has("dtype"):
        out["dtype"] = r.value("dtype")
    elif "int8 dtype" in r.flags:
        out["dtype"] = "float16"  # DeepSpeed's int8: float16 activations
    if "fused" in r.flags and out.get("kernels") == "torch":
        key, _, shown = r.claims["kernels"][0]
        raise ConfigError(f"config keys {r.flags['fused']}=true (our fused path) and "
                          f"{key}={show(shown)} (plain torch layers) disagree; give one")
    low = r.value("min_out_tokens")
    if low is not None and out.get("max_seq_len") is not None and low > out["max_seq_len"]:
        raise ConfigError(f"config key {r.key_of('min_out_tokens')}={low} is more than "
                          f"max_seq_len={out['max_seq_len']} ({r.key_of('max_seq_len')}); "
                          f"accepted: at most {out['max_seq_len']}")
    plugins = list(r.plugins)
    if r.has("policy"):
        plugins.append(r.value("policy"))
    plugins += decide_parallel(r, out)
    plugins += [r.value("weights")] if r.value("weights") is not None else []  # int8, int4
    plugins += [f"kv-{r.value('kv')}"] if r.value("kv") is not None else []  # kv-int8, kv-fp8
    if r.has("checkpoint"):
        out["checkpoint"] = describe_checkpoint(r.value("checkpoint"), r.value("base_dir"),
                                                key=r.key_of("checkpoint"))
    elif r.has("base_dir"):
        r.no_effect.append(f"{r.key_of('base_dir')} (no checkpoint names files under it)")
    out.update({k: r.value(k) for k in r.claims if k in options and k != "tp_size"})
    out["plugins"] = _once(plugins)
    return out


def _warn(r: Resolution) -> None:
    if r.training:
        notes = "".join(f"; {n}" for n in r.notes)
        warnings.warn(ConfigWarning(
            f"training-only DeepSpeed keys are ignored (nothing here trains): "
            f"{', '.join(r.training)}{notes}"), stacklevel=3)
    if r.no_effect:
        warnings.warn(ConfigWarning("DeepSpeed keys with no effect here are ignored: "
                                    + "; ".join(r.no_effect)), stacklevel=3)
    for key, hint in r.unknown:
        warnings.warn(ConfigWarning(f"unknown config key {key!r} is ignored; {hint}"),
                      stacklevel=3)
    for message in r.explained:
        warnings.warn(ConfigWarning(message), stacklevel=3)


def _plugin_options(pm) -> set[str]:
    """Every option a registered plugin declares (they pass through to build)."""
    return {name for registry in pm.registries().values() for plugin in registry
            for name in (getattr(plugin, "options", None) or {})}


def _object(path: Path, pairs: list) -> dict:
    seen = {}
    for key, value in pairs:
        if key in seen:
            warnings.warn(ConfigWarning(f"config file {path}: key {key!r} appears twice; the "
                                        "last one is used"), stacklevel=2)
        seen[key] = value
    return seen


def _copy(value):
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


def _as_list(plugins) -> list:
    if plugins is None:
        return []
    return [plugins] if isinstance(plugins, str) else list(plugins)


def _once(plugins: list) -> list:
    out = []
    for p in plugins:
        if not any(p is q or isinstance(p, str) and p == q for q in out):
            out.append(p)
    return out
