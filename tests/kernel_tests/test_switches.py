"""The kernel switch registry (kernels/switches.py): parsing, errors, the moment each switch
is read, snapshots for result files, and the docs table held to the registry."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from infergraft.kernels import dispatch, switches
from infergraft.kernels import fused_linear, gemv, greedy, linear
from infergraft.kernels._triton import pdl_launch

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "kernels.md"
BOOLS = [n for n, s in switches.SWITCHES.items() if s.kind == switches.BOOL]
ROWS = [n for n, s in switches.SWITCHES.items() if s.kind == switches.ROWS]


def _docs_table() -> list[tuple[str, ...]]:
    """The first table under ``## Switches`` in docs/kernels.md, as rows of cells."""
    section = DOCS.read_text().split("\n## Switches\n", 1)[1].split("\n## ", 1)[0]
    rows = [tuple(c.strip() for c in line.strip().strip("|").split("|"))
            for line in section.splitlines() if line.startswith("|")]
    return [r for r in rows if not all(set(c) <= {"-", ":"} for c in r)]


def test_docs_table_matches_the_registry():
    header, *rows = _docs_table()
    regenerate = f"paste this table into {DOCS.name}:\n{switches.markdown_table()}"
    assert header == switches.TABLE_HEADER, regenerate
    assert [r[0] for r in rows] == [f"`{n}`" for n in switches.SWITCHES], regenerate
    for got, want in zip(rows, switches.table_rows()):
        assert got == want, f"{got[0]}: docs {got} != registry {want}; {regenerate}"


def test_every_switch_is_declared_sensibly():
    for name, s in switches.SWITCHES.items():
        assert name.startswith("INFERGRAFT_") and s.name == name
        assert s.kind in (switches.BOOL, switches.ROWS, switches.AUTO, switches.CHOICE)
        assert bool(s.choices) == (s.kind == switches.CHOICE), name
        assert s.read_at in switches.READ_AT
        assert (s.constant is not None) == (s.read_at == "import"), name
        s.parse(s.default)  # the default parses
    assert switches.default("INFERGRAFT_FUSE_MAX_ROWS") == 32
    assert switches.default("INFERGRAFT_SKINNY_MAX_M") == 16
    assert switches.default("INFERGRAFT_PDL") is True
    assert switches.default("INFERGRAFT_QUANT_MMA") == "auto"


@pytest.mark.parametrize("name", ROWS)
def test_rows_follow_the_environment(monkeypatch, name):
    monkeypatch.setenv(name, "7")
    assert switches.value(name) == 7
    monkeypatch.setenv(name, " 0 ")
    assert switches.value(name) == 0
    monkeypatch.setenv(name, "")  # empty: as unset
    assert switches.value(name) == switches.default(name)
    monkeypatch.delenv(name)
    assert switches.value(name) == switches.default(name)


@pytest.mark.parametrize("name", BOOLS)
def test_bools_follow_the_environment(monkeypatch, name):
    monkeypatch.setenv(name, "0")
    assert switches.value(name) is False
    monkeypatch.setenv(name, "1")
    assert switches.value(name) is True


def test_a_bool_or_auto_takes_0_1_and_auto_and_refuses_the_rest(monkeypatch):
    for raw, want in (("0", False), ("1", True), ("auto", "auto"), (" auto ", "auto")):
        monkeypatch.setenv("INFERGRAFT_QUANT_MMA", raw)
        assert switches.value("INFERGRAFT_QUANT_MMA") == want and \
            type(switches.value("INFERGRAFT_QUANT_MMA")) is type(want), raw
    for raw in ("on", "AUTO", "2", "true"):
        monkeypatch.setenv("INFERGRAFT_QUANT_MMA", raw)
        with pytest.raises(switches.SwitchError,
                           match=re.escape(f"INFERGRAFT_QUANT_MMA={raw!r} is not 0, 1 or auto")):
            switches.value("INFERGRAFT_QUANT_MMA")


def test_a_choice_takes_its_names_and_refuses_the_rest(monkeypatch):
    for raw, want in (("cvt", "cvt"), (" words16 ", "words16"), ("", "cvt")):
        monkeypatch.setenv("INFERGRAFT_KV8_WIDEN", raw)
        assert switches.value("INFERGRAFT_KV8_WIDEN") == want, raw
    for raw in ("CVT", "bits", "1"):
        monkeypatch.setenv("INFERGRAFT_KV8_WIDEN", raw)
        with pytest.raises(switches.SwitchError, match=re.escape(
                f"INFERGRAFT_KV8_WIDEN={raw!r} is not one of cvt, f16, words, words16 "
                "(default cvt)")):
            switches.value("INFERGRAFT_KV8_WIDEN")


@pytest.mark.parametrize("raw", ["abc", "-1", "1.5", "16 rows", "+4", "²"])
def test_a_bad_row_count_names_switch_value_and_what_is_accepted(monkeypatch, raw):
    monkeypatch.setenv("INFERGRAFT_FUSE_MAX_ROWS", raw)
    with pytest.raises(switches.SwitchError) as err:
        switches.value("INFERGRAFT_FUSE_MAX_ROWS")
    assert str(err.value).startswith(f"INFERGRAFT_FUSE_MAX_ROWS={raw!r} is not an integer >= 0")


@pytest.mark.parametrize("raw", ["true", "yes", "2", "on", "00"])
def test_a_bad_bool_names_switch_value_and_what_is_accepted(monkeypatch, raw):
    monkeypatch.setenv("INFERGRAFT_GEMV", raw)
    with pytest.raises(ValueError, match=re.escape(f"INFERGRAFT_GEMV={raw!r} is not 0 or 1")):
        switches.value("INFERGRAFT_GEMV")


