"""The pieces a config's keys are checked and gathered with: ``Resolution`` (what each
key asks for, so that two keys asking for different things is an error naming both), the
value checks (each error names the key, the value and what is accepted), dtype spellings
and the policy a name, an architecture or a layer class stands for."""
from __future__ import annotations

import difflib
import json
import re
from typing import Any

import torch

from ..errors import ConfigError

# DeepSpeed's dtype spellings (DtypeEnum in deepspeed/inference/config.py) and ours
DTYPE_NAMES = {
    "float16": ("fp16", "float16", "half", "torch.float16", "torch.half"),
    "bfloat16": ("bf16", "bfloat16", "bfloat", "torch.bfloat16"),
    "float32": ("fp32", "float32", "float", "torch.float32", "torch.float"),
    "int8": ("int8", "torch.int8"),  # DeepSpeed's int8 weights: float16 + our "int8" plugin
}
TORCH_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32",
                torch.int8: "int8"}
DTYPE_ACCEPTED = ("one of " + ", ".join(s for names in DTYPE_NAMES.values() for s in names)
                  + " (any case), or torch.float16 / bfloat16 / float32 / int8")
# what a layer class or an HF class adds to its family's name (LlamaDecoderLayer, GPT2Block)
_CLASS_SUFFIX = re.compile(r"(DecoderLayer|EncoderLayer|Layer|Block|Attention|MLP|ForCausalLM|"
                           r"LMHeadModel|PreTrainedModel|Model)$")


def show(value) -> str:
    """``value`` as the config file spells it (JSON), else Python's repr."""
    if isinstance(value, type):
        return value.__name__
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def wrong(key: str, value, accepted: str) -> ConfigError:
    return ConfigError(f"config key {key}={show(value)} is not valid; accepted: {accepted}")


def positive_int(key: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise wrong(key, value, "an integer >= 1")
    return value


def boolean(key: str, value, none: bool = False):
    if value is None and none:
        return None
    if not isinstance(value, bool):
        raise wrong(key, value, "true or false" + (" (or null: the default)" if none else ""))
    return value


def no_object(key: str, value) -> None:
    """A key only a Python object can fill (a process group): refused unless null."""
    if value is not None:
        raise ConfigError(f"config key {key}={show(value)} is refused: it is a Python object "
                          "(a file cannot hold one) and the process group is torchrun's "
                          "world; remove it")


def section(key: str, value, shape: str) -> dict:
    """A nested object of the config (``fp16``, ``tensor_parallel``, ...)."""
    if not isinstance(value, dict):
        raise wrong(key, value, f"an object such as {shape}")
    return value


def dtype_name(key: str, value) -> str:
    """float16, bfloat16, float32 or int8, from any of DeepSpeed's spellings or ours."""
    if isinstance(value, torch.dtype) and value in TORCH_DTYPES:
        return TORCH_DTYPES[value]
    if isinstance(value, str):
        for name, spellings in DTYPE_NAMES.items():
            if value.strip().lower() in spellings:
                return name
    raise wrong(key, value, DTYPE_ACCEPTED)


def closest(key: str, known) -> str:
    """`` (did you mean 'x'?)`` for the known key nearest ``key``, else a pointer to the docs."""
    found = difflib.get_close_matches(key, sorted(set(known)), n=1, cutoff=0.6)
    return f"did you mean {found[0]!r}?" if found else "docs/config.md lists the known keys"


def find_policy(pm, key: str, name: str, quiet: bool = False):
    """The registered policy ``name`` stands for: a policy name ("llama"), an architecture
    ("LlamaForCausalLM") or a class of the model ("LlamaDecoderLayer"). None if ``quiet``
    and nothing matches, else ConfigError listing the policies."""
    policies = list(pm.policies())
    for found in ([p for p in policies if name == p.name],
                  [p for p in policies if name in p.architectures]):
        if found:
            return found[0].name
    family = _CLASS_SUFFIX.sub("", name).lower()
    for policy in policies:
        stems = {_CLASS_SUFFIX.sub("", a).lower() for a in policy.architectures}
        if family and family in stems | {t.lower() for t in policy.model_types} | {policy.name}:
            return policy.name
    if quiet:
        return None
    raise ConfigError(f"config key {key}={show(name)} names no registered policy (by name, "
                      f"architecture or layer class such as LlamaDecoderLayer); known "
                      f"policies: {known_policies(policies)}")


def known_policies(policies) -> str:
    """"llama (LlamaForCausalLM); ..." for an error, or why there is none."""
    if not policies:
        return ("none: no policy plugin is loaded (`infergraft plugins` lists what is; "
                "INFERGRAFT_DISABLE_PLUGINS may block them)")
    return "; ".join(f"{p.name} ({', '.join(p.architectures)})" for p in policies)


def subkeys(r, key: str, value: dict, known) -> None:
    """Each sub-key of ``key`` not in ``known``: a warning naming the closest one."""
    for sub in value:
        if sub not in known:
            r.unknown_key(f"{key}.{sub}", [f"{key}.{k}" for k in known])


class Resolution:
    """What a config's keys ask for, before anything is decided. Each target (dtype,
    max_seq_len, kernels, ...) keeps the keys that set it; two that disagree are an error."""

    def __init__(self, pm):
        self.pm = pm
        self.claims: dict[str, list[tuple[str, Any, Any]]] = {}
        self.plugins: list = []  # the config's own `plugins`
        self.flags: dict[str, str] = {}  # "tp", "fused", "int8 dtype" -> the key that asked
        self.training: list[str] = []  # training-only keys found
        self.notes: list[str] = []  # sentences added to the training-only warning
        self.no_effect: list[str] = []  # "key (why)" for inference keys we ignore
        self.unknown: list[tuple[str, str]] = []  # (dotted key, "did you mean ...")
        self.explained: list[str] = []  # other warnings, one each

    def claim(self, target: str, value, key: str, shown=None) -> None:
        """``key`` asks for ``target`` = ``value`` (``shown``: the key's own value)."""
        self.claims.setdefault(target, []).append((key, value, value if shown is None else shown))

    def has(self, target: str) -> bool:
        return target in self.claims

    def value(self, target: str, default=None):
        found = self.claims.get(target, [])
        for key, value, shown in found[1:]:
            if not _same(value, found[0][1]):
                k0, v0, s0 = found[0]
                raise ConfigError(f"config keys {k0}={show(s0)} and {key}={show(shown)} ask for "
                                  f"different {target} ({show(v0)} and {show(value)}); give one")
        return found[0][1] if found else default

    def key_of(self, target: str) -> str:
        return self.claims[target][0][0]

    def ignored(self, key: str, value, default, why: str) -> None:
        """An inference key with no effect here: silent at DeepSpeed's default, else warned."""
        if not _same(value, default):
            self.no_effect.append(f"{key}={show(value)} ({why})")

    def unknown_key(self, key: str, known) -> None:
        self.unknown.append((key, closest(key, known)))


def _same(a, b) -> bool:
    try:
        return bool(a == b) and type(a) is type(b) or a is b
    except Exception:  # noqa: BLE001 - objects whose == raises are simply not the same
        return a is b
