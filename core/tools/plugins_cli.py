"""``infergraft plugins``: every registered plugin object (kind, name, plugin, version,
contract range, origin), then each policy with the architectures and model types that
make ``build`` and ``plan`` pick it; ``--json`` for all of it as rows."""
from __future__ import annotations

import json

from ..plugin_manager import get_plugin_manager


def plugin_rows(pm=None) -> list[dict]:
    """One row per registered object (kind, name) and per plugin that registers none
    (kind "hooks", e.g. a prepare_plan-only plugin), with where it came from."""
    pm = pm or get_plugin_manager()
    rows, seen = [], set()
    for kind, reg in pm.registries().items():
        for name in reg.names():
            seen.add(reg.origin(name))
            rows.append(_row(pm, kind, name, reg.origin(name)))
    rows += [_row(pm, "hooks", p, p) for p in pm.info if p not in seen]
    rows += [b.row() for b in pm.broken.values()]  # skipped at load, with why
    return rows


def _row(pm, kind: str, name: str, plugin: str) -> dict:
    info = pm.info[plugin]
    row = {"kind": kind, "name": name, "plugin": plugin, "version": info.version,
           "contract": info.contract, "origin": info.origin, "module": info.module,
           "hooks": pm.hook_names(plugin)}
    if kind == "policy":  # what build and plan pick it for (core/selection.py)
        policy = pm.policies().get(name)
        row.update(architectures=list(policy.architectures), model_types=list(policy.model_types))
    return row


def run(args) -> int:
    rows = plugin_rows()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    cols = ("kind", "name", "plugin", "version", "contract", "origin")
    widths = {c: max([len(c)] + [len(str(r[c])) for r in rows]) for c in cols}
    print("  ".join(c.upper().ljust(widths[c]) for c in cols).rstrip())
    for r in rows:
        print("  ".join(str(r[c]).ljust(widths[c]) for c in cols).rstrip())
    if not rows:
        print("(no plugins registered)")
    policies = [r for r in rows if r["kind"] == "policy"]
    if policies:  # what each policy is picked for, from config.json's architectures / model_type
        width = max(len("POLICY"), *(len(r["name"]) for r in policies))
        print(f"\n{'POLICY'.ljust(width)}  ARCHITECTURES (MODEL TYPES)")
        for r in policies:
            print(f"{r['name'].ljust(width)}  {', '.join(r['architectures']) or '-'} "
                  f"({', '.join(r['model_types']) or '-'})")
    for r in rows:  # why each skipped plugin was skipped: the table has no room for it
        if r["kind"] == "broken":
            print(f"\n{r['name']}: {r['error']}")
    return 0
