"""``infergraft plan DIR``: exit codes (0 fits, 1 does not fit, 2 error) and the one-line
errors for config.json files that cannot be planned."""
import json
import os
import subprocess
import sys

import pytest

from infergraft.core.cli import main
from infergraft.core.testing.models import tiny_llama_config


DROP = object()  # an edit that deletes the key


def _config_dir(tmp_path, edit=None, text=None):
    """A directory holding only a config.json: tiny LLaMA's, edited by ``edit`` (keys to
    set, or DROP), or ``text`` verbatim."""
    tiny_llama_config().save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    if text is not None:
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
    elif edit:
        data = json.loads(path.read_text())
        data.update({k: v for k, v in edit.items() if v is not DROP})
        path.write_text(json.dumps({k: v for k, v in data.items() if edit.get(k) is not DROP}))
    return tmp_path


def _refused(capsys, directory, *args) -> str:
    """Plans ``directory``, checks the exit code is 2 and stderr one error line; returns it."""
    assert main(["plan", str(directory), *args]) == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in err and out == ""
    lines = [line for line in err.splitlines() if line.startswith("infergraft: error: ")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("text,why", [
    ("{not json", "it is not JSON text (Expecting property name"),
    (b"\xff\xfe\x00", "it is not JSON text ('utf-8' codec can't decode"),
    ("{}", "it has no model_type"),
    ("[]", "it holds an array ([]), not a JSON object"),
    ("5", "it holds a number (5), not a JSON object"),
    ("null", "it holds null, not a JSON object"),
    ('"llama"', "it holds a string (\"llama\"), not a JSON object"),
])
def test_a_config_json_that_is_not_an_hf_config_is_one_error_line(tmp_path, capsys, text, why):
    line = _refused(capsys, _config_dir(tmp_path, text=text))
    assert f"{tmp_path / 'config.json'} cannot be read as an HF config: {why}" in line


@pytest.mark.parametrize("edit,why", [
    ({"model_type": "nosuchmodel"}, "model_type 'nosuchmodel' is not a model type transformers"),
    ({"model_type": ["llama"]}, "model_type ['llama'] is not a model type transformers"),
    ({"model_type": DROP, "architectures": DROP}, "it has no model_type"),
    ({"num_hidden_layers": "2"}, "Field 'num_hidden_layers' expected int, got str"),
    ({"num_attention_heads": 0}, "divided by zero"),
    ({"torch_dtype": "nonsense"}, "module 'torch' has no attribute 'nonsense'"),
    ({"architectures": "LlamaForCausalLM"}, "architectures must be a list of class names"),
    # a config naming its own code: refused without asking on stdin whether to run it
    ({"model_type": "custom", "auto_map": {"AutoConfig": "custom.CustomConfig"}},
     "its auto_map names the model's own code, which infergraft never runs"),
])
def test_what_transformers_refuses_is_one_error_line_naming_the_file(tmp_path, capsys, edit,
                                                                      why):
    line = _refused(capsys, _config_dir(tmp_path, edit))
    assert f"{tmp_path / 'config.json'} cannot be read as an HF config: " in line
    assert why in line


def test_a_config_without_architectures_is_planned_by_its_model_type(tmp_path, capsys):
    assert main(["plan", str(_config_dir(tmp_path, {"architectures": DROP})), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4


def test_the_policy_is_picked_from_config_json_and_shown(tmp_path, capsys):
    from infergraft.core.testing.models import tiny_phi3_config

    tiny_phi3_config().save_pretrained(tmp_path)
    assert main(["plan", str(tmp_path)]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows[1].split() == ["policy", "phi3", "(for", "Phi3ForCausalLM)"]
    assert main(["plan", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["policy"] == "phi3"
    assert main(["plan", str(_config_dir(tmp_path / "llama", {"architectures": DROP})),
                 "--json"]) == 0  # no architectures: its model_type picks
    assert json.loads(capsys.readouterr().out)["policy"] == "llama"


def test_an_unknown_architecture_is_one_line_naming_the_closest_supported(tmp_path, capsys):
    edit = {"architectures": ["Llama4ForCausalLM"], "model_type": "llama4_text"}
    line = _refused(capsys, _config_dir(tmp_path, edit))
    assert "no registered policy supports Llama4ForCausalLM (closest supported by name: " \
           "LlamaForCausalLM (llama)" in line
    assert "); supported architectures: GPT2LMHeadModel, " in line


@pytest.mark.parametrize("key,value,field", [
    ("num_hidden_layers", -1, "num_layers"), ("num_hidden_layers", 0, "num_layers"),
    ("num_attention_heads", -4, "num_heads"), ("num_key_value_heads", 0, "num_kv_heads"),
    ("hidden_size", -64, "hidden_size"), ("intermediate_size", 0, "intermediate_size"),
    ("vocab_size", 0, "vocab_size"), ("head_dim", 0, "head_dim"), ("head_dim", -16, "head_dim"),
    ("max_position_embeddings", 0, "max_position"),
])
def test_non_positive_sizes_are_refused_naming_the_field(tmp_path, capsys, key, value, field):
    # no special token ids: transformers would warn they lie outside a vocabulary of 0
    edit = {key: value, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    line = _refused(capsys, _config_dir(tmp_path, edit), "--device-memory", "1GiB")
    assert f"LlamaForCausalLM: {field} must be an integer >= 1, got {value}" in line
    assert key in line  # the config.json name beside ModelSpec's


def test_kv_heads_that_do_not_divide_the_heads_are_one_error_line(tmp_path, capsys):
    line = _refused(capsys, _config_dir(tmp_path, {"num_key_value_heads": 3}))
    assert "num_heads=4 is not a multiple of num_kv_heads=3" in line
    assert "accepted: num_key_value_heads dividing num_attention_heads" in line


def test_exit_status_says_whether_the_plan_fits(tmp_path, capsys):
    directory = str(_config_dir(tmp_path))
    for fmt in ([], ["--json"]):
        assert main(["plan", directory, "--device-memory", "1GiB", *fmt]) == 0
        assert capsys.readouterr().out
        # tiny LLaMA's weights alone are ~1 MiB: the plan is printed, and exit 1
        assert main(["plan", directory, "--device-memory", "64KiB", *fmt]) == 1
        out, err = capsys.readouterr()
        assert err == ""
        if fmt:
            assert json.loads(out)["fits"] is False
        else:
            assert dict(line.split("  ", 1) for line in out.splitlines())["fits"].strip() == "NO"
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    plan_help = capsys.readouterr().out
    assert "exit status:" in plan_help
    assert "0  the plan fits" in plan_help and "1  it does not fit" in plan_help
    assert "2  error" in plan_help


def _plan_in_a_process(directory) -> subprocess.CompletedProcess:
    # a fresh process: transformers prints each deprecation warning once per process
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "warning"}
    return subprocess.run([sys.executable, "-m", "infergraft.core.cli", "plan", str(directory),
                           "--json", "--device-memory", "1GiB"], capture_output=True,
                          text=True, env=env, timeout=300)


def test_no_torch_dtype_deprecation_warning_and_old_configs_keep_their_dtype(tmp_path):
    new = _config_dir(tmp_path / "new", {"dtype": None, "torch_dtype": None})
    done = _plan_in_a_process(new)
    assert done.returncode == 0, done.stderr
    assert "torch_dtype" not in done.stderr and json.loads(done.stdout)["dtype"] == "float32"
    old = _config_dir(tmp_path / "old", {"dtype": None, "torch_dtype": "bfloat16"})
    done = _plan_in_a_process(old)
    assert done.returncode == 0, done.stderr
    assert "torch_dtype" not in done.stderr and json.loads(done.stdout)["dtype"] == "bfloat16"


def test_stored_dtype_reads_dtype_then_a_plain_torch_dtype():
    import types

    import torch

    from infergraft.core.loading.source import stored_dtype

    assert stored_dtype(tiny_llama_config(dtype="float16")) == torch.float16
    assert stored_dtype(tiny_llama_config()) is None  # the warning property is not read
    # transformers 4 configs and stand-ins: torch_dtype a plain attribute
    assert stored_dtype(types.SimpleNamespace(torch_dtype="bfloat16")) == torch.bfloat16
    assert stored_dtype(types.SimpleNamespace(dtype=None, torch_dtype=torch.float16)) == \
        torch.float16
    assert stored_dtype(types.SimpleNamespace(dtype="no-such-dtype")) is None


def test_the_exit_status_speaks_for_the_cache_asked_for(tmp_path, capsys):
    """A budget too small for max_batch_size x max_seq_len reserved (contiguous: exit 1)
    whose paged pool still holds a max_seq_len sequence (--cache paged, or a config naming
    the paged plugin: exit 0); a budget below one sequence: 1 for both."""
    directory = str(_config_dir(tmp_path))
    args = ["plan", directory, "--max-seq-len", "512", "--max-batch-size", "512",
            "--device-memory", "64MiB"]
    assert main(args) == 1
    rows = dict(line.split("  ", 1) for line in capsys.readouterr().out.splitlines())
    assert rows["fits"].strip() == "NO" and rows["fits (paged cache)"].strip() == "yes"
    assert main([*args, "--cache", "paged", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] is False and out["paged_fits"] is True and out["cache"] == "paged"
    config = tmp_path / "run.json"
    config.write_text(json.dumps({"plugins": ["paged"]}))
    assert main([*args, "--config", str(config)]) == 0
    capsys.readouterr()
    for cache in ("contiguous", "paged"):  # weights alone are ~1 MiB
        assert main([*args[:-1], "1200KiB", "--cache", cache]) == 1
        rows = dict(line.split("  ", 1) for line in capsys.readouterr().out.splitlines())
        assert rows["fits (paged cache)"].strip() == "NO"
