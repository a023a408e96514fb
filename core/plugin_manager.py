"""The plugin manager: loads built-in and entry-point plugins, exposes typed registries.

Callers never touch ``pm.hook``: the facade methods below call each hook
implementation one by one, so an exception names the plugin and the hook it came from.

A built-in that fails to load is our bug and raises. An installed (entry-point) plugin
that fails (it does not import, its contract range excludes ours, a hook is misspelled
or raises, it registers a bad or taken name) is skipped with a :class:`PluginWarning`
and remembered in ``PluginManager.broken``: one broken install must not stop every
command, ``infergraft plugins`` included.
"""
from __future__ import annotations

import difflib
import importlib
import importlib.metadata as md
import warnings
from types import ModuleType
from typing import Any, Iterable

import attrs
import pluggy

from . import hookspecs
from .entry_points import (ENTRY_POINT_GROUP, BrokenPlugin, EntryPointLoader,  # noqa: F401
                           PluginWarning, names_from_env)
from .errors import InfergraftError, PluginError, UnknownPluginError
from .layer import LAYER_KINDS
from .plugin_contract import check_contract
from .registry import KINDS, SELECTABLE, Registry, collect

#: Built-ins, registered through the same path as third-party plugins.
DEFAULT_PLUGINS = (
    "infergraft.policies.llama_layers",
    "infergraft.policies.moe_layers",
    "infergraft.policies.llama",
    "infergraft.policies.mistral",
    "infergraft.policies.mixtral",
    "infergraft.policies.phi3",
    "infergraft.policies.gpt2",
    "infergraft.policies.gemma",
    "infergraft.plugins.contiguous",
    "infergraft.plugins.paged",
    "infergraft.plugins.offload",
    "infergraft.plugins.kv_quant",
    "infergraft.plugins.weight_int8",
    "infergraft.plugins.weight_int4",
    "infergraft.plugins.weight_fp8",
    "infergraft.plugins.single_device",
    "infergraft.plugins.offload_weights",
    "infergraft.plugins.tensor_parallel",
    "infergraft.plugins.pipeline_parallel",
    "infergraft.plugins.structured_output",
    "infergraft.plugins.proposers",
)
_KINDS = KINDS  # (its old name here)


@attrs.frozen
class PluginInfo:
    name: str
    origin: str  # "built-in" or the distribution that installed it
    version: str
    contract: str  # the contract range the plugin declares
    module: str


def _component_names(name: str, module) -> set[str]:
    """Names a built-in plugin module registers (``int8`` for ``weight_int8``)."""
    names: set[str] = set()
    # the selectable kinds' names only: "llama" the attention blocks no policy module
    for hook in dict.fromkeys(KINDS[kind][0] for kind in SELECTABLE):
        fn = getattr(module, hook, None)
        if fn is not None:
            try:
                fn(lambda obj: names.add(obj.name))
            except Exception as e:
                raise PluginError(name, hook, f"{type(e).__name__}: {e}") from e
    return names


