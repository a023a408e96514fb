"""Old import paths keep working for one release: a third party's plugin written against
``infergraft.core.cuda_graph`` or ``infergraft.core.plugins`` still loads, warned, and gets
the very module at its new home; every dotted path the plugin guide names imports."""
import importlib
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from infergraft.core._moved import MOVED, MOVED_NAMES

DOCS = Path(__file__).resolve().parents[1] / "docs" / "plugins.md"


@pytest.mark.parametrize("old, new", sorted(MOVED.items()))
def test_an_old_module_path_warns_and_is_the_new_module(old, new):
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=re.escape(f"{old} moved to {new}")):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert module.__spec__.name == new  # its own spec, not the alias's


@pytest.mark.parametrize("module, name", [(m, n) for m, names in sorted(MOVED_NAMES.items())
                                          for n in sorted(names)])
def test_a_name_that_left_a_module_still_resolves_there(module, name):
    with pytest.warns(DeprecationWarning, match=f"{module}.{name} moved"):
        value = getattr(importlib.import_module(module), name)
    assert value is getattr(importlib.import_module(MOVED_NAMES[module][name]), name)
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        getattr(importlib.import_module(module), "nonexistent")


def test_the_old_from_import_form_works():
    sys.modules.pop("infergraft.core.parallel", None)
    with pytest.warns(DeprecationWarning):
        from infergraft.core.parallel import runtime_style
    from infergraft.core.distributed.ranks import runtime_style as new
    assert runtime_style is new


def test_an_old_path_still_runs_as_a_command():
    # the kernels' micro-benchmarks moved to core/tools/kernel_bench/; `python -m` at the old
    # path runs the new module, as __main__, and says where it went
    out = subprocess.run([sys.executable, "-m", "infergraft.kernels.bench.int4", "--help"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: int4.py") and "--sweep" in out.stdout
    assert ("FutureWarning: infergraft.kernels.bench.int4 moved to "
            "infergraft.core.tools.kernel_bench.int4") in out.stderr


def test_every_path_the_plugin_guide_names_imports():
    named = set(re.findall(r"`(?:infergraft\.)?(core(?:\.\w+)+)", DOCS.read_text()))
    assert len(named) > 10
    for dotted in sorted(named):
        parts = ("infergraft." + dotted).split(".")
        # the longest importable prefix, then attributes
        for cut in range(len(parts), 1, -1):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("error", DeprecationWarning)  # docs use new paths
                    obj = importlib.import_module(".".join(parts[:cut]))
                break
            except ModuleNotFoundError:
                continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)  # AttributeError names what the guide got wrong


def test_an_editable_install_older_than_a_namespace_package_says_to_reinstall(monkeypatch):
    from infergraft.core import _moved

    def not_found(name, *args):
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    monkeypatch.setattr(_moved.importlib, "import_module", not_found)
    with pytest.raises(ImportError, match=r"infergraft.kernels is not found.*pip install -e \."):
        _moved.install()
