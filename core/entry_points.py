"""Installed plugins: loading the entry points of group ``infergraft``, and skipping one
that fails (it does not import, its contract range excludes ours, a hook is misspelled or
raises, it registers a bad or taken name) with a :class:`PluginWarning`, remembered in
``PluginManager.broken``: one broken install must not stop every command."""
from __future__ import annotations

import importlib.metadata as md
import os
import warnings
from typing import Any

import attrs

from .errors import PluginError, UnknownPluginError

ENTRY_POINT_GROUP = "infergraft"


class PluginWarning(UserWarning):
    """An installed plugin was skipped at load (the message says why, and how to silence it)."""


@attrs.frozen
class BrokenPlugin:
    """An entry-point plugin skipped at load: what ``infergraft plugins`` lists for it, and
    what a build that names it is told."""

    name: str  # the entry point's name
    entry_point: str  # what it points at ("module" or "module:attr")
    origin: str  # the distribution that installed it
    version: str
    contract: str  # the range it declares; "?" when it could not be imported
    reason: str  # the PluginError's message
    error: Exception = attrs.field(eq=False, repr=False)

    def row(self) -> dict:
        """Its row in ``infergraft plugins --json`` (the keys of a loaded plugin's, plus
        ``error``)."""
        return {"kind": "broken", "name": self.name, "plugin": self.name,
                "version": self.version, "contract": self.contract, "origin": self.origin,
                "module": self.entry_point.split(":")[0], "hooks": [], "error": self.reason}


def names_from_env(var: str) -> set[str] | None:
    raw = os.environ.get(var)
    if raw is None:
        return None
    return {n.strip() for n in raw.split(",") if n.strip()}


class EntryPointLoader:
    """``PluginManager``'s entry-point half (it provides ``info``, ``broken``,
    ``_loadable``, ``_pm``, ``register``, ``unregister`` and ``_collect``)."""

    def load_entry_points(self) -> None:
        """Load the installed plugins (group ``infergraft``). One that fails is skipped
        with a PluginWarning naming it, its entry point, what was wrong and how to silence
        it, and is kept in ``broken``; a failure blamed on a built-in still raises."""
        blocked = names_from_env("INFERGRAFT_DISABLE_PLUGINS") or set()
        allowed = names_from_env("INFERGRAFT_LOAD_PLUGINS")
        for ep in md.entry_points(group=ENTRY_POINT_GROUP):
            self._loadable.add(ep.name)
            if ep.name in blocked or (allowed is not None and ep.name not in allowed):
                continue
            dist = ep.dist
            origin = dist.metadata["Name"] if dist else "unknown distribution"
            version = dist.version if dist else ""
            plugin = None
            try:
                plugin = self._import_entry_point(ep, origin)
                self._register_entry_point(ep, plugin, origin, version)
            except PluginError as e:
                if e.plugin != ep.name:
                    raise
                self._skip(ep, origin, version, plugin, e, blocked)

    def _import_entry_point(self, ep, origin: str) -> Any:
        if ep.name in self.info:
            raise PluginError(ep.name, "load",
                              f"entry point {ep.value!r} of {origin!r} takes the name of "
                              f"the plugin already loaded from {self.info[ep.name].origin!r}; "
                              "plugin (entry point) names must be unique")
        try:
            return ep.load()
        except Exception as e:  # a broken install must name itself
            raise PluginError(ep.name, "load", f"importing {ep.value!r} failed: {e!r}") from e

    def _register_entry_point(self, ep, plugin: Any, origin: str, version: str) -> None:
        other = self._pm.get_name(plugin)
        if other is not None:
            raise PluginError(ep.name, "load",
                              f"entry point {ep.value!r} of {origin!r} points at the object "
                              f"already loaded as plugin {other!r}; one plugin, one entry point")
        self.register(plugin, name=ep.name, origin=origin, version=version)
        # call its register hooks now: one that raises, or registers a bad or taken name,
        # is this plugin's failure, found at load rather than by every later command
        try:
            self._collect()
        except PluginError:
            self.unregister(ep.name)
            raise

    def _skip(self, ep, origin: str, version: str, plugin: Any, error: PluginError,
              blocked: set[str]) -> None:
        """Remember a failed entry point in ``broken`` and warn (``plugin``: None when it
        did not import)."""
        if plugin is None:
            contract = "?"
        else:
            declared = getattr(plugin, "INFERGRAFT_CONTRACT", None)
            contract = "any (undeclared)" if declared is None else str(declared)
        self.broken[ep.name] = BrokenPlugin(ep.name, ep.value, origin, version, contract,
                                            str(error), error)
        disable = f"INFERGRAFT_DISABLE_PLUGINS={','.join(sorted(blocked | {ep.name}))}"
        if ep.name in self.info:  # the name is taken: blocking it blocks the loaded one too
            silence = (f"to silence this warning, uninstall {origin!r} or rename its entry "
                       f"point ({disable} would also block the plugin loaded from "
                       f"{self.info[ep.name].origin!r})")
        else:
            silence = f"set {disable} to silence this warning"
        why = str(error).removeprefix(f"plugin {error.plugin!r} failed in hook {error.hook!r}: ")
        warnings.warn(f"skipped installed plugin {ep.name!r} (entry point '{ep.name} = "
                      f"{ep.value}' of {origin!r}), which failed in hook {error.hook!r}: "
                      f"{why}; {silence}", PluginWarning, stacklevel=4)

    def skipped_error(self, name: str) -> UnknownPluginError | None:
        """The error for a build that names ``name``, when that plugin was skipped at
        load (None when it was not): it says so and why."""
        broken = self.broken.get(name)
        if broken is None:
            return None
        err = UnknownPluginError(f"plugin {name!r} (entry point '{name} = "
                                 f"{broken.entry_point}' of {broken.origin!r}) was skipped at "
                                 f"load, so nothing it registers can be selected: "
                                 f"{broken.reason}")
        err.__cause__ = broken.error
        return err
