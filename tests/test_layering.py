"""The import structure: no cycles among infergraft's modules, contracts above
implementations, our own code on the new paths of moved modules.

Imports are read with ``ast`` from the source (top-level and inside functions alike),
so a lazy import that closes a cycle counts as much as one at the top.
"""
import ast
from pathlib import Path

import pytest

from infergraft.core._moved import MOVED

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"core": "infergraft.core", "plugins": "infergraft.plugins",
            "policies": "infergraft.policies", "kernels": "infergraft.kernels"}
CONTRACTS = {f"infergraft.core.{m}" for m in
             ("hookspecs", "policy", "spec", "cache", "quant", "plan", "errors", "units")}
IMPLEMENTATIONS = ("infergraft.core.build", "infergraft.core.engine", "infergraft.core.memory",
                   "infergraft.core.runner", "infergraft.core.loading",
                   "infergraft.core.distributed", "infergraft.core.tools", "infergraft.plugins.")


def module_files() -> dict[str, Path]:
    found = {}
    for folder, package in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


MODULES = module_files()


def imports_of(name: str, path: Path) -> set[str]:
    """The infergraft modules ``name`` imports: ``from pkg import sub`` counts as the
    submodule where one exists, else as the package."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.add(sub if sub in MODULES or sub in MOVED else base)
    return {m for m in out if m.startswith("infergraft.")}


GRAPH = {name: imports_of(name, path) for name, path in MODULES.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_reader_sees_the_known_edges():
    assert "infergraft.core.runner.model" in GRAPH["infergraft.core.build"]
    assert "infergraft.core.errors" in GRAPH["infergraft.kernels.dispatch"]
    assert "infergraft.core.cuda_graph" not in MODULES and len(MODULES) > 60


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    assert cycles(GRAPH) == []


@pytest.mark.parametrize("contract", sorted(CONTRACTS))
def test_a_contract_imports_no_implementation(contract):
    assert contract in GRAPH, contract
    bad = sorted(m for m in GRAPH[contract] if m.startswith(IMPLEMENTATIONS))
    assert bad == [], f"{contract} imports implementations {bad}"


def test_the_kernels_import_nothing_of_the_core_but_its_contracts():
    """Nothing runs upward: a kernel raises the core's errors and reads its spec, no more.
    Their micro-benchmarks, which time them the engine's way, are tools (core/tools/)."""
    bridge = "infergraft.kernels.bench"  # the old path of core/tools/kernel_bench/, one release
    above = {name: sorted(m for m in deps if m.startswith("infergraft.core") and m not in CONTRACTS)
             for name, deps in GRAPH.items()
             if name.startswith("infergraft.kernels.") and name != bridge}
    assert {name: deps for name, deps in above.items() if deps} == {}


def test_our_code_imports_no_moved_path():
    bad = {name: sorted(deps & set(MOVED)) for name, deps in GRAPH.items() if deps & set(MOVED)}
    assert bad == {}


def test_no_module_is_longer_than_300_lines():
    long = {name: n for name, path in MODULES.items()
            if (n := len(path.read_text().splitlines())) > 300}
    assert long == {}


def test_the_benchmarks_page_stays_a_results_page():
    page = ROOT / "docs" / "BENCHMARKS.md"
    assert len(page.read_text().splitlines()) <= 200, "history goes to docs/bench/HISTORY.md"


def test_every_sub_package_is_listed_for_a_non_editable_install():
    """setuptools installs only the packages pyproject.toml lists: a folder of modules left
    out imports in the editable checkout and is missing from the wheel (a namespace
    package, with no __init__.py, as much as a regular one)."""
    import tomllib

    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(tool["packages"])
    found = set()
    for package, folder in tool["package-dir"].items():
        for module in (ROOT / folder).rglob("*.py"):
            parts = module.parent.relative_to(ROOT / folder).parts
            found.add(".".join((package, *parts)))
    assert found - listed == set(), f"add to pyproject.toml's packages: {sorted(found - listed)}"
