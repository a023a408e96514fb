"""Meta-tests: every hookspec is documented, tested, reachable through the facade, and
every plugin kind has a conformance kit."""
import ast
import inspect
import re
from pathlib import Path

import pytest

from infergraft.core import hookspecs
from infergraft.core.plugin_manager import _KINDS, PluginManager
from infergraft.core.testing import (cache_kit, layer_kit, logits_kit, planner_kit, policy_kit,
                                     proposer_kit, quant_kit)

ROOT = Path(__file__).resolve().parents[1]
DOCS = (ROOT / "docs" / "plugins.md").read_text()
SPECS = {n: f for n, f in vars(hookspecs).items()
         if callable(f) and hasattr(f, f"{hookspecs.PROJECT}_spec")}


def test_the_contract_has_the_hooks_we_expect():
    # guards the scan below: if this found nothing, every other test here would pass vacuously
    assert {"infergraft_register_policies", "infergraft_prepare_plan"} <= set(SPECS)
    assert len(SPECS) >= 5


def _test_functions():
    """(file, test name, source) of every test function outside this file."""
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        if path.name == Path(__file__).name:
            continue
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name.startswith(("test_", "Test")):
                yield path.name, node.name, ast.get_source_segment(text, node)


@pytest.mark.parametrize("hook", sorted(SPECS))
def test_every_hookspec_is_named_by_a_test(hook):
    # the hook's name inside a test's own body (or its test class), not just the file
    hits = [f"{f}::{t}" for f, t, src in _test_functions() if hook in src]
    assert hits, f"no test function or test class in tests/ names hook {hook!r}"


@pytest.mark.parametrize("hook", sorted(SPECS))
def test_every_hookspec_is_documented_with_its_signature(hook):
    signature = f"{hook}{inspect.signature(SPECS[hook])}"
    assert f"### `{signature}`" in DOCS, f"docs/plugins.md lacks a section for {signature}"
    assert inspect.getdoc(SPECS[hook]), f"hookspec {hook} has no docstring"


def test_docs_name_no_hook_that_does_not_exist():
    mentioned = set(re.findall(r"\binfergraft_[a-z_]+(?=\()", DOCS))
    assert mentioned and mentioned <= set(SPECS), mentioned - set(SPECS)


@pytest.mark.parametrize("hook", sorted(SPECS))
def test_every_hookspec_has_a_facade(hook):
    register_hooks = {h for h, _ in _KINDS.values()}
    facade = hook.removeprefix("infergraft_")
    assert hook in register_hooks or callable(getattr(PluginManager, facade, None)), \
        f"hookspec {hook} has neither a registry kind nor PluginManager.{facade}()"


def test_every_plugin_kind_has_an_aggregate_conformance_class():
    kits = {"policy": policy_kit.PolicyTests, "cache backend": cache_kit.CacheBackendTests,
            "quantizer": quant_kit.QuantizerTests, "planner": planner_kit.PlannerTests,
            **{kind: layer_kit.LayerTests for kind in ("attention", "mlp", "norm")},
            "logits processor": logits_kit.LogitsProcessorTests,
            "proposer": proposer_kit.ProposerTests}
    assert set(kits) == set(_KINDS)
    for kind, cls in kits.items():
        tests = [n for n in dir(cls) if n.startswith("test_")]
        assert len(tests) >= 3, (kind, tests)
        assert f"`{cls.__module__.rsplit('.', 1)[1]}.{cls.__name__}`" in DOCS, cls


def test_docs_code_blocks_are_valid():
    import tomllib

    blocks = re.findall(r"```(python|toml)\n(.*?)```", DOCS, re.S)
    assert {lang for lang, _ in blocks} == {"python", "toml"}
    for lang, code in blocks:
        if lang == "python":
            compile(code, "docs/plugins.md", "exec")
        else:
            eps = tomllib.loads(code)["project"]["entry-points"]["infergraft"]
            package = ROOT / "contrib" / "infergraft-qwen" / "pyproject.toml"  # the worked example
            assert eps == tomllib.loads(package.read_text())["project"]["entry-points"]["infergraft"]
