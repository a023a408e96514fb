"""Every file path (``core/runner/model.py``) and dotted name (``core.runner.model.
DecoderModel``) that the docs, docstrings and comments name exists, so that a move leaves
none behind. Read from the source, nothing imported: a dotted name resolves where its
module's file is there and each name after it is defined in that file (a class's names in
its body, an instance's attributes as ``self.x =``).

The old paths that stay importable for one release (core/_moved.py) count as missing: the
docs name the new ones. A line that says so (``moved``, ``old path``) may name an old
path, and so may the files about them."""
import ast
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "plugins", "policies", "kernels")  # infergraft.<name> is the folder <name>/
# the files about old paths, which name them (this one: as examples of what it catches)
ABOUT_OLD_PATHS = {"core/_moved.py", "tests/test_moved_paths.py", "kernels/bench/__init__.py",
                   "tests/test_named_paths.py"}
SAYS_OLD = re.compile(r"\bmoved\b|\bold (?:import )?paths?\b", re.I)
FILE_PATH = re.compile(r"(?<![\w./-])((?:core|plugins|policies|kernels|tests)/[\w./-]*\w\.py)\b")
DOTTED = re.compile(r"(?<![\w.])(?:infergraft\.)?((?:core|plugins|policies|kernels)(?:\.\w+)+)")
NOT_NAMES = {"md", "py", "json", "sh", "txt", "png", "toml", "html", "js", "jinja"}


def prose_lines():
    """(file, line number, text) of the docstrings and comments in our Python (a line in a
    triple-quoted block, or what follows a ``#``), and every line of the docs' pages (not
    docs/bench/'s history and results: they name the paths of their day)."""
    sources = [p for folder in (*PACKAGES, "tests", "contrib", "docs") for p in
               (ROOT / folder).rglob("*.py") if not any(part.startswith(".") for part in p.parts)]
    for path in sources:
        inside = False
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            quotes = line.count('"' * 3)
            if inside or quotes:
                yield path, lineno, line
            elif "#" in line:
                yield path, lineno, line[line.index("#"):]
            inside ^= quotes % 2 == 1
    for path in [*ROOT.glob("docs/*.md"), ROOT / "README.md", *ROOT.glob("contrib/*/README.md")]:
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            yield path, lineno, line


def defined_names(body, in_class: bool = False) -> dict:
    """name -> its node, for the statements of a module or class body (into if / try / with
    blocks, not into functions; a class's ``self.x = ...`` in its methods too)."""
    names = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
            if in_class:
                for sub in ast.walk(node):
                    for target in getattr(sub, "targets", [getattr(sub, "target", None)]):
                        if isinstance(target, ast.Attribute) and \
                                isinstance(target.value, ast.Name) and target.value.id == "self":
                            names.setdefault(target.attr, sub)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update({(a.asname or a.name).split(".")[0]: node for a in node.names})
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in getattr(node, "targets", [getattr(node, "target", None)]):
                names.update({n.id: node for n in ast.walk(target) if isinstance(n, ast.Name)})
        for block in ("body", "orelse", "finalbody", "handlers"):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.update(defined_names(getattr(node, block, []), in_class))
    return names


@cache
def module_names(path: Path) -> dict:
    return defined_names(ast.parse(path.read_text()).body) if path.exists() else {}


@cache
def resolves(dotted: str) -> bool:
    """``core.runner.model.DecoderModel``: the longest prefix that is a module (a file, or a
    folder: its __init__.py's names, none for a namespace package), then names in it."""
    parts = dotted.split(".")
    folder = ROOT / parts[0]
    for cut in range(len(parts), 0, -1):
        base = folder.joinpath(*parts[1:cut])
        if base.with_suffix(".py").is_file():
            names = module_names(base.with_suffix(".py"))
            break
        if base.is_dir():
            names = module_names(base / "__init__.py")
            break
    else:
        return False
    for name in parts[cut:]:
        node = names.get(name)
        if node is None:
            return False
        if not isinstance(node, ast.ClassDef):
            return True  # a function's or a value's attributes: not followed
        names = defined_names(node.body, in_class=True)
    return True


def file_exists(path: str) -> bool:
    # a contrib package's own files are named from its folder (contrib/infergraft-qwen/)
    return any((base / path).exists() for base in (ROOT, *ROOT.glob("contrib/*/")))


def missing() -> list[str]:
    found = []
    for path, lineno, line in prose_lines():
        rel = path.relative_to(ROOT).as_posix()
        if rel in ABOUT_OLD_PATHS or SAYS_OLD.search(line):
            continue
        named = [p for p in FILE_PATH.findall(line) if not file_exists(p)]
        named += [d for d in DOTTED.findall(line)
                  if d.rsplit(".", 1)[1] not in NOT_NAMES and not resolves(d)]
        found += [f"{rel}:{lineno}: {name}" for name in named]
    return found


def test_the_reader_resolves_what_exists_and_refuses_what_does_not():
    assert resolves("core.runner.model.DecoderModel.forward")  # a class's method
    assert resolves("core.build") and resolves("core.runner.model")  # re-export, module
    assert resolves("kernels.dispatch.get_ops") and resolves("core.spec.ModelSpec.num_layers")
    assert not resolves("core.model.DecoderModel")  # moved to core.runner.model
    assert not resolves("core.quant.SlotPacker")  # left core.quant, resolved there by __getattr__
    assert not resolves("kernels.get_ops")  # infergraft.kernels is a namespace package
    assert not resolves("core.runner.model.NoSuchThing")
    assert file_exists("core/runner/model.py") and not file_exists("core/model.py")


def test_every_path_and_name_the_prose_names_exists():
    assert missing() == []


@pytest.mark.parametrize("line, stale", [
    ("through ``core.weights.load_weights``", "core.weights.load_weights"),
    ("(see core/prefill_graph.py)", "core/prefill_graph.py"),
    ("``infergraft.kernels.bench.int4``", "kernels.bench.int4"),
])
def test_a_stale_name_is_caught(line, stale):
    found = FILE_PATH.findall(line) + DOTTED.findall(line)
    assert found == [stale]
    assert not (file_exists(stale) if "/" in stale else resolves(stale))
