"""One registry per plugin kind: validates and de-duplicates what plugins register."""
from __future__ import annotations

import re
from typing import Callable, Generic, Iterator, TypeVar

from .errors import PluginError, UnknownPluginError
from .layer import LAYER_KINDS

T = TypeVar("T")
_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]*$")

_LAYERS = ("infergraft_register_layers", ("name", "kind", "build"))
#: kind -> (hook name, attributes every registered object must have). The kinds a build
#: selects by name (``plugins=[...]``) first; then the layer implementations, which a
#: spec names (core/layer.py): one hook, its objects sorted by their ``kind``; then the
#: logits processors, which requests name (core/logits_processor.py), and the proposers,
#: which a build's ``speculative`` config names (core/speculative/proposer.py).
KINDS = {
    "policy": ("infergraft_register_policies", ("name", "architectures", "describe", "weight_map")),
    "cache backend": ("infergraft_register_cache_backends", ("name", "create")),
    "quantizer": ("infergraft_register_quantizers", ("name", "applies_to")),
    "planner": ("infergraft_register_planners", ("name", "plan")),
    **{kind: _LAYERS for kind in LAYER_KINDS},
    # per-request constraints on the next token, named by requests (SamplingParams)
    "logits processor": ("infergraft_register_logits_processors", ("name", "start")),
    # speculative tokens, named by a build's speculative config (core/speculative/)
    "proposer": ("infergraft_register_proposers", ("name", "create")),
}
SELECTABLE = ("policy", "cache backend", "quantizer", "planner")


class Registry(Generic[T]):
    """Name -> object for one kind, remembering which plugin registered each name."""

    def __init__(self, kind: str, hook: str, required: tuple[str, ...]):
        self.kind, self.hook, self.required = kind, hook, required
        self._items: dict[str, T] = {}
        self._origin: dict[str, str] = {}

    def add(self, obj: T, plugin: str) -> None:
        name = getattr(obj, "name", None)
        if not isinstance(name, str) or not _NAME.match(name):
            raise PluginError(plugin, self.hook,
                              f"registered a {self.kind} with invalid name {name!r} "
                              "(want lower-case letters, digits, '-', '_' or '.')")
        missing = [a for a in self.required if not hasattr(obj, a)]
        if missing:
            raise PluginError(plugin, self.hook,
                              f"{self.kind} {name!r} lacks required attribute(s) {missing}")
        if name in self._items:
            if self._items[name] is obj or type(self._items[name]) is type(obj) and \
                    self._origin[name] == plugin:
                return  # the same thing registered twice: keep one
            raise PluginError(plugin, self.hook,
                              f"{self.kind} name {name!r} is already registered by plugin "
                              f"{self._origin[name]!r}")
        self._items[name] = obj
        self._origin[name] = plugin

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            raise UnknownPluginError(
                f"unknown {self.kind} {name!r}; registered {self.kind}s: "
                f"{', '.join(sorted(self._items)) or '(none)'}") from None

    def origin(self, name: str) -> str:
        return self._origin[name]

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[T]:
        return iter(self._items.values())

    def __len__(self) -> int:
        return len(self._items)


def collect(hookimpls: Callable[[str], list], call_one: Callable) -> dict[str, Registry]:
    """A Registry per kind, filled by calling each hook's implementations once, in load
    order (not pluggy's LIFO: a name clash blames the later plugin). ``hookimpls(hook)``
    lists a hook's implementations, ``call_one(impl, hook, register=...)`` calls one."""
    regs = {kind: Registry(kind, hook, required) for kind, (hook, required) in KINDS.items()}
    for hook in dict.fromkeys(hook for hook, _ in KINDS.values()):
        kinds = [k for k, (h, _) in KINDS.items() if h == hook]
        for impl in hookimpls(hook):
            def register(obj, _p=impl.plugin_name, _hook=hook, _kinds=kinds):
                kind = _kinds[0] if len(_kinds) == 1 else getattr(obj, "kind", None)
                if kind not in _kinds:
                    raise PluginError(_p, _hook, f"registered {obj!r} of kind {kind!r}; "
                                      f"accepted kinds: {', '.join(_kinds)} (e.g. a "
                                      "core.layer.LayerImpl)")
                regs[kind].add(obj, _p)
            call_one(impl, hook, register=register)
    return regs