def test_an_unknown_switch_is_refused_with_the_known_ones():
    with pytest.raises(switches.SwitchError, match="unknown kernel switch 'INFERGRAFT_FUZE'.*"
                                                   "INFERGRAFT_FUSE_MAX_ROWS"):
        switches.value("INFERGRAFT_FUZE")


def test_snapshot_has_every_switch_with_its_type():
    snap = switches.snapshot()
    assert list(snap) == list(switches.SWITCHES)
    for name, v in snap.items():
        kind = switches.SWITCHES[name].kind
        want = {switches.BOOL: (bool,), switches.ROWS: (int,), switches.AUTO: (bool, str),
                switches.CHOICE: (str,)}[kind]
        assert type(v) in want, name


def test_snapshot_reports_what_import_time_switches_took(monkeypatch):
    # the env changed after import: value() follows it, the kernels (and snapshot) do not
    monkeypatch.setenv("INFERGRAFT_SWAP", "0" if linear.SWAP_TILES else "1")
    monkeypatch.setenv("INFERGRAFT_SKINNY_MAX_M", str(linear.MAX_SKINNY_M + 5))
    assert switches.value("INFERGRAFT_SWAP") is not linear.SWAP_TILES
    snap = switches.snapshot()
    assert snap["INFERGRAFT_SWAP"] is linear.SWAP_TILES
    assert snap["INFERGRAFT_SKINNY_MAX_M"] == linear.MAX_SKINNY_M
    # a test that patches a module constant sees it in the snapshot
    monkeypatch.setattr(fused_linear, "FUSE_MAX_ROWS", 3)
    assert switches.snapshot()["INFERGRAFT_FUSE_MAX_ROWS"] == 3


def test_build_and_launch_switches_are_read_when_used(monkeypatch):
    monkeypatch.setenv("INFERGRAFT_FUSE", "0")
    assert switches.snapshot()["INFERGRAFT_FUSE"] is False
    assert dispatch.fuse_max_rows("triton") == 0
    monkeypatch.setenv("INFERGRAFT_FUSE", "1")
    assert dispatch.fuse_max_rows("triton") == fused_linear.FUSE_MAX_ROWS
    # pdl_launch reads INFERGRAFT_PDL at each CUDA launch, before it asks the device
    cuda = torch.device("cuda", 0)
    monkeypatch.setenv("INFERGRAFT_PDL", "0")
    assert pdl_launch(cuda) == {"PDL": False}
    monkeypatch.setenv("INFERGRAFT_PDL", "off")
    with pytest.raises(switches.SwitchError, match="INFERGRAFT_PDL='off'"):
        pdl_launch(cuda)
    assert pdl_launch(torch.device("cpu")) == {"PDL": False}  # not CUDA: never read


def test_results_key_follows_only_switches_that_change_results(monkeypatch):
    key = switches.results_key()
    monkeypatch.setattr(linear, "LATE_PDL_RELEASE", not linear.LATE_PDL_RELEASE)
    monkeypatch.setattr(greedy, "SPLIT_ON", not greedy.SPLIT_ON)
    assert switches.results_key() == key  # schedule only
    monkeypatch.setattr(gemv, "GEMV_ON", not gemv.GEMV_ON)
    assert switches.results_key() != key


def test_no_kernel_module_reads_a_switch_from_the_environment_itself():
    for path in sorted((ROOT / "kernels").rglob("*.py")):
        if path.name == "switches.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            assert not re.search(r"(environ|getenv).*INFERGRAFT_", line), \
                f"{path.relative_to(ROOT)}:{n} reads a switch directly; use switches.value"


def _python(code: str, **env) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("INFERGRAFT_")}
    return subprocess.run([sys.executable, "-c", code], env={**clean, **env}, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_the_registry_needs_neither_torch_nor_triton():
    path = str(ROOT / "kernels" / "switches.py")
    code = ("import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location('sw', {path!r})\n"
            "sw = importlib.util.module_from_spec(spec); sys.modules['sw'] = sw\n"
            "spec.loader.exec_module(sw)\n"
            "print(sorted(sw.snapshot()) == sorted(sw.SWITCHES), 'torch' in sys.modules,"
            " 'triton' in sys.modules)")
    out = _python(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "False", "False"]


def test_import_time_switches_are_taken_at_import():
    # every import-time switch off its default, in a fresh process: each module constant
    # takes it; a bad value fails the import, naming the switch
    env = {n: "0" if s.kind == switches.BOOL else "5"
           for n, s in switches.SWITCHES.items() if s.read_at == "import"}
    code = ("import importlib\nfrom infergraft.kernels import switches\n"
            "for n, s in switches.SWITCHES.items():\n"
            "    if s.constant:\n"
            "        m, a = s.constant.rsplit('.', 1)\n"
            "        print(n, getattr(importlib.import_module('infergraft.kernels.' + m), a))")
    out = _python(code, TRITON_INTERPRET="1", **env)
    assert out.returncode == 0, out.stderr
    taken = dict(line.split() for line in out.stdout.splitlines())
    assert taken == {n: "False" if v == "0" else v for n, v in env.items()}
    bad = _python("import infergraft.kernels.linear", TRITON_INTERPRET="1",
                  INFERGRAFT_SKINNY_MAX_M="lots")
    assert bad.returncode != 0 and "INFERGRAFT_SKINNY_MAX_M='lots' is not an integer" in bad.stderr
