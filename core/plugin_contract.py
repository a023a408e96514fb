"""A plugin's ``INFERGRAFT_CONTRACT`` (a PEP 440 range) checked against the contract
version this infergraft provides (``hookspecs.CONTRACT_VERSION``)."""
from __future__ import annotations

from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet

from . import hookspecs
from .errors import PluginError


def check_contract(name: str, plugin: Any, origin: str) -> str:
    """The contract range the plugin declares (``INFERGRAFT_CONTRACT``), checked against
    ours; undeclared means "any" (built-ins are always on the current contract)."""
    current = hookspecs.CONTRACT_VERSION
    declared = getattr(plugin, "INFERGRAFT_CONTRACT", None)
    if declared is None:
        return f"=={current}" if origin == "built-in" else "any (undeclared)"
    where = "" if origin in ("built-in", "in-process") else f" (from distribution {origin!r})"
    try:
        ok = SpecifierSet(str(declared)).contains(str(current))
    except InvalidSpecifier:
        raise PluginError(name, "load",
                          f"plugin{where} declares INFERGRAFT_CONTRACT = {declared!r}, which is "
                          f"not a PEP 440 version range; write e.g. '>={current},<{current + 1}'"
                          ) from None
    if not ok:
        raise PluginError(name, "load",
                          f"plugin{where} supports hook contract {declared}, but this infergraft "
                          f"provides contract version {current}; install a plugin release "
                          f"whose INFERGRAFT_CONTRACT includes {current}, or an infergraft "
                          f"that matches {declared}")
    return str(declared)