class PluginManager(EntryPointLoader):
    """Typed facade over a pluggy manager; one registry per plugin kind."""

    def __init__(self) -> None:
        self._pm = pluggy.PluginManager(hookspecs.PROJECT)
        self._pm.add_hookspecs(hookspecs)
        self.info: dict[str, PluginInfo] = {}
        self._registries: dict[str, Registry] | None = None
        self._loadable: set[str] = set()  # names INFERGRAFT_DISABLE_PLUGINS may block
        #: entry-point plugins skipped at load, by name (see ``load_entry_points``)
        self.broken: dict[str, BrokenPlugin] = {}

    # -- loading -------------------------------------------------------------------
    def register(self, plugin: Any, name: str | None = None, origin: str = "in-process",
                 version: str = "") -> str:
        """Register a plugin module or object; returns the name it is known by."""
        name = name or getattr(plugin, "INFERGRAFT_PLUGIN_NAME", None) or _default_name(plugin)
        if name in self.info:
            raise PluginError(name, "register", "a plugin of this name is already registered")
        contract = check_contract(name, plugin, origin)
        try:
            self._pm.register(plugin, name=name)
        except pluggy.PluginValidationError as e:
            raise PluginError(name, "register", str(e)) from e
        try:  # a misspelled hook would otherwise be silently never called
            self._check_pending()
        except PluginError:
            self._pm.unregister(name=name)
            raise
        self.info[name] = PluginInfo(name, origin, version, contract,
                                     getattr(plugin, "__name__", type(plugin).__module__))
        self._registries = None
        return name

    def unregister(self, name: str) -> None:
        self._pm.unregister(name=name)
        self.info.pop(name, None)
        self._registries = None

    def load_defaults(self) -> None:
        blocked = names_from_env("INFERGRAFT_DISABLE_PLUGINS") or set()
        for modname in DEFAULT_PLUGINS:
            short = modname.rsplit(".", 1)[1]
            if short in blocked:  # not even imported: the escape hatch for a broken one
                self._loadable.add(short)
                continue
            module = importlib.import_module(modname)
            names = {short} | _component_names(short, module)
            self._loadable |= names
            if not blocked & names:  # "int8" blocks weight_int8
                self.register(module, name=short, origin="built-in", version=_own_version())

    def warn_unknown_blocked(self) -> None:
        """Warn when INFERGRAFT_DISABLE_PLUGINS names no plugin (a typo blocks nothing)."""
        unknown = (names_from_env("INFERGRAFT_DISABLE_PLUGINS") or set()) - self._loadable
        if unknown:
            warnings.warn(f"INFERGRAFT_DISABLE_PLUGINS names {sorted(unknown)}, which no "
                          f"built-in or installed plugin has; known: {sorted(self._loadable)}",
                          stacklevel=3)

    def check_pending(self) -> None:
        """Fail loudly on hook implementations that match no hookspec (misspellings).

        ``register`` already runs it for each plugin; loaders call it again at the end."""
        self._check_pending()

    def _check_pending(self) -> None:
        try:
            self._pm.check_pending()
        except pluggy.PluginValidationError as e:
            plugin = getattr(e, "plugin", None)
            pname = self._pm.get_name(plugin) if plugin is not None else "?"
            known = sorted(n for n in vars(hookspecs) if n.startswith("infergraft_"))
            wrong = [n for n in dir(plugin) if n.startswith("infergraft_") and n not in known]
            close = difflib.get_close_matches(wrong[0], known, 1) if wrong else []
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise PluginError(pname, "check_pending",
                              f"{e}{hint} (hooks in this contract: {', '.join(known)})") from e

    # -- calling -------------------------------------------------------------------
    def _collect(self) -> dict[str, Registry]:
        if self._registries is None:
            self._registries = collect(
                lambda hook: getattr(self._pm.hook, hook).get_hookimpls(), self._call_one)
        return self._registries

    def _call_one(self, impl, hook: str, **kwargs: Any) -> Any:
        try:
            return impl.function(**{a: kwargs[a] for a in impl.argnames})
        except InfergraftError:
            raise
        except Exception as e:
            raise PluginError(impl.plugin_name, hook, f"{type(e).__name__}: {e}") from e

    # -- typed facade --------------------------------------------------------------
    def policies(self) -> Registry:
        return self._collect()["policy"]

    def cache_backends(self) -> Registry:
        return self._collect()["cache backend"]

    def quantizers(self) -> Registry:
        return self._collect()["quantizer"]

    def planners(self) -> Registry:
        return self._collect()["planner"]

    def layers(self) -> dict[str, Registry]:
        """The layer implementations (``infergraft_register_layers``) by kind: attention,
        mlp, norm (core/layer.py)."""
        return {kind: self._collect()[kind] for kind in LAYER_KINDS}

    def logits_processors(self) -> Registry:
        return self._collect()["logits processor"]

    def proposers(self) -> Registry:
        """Speculative decoding's proposers (``infergraft_register_proposers``)."""
        return self._collect()["proposer"]

    def registries(self) -> dict[str, Registry]:
        """Every kind's registry: the selectable kinds', the layer kinds', then the logits
        processors' and the proposers'."""
        return dict(self._collect())

    def hook_names(self, plugin_name: str) -> list[str]:
        """The hooks a registered plugin implements (for ``infergraft plugins``)."""
        callers = self._pm.get_hookcallers(self._pm.get_plugin(plugin_name)) or []
        return sorted(c.name for c in callers)

    def prepare_plan(self, plan: Any, spec: Any) -> Any:
        """Let each plugin adjust the plan in turn (infergraft_prepare_plan)."""
        for impl in reversed(self._pm.hook.infergraft_prepare_plan.get_hookimpls()):
            new = self._call_one(impl, "infergraft_prepare_plan", plan=plan, spec=spec)
            if new is not None:
                if not isinstance(new, type(plan)):
                    raise PluginError(impl.plugin_name, "infergraft_prepare_plan",
                                      f"returned {type(new).__name__}, expected {type(plan).__name__}")
                plan = new
        return plan

    def copy_with(self, extra: Iterable[Any]) -> "PluginManager":
        """A new manager holding this one's plugins plus ``extra`` (for one build)."""
        new = PluginManager()
        for name, info in self.info.items():
            new._pm.register(self._pm.get_plugin(name), name=name)
            new.info[name] = info
        new.broken = dict(self.broken)
        for p in extra:  # e.g. None, a number, or a CacheBackend passed without a hook
            if not _implements_a_hook(p):
                raise UnknownPluginError(
                    f"plugins=[...] got {p!r}, which implements no infergraft hook: pass a "
                    "registered name, or a module or object with @core.hookimpl functions "
                    "(e.g. infergraft_register_cache_backends, whose register callback takes "
                    "your backend object)")
        added = [new.register(p) for p in extra]
        new.check_pending()
        new.added = added
        return new


def _implements_a_hook(plugin: Any) -> bool:
    marker = f"{hookspecs.PROJECT}_impl"  # what @hookimpl sets (also with specname=...)
    for name in dir(plugin):
        try:
            if hasattr(getattr(plugin, name), marker):
                return True
        except Exception:  # a property that raises is no hook
            continue
    return False


def _default_name(plugin: Any) -> str:
    if isinstance(plugin, ModuleType):
        return plugin.__name__.rsplit(".", 1)[-1]
    return getattr(plugin, "name", None) or type(plugin).__name__.lower()


def _own_version() -> str:
    try:
        return md.version("infergraft")
    except md.PackageNotFoundError:
        return "0+unknown"


_default: PluginManager | None = None


def get_plugin_manager() -> PluginManager:
    """The process-wide manager: built-ins plus installed entry-point plugins."""
    global _default
    if _default is None:
        pm = PluginManager()
        pm.load_defaults()
        pm.load_entry_points()
        pm.check_pending()
        pm.warn_unknown_blocked()
        _default = pm
    return _default


def reset_plugin_manager() -> None:
    """Forget the process-wide manager (after changing INFERGRAFT_* variables)."""
    global _default
    _default = None
