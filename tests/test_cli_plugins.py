"""``infergraft plugins``: kind, name, version, contract range and origin of each plugin."""
import json

import pytest
from test_broken_entry_points import entry_point_installer, future_module

from infergraft.core.cli import main
from infergraft.core.hookspecs import CONTRACT_VERSION, hookimpl
from infergraft.core.plugin_manager import PluginWarning, _own_version

KEYS = {"kind", "name", "plugin", "version", "contract", "origin", "module", "hooks"}


def rows_from_json(capsys):
    assert main(["plugins", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_lists_built_ins_and_the_installed_contrib_plugin(capsys):
    rows = rows_from_json(capsys)
    assert all(set(r) == KEYS | ({"architectures", "model_types"} if r["kind"] == "policy"
                                 else set()) for r in rows)
    by = {(r["kind"], r["name"]): r for r in rows}
    llama = by["policy", "llama"]
    assert (llama["plugin"], llama["origin"], llama["version"], llama["contract"]) == \
        ("llama", "built-in", _own_version(), f"=={CONTRACT_VERSION}")
    assert llama["hooks"] == ["infergraft_register_policies"]
    assert by["cache backend", "contiguous"]["origin"] == "built-in"
    assert by["planner", "single"]["module"] == "infergraft.plugins.single_device"
    qwen2 = by["policy", "qwen2"]
    assert (qwen2["origin"], qwen2["version"], qwen2["contract"], qwen2["module"]) == \
        ("infergraft-qwen", "0.2.0", ">=1,<2", "infergraft_qwen.qwen2")
    assert {r["kind"] for r in rows} >= {"policy", "cache backend", "planner"}


def test_each_policy_is_listed_with_the_architectures_it_is_picked_for(capsys):
    by = {r["name"]: r for r in rows_from_json(capsys) if r["kind"] == "policy"}
    assert (by["phi3"]["architectures"], by["phi3"]["model_types"]) == \
        (["Phi3ForCausalLM"], ["phi3"])
    assert by["qwen3"]["architectures"] == ["Qwen3ForCausalLM"]  # an installed plugin's too
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    section = out[out.index("\nPOLICY"):].splitlines()[1:]
    assert section[0].split() == ["POLICY", "ARCHITECTURES", "(MODEL", "TYPES)"]
    lines = {line.split()[0]: line.split()[1:] for line in section[1:] if line.strip()}
    assert lines["phi3"] == ["Phi3ForCausalLM", "(phi3)"]
    assert lines["llama"] == ["LlamaForCausalLM", "(llama)"]
    assert set(lines) == set(by)


def test_table_has_one_aligned_line_per_plugin_object(capsys):
    assert main(["plugins"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["KIND", "NAME", "PLUGIN", "VERSION", "CONTRACT", "ORIGIN"]
    qwen2 = next(line for line in lines if " qwen2 " in line)
    assert qwen2.split()[-3:] == ["0.2.0", ">=1,<2", "infergraft-qwen"]
    start = lines[0].index("ORIGIN")
    assert qwen2[start:].strip() == "infergraft-qwen"  # columns line up


def test_inline_and_hook_only_plugins_are_listed(capsys, infergraft_plugin_manager):
    class Tuner:
        INFERGRAFT_CONTRACT = ">=1"

        @hookimpl
        def infergraft_prepare_plan(self, plan, spec):
            return None

    infergraft_plugin_manager.register(Tuner(), name="tuner", version="2.3")
    row = next(r for r in rows_from_json(capsys) if r["plugin"] == "tuner")
    assert (row["kind"], row["name"], row["origin"], row["version"], row["contract"]) == \
        ("hooks", "tuner", "in-process", "2.3", ">=1")
    assert row["hooks"] == ["infergraft_prepare_plan"]


def test_a_broken_plugin_is_reported_not_a_traceback(capsys, infergraft_plugin_manager):
    class Broken:
        @hookimpl
        def infergraft_register_quantizers(self, register):
            raise ValueError("bad config")

    infergraft_plugin_manager.register(Broken(), name="broken-quant")
    assert main(["plugins", "--json"]) == 2
    err = capsys.readouterr().err
    assert "plugin 'broken-quant' failed in hook 'infergraft_register_quantizers'" in err


@pytest.fixture
def fake_entry_points(monkeypatch, infergraft_reset_plugins):
    return entry_point_installer(monkeypatch, infergraft_reset_plugins)


def test_a_broken_installed_plugin_does_not_stop_the_command(capsys, fake_entry_points):
    fake_entry_points(future=future_module())  # its contract range excludes ours
    with pytest.warns(PluginWarning, match="skipped installed plugin 'future'"):
        rows = rows_from_json(capsys)
    assert {("policy", "llama"), ("cache backend", "contiguous"), ("planner", "single")} <= \
        {(r["kind"], r["name"]) for r in rows}
    assert main(["plugins"]) == 0 and "llama" in capsys.readouterr().out


def test_a_broken_installed_plugin_is_listed_with_why(capsys, fake_entry_points):
    fake_entry_points(future=future_module())
    with pytest.warns(PluginWarning):
        rows = rows_from_json(capsys)
    row = next(r for r in rows if r["kind"] == "broken")
    assert set(row) == KEYS | {"error"} and row["hooks"] == []
    assert (row["name"], row["plugin"], row["contract"], row["origin"], row["module"]) == \
        ("future", "future", f">={CONTRACT_VERSION + 1}", "unknown distribution", "future_plugin")
    assert "supports hook contract" in row["error"]
    assert main(["plugins"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("broken"))
    assert line.split()[:3] == ["broken", "future", "future"]
