"""``--config FILE`` on generate, chat, plan, bench and serve: the file's keys (ours and
DeepSpeed's) reach core.build, flags given on the command line win over them, and a bad
file is one error line (exit 2) before any model loads."""
import json

import pytest

from infergraft.core import cli
from infergraft.core.tools import bench_cli, bench_throughput
from cli_support import tiny_chat_model

SEED_CONFIG = "docs/examples/ds_config.json"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(tiny_chat_model(tmp_path_factory.mktemp("tiny-chat")))


def _write(tmp_path, config) -> str:
    path = tmp_path / "run.json"
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    return str(path)


class Built(Exception):
    """Raised by a spy in place of a build: what it was asked for."""


def _spy(monkeypatch, target, name):
    def spy(*args, **kwargs):
        raise Built(args, kwargs)
    monkeypatch.setattr(target, name, spy)


def test_generate_from_a_config_prints_what_the_same_flags_print(tmp_path, capsys, model_dir):
    argv = ["generate", "hello there", "--max-new-tokens", "8"]
    assert cli.main(argv + ["--model", model_dir, "--max-seq-len", "96", "--dtype",
                            "bfloat16"]) == 0
    flags = capsys.readouterr().out
    config = _write(tmp_path, {"model": model_dir, "max_out_tokens": 96, "bf16": {"enabled": True},
                               "kernel_inject": True})
    assert cli.main(argv + ["--config", config]) == 0
    assert capsys.readouterr().out == flags


def test_a_config_s_checkpoint_is_the_model_when_none_is_named(tmp_path, capsys, model_dir):
    argv = ["generate", "hello there", "--max-new-tokens", "8"]
    assert cli.main(argv + ["--model", model_dir, "--max-seq-len", "96"]) == 0
    named = capsys.readouterr().out
    config = _write(tmp_path, {"checkpoint": model_dir, "max_seq_len": 96})
    assert cli.main(argv + ["--config", config]) == 0
    assert capsys.readouterr().out == named
    assert cli.main(["plan", "--config", config, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == model_dir  # not the demo model


@pytest.mark.parametrize("command", [["generate", "hi"], ["chat"]])
def test_flags_win_over_the_config_and_the_plugins_add_up(tmp_path, monkeypatch, command):
    _spy(monkeypatch, cli, "build")
    config = _write(tmp_path, {"model": "some/dir", "max_seq_len": 64, "dtype": "fp16",
                               "quantization": {"kv_cache_quant": True}})
    with pytest.raises(Built) as got:
        cli.main(command + ["--config", config, "--max-seq-len", "32", "--plugin", "paged"])
    (model,), kwargs = got.value.args
    assert model == "some/dir"
    assert (kwargs["max_seq_len"], kwargs["dtype"]) == (32, "float16")
    assert kwargs["plugins"] == ["kv-int8", "paged"]
    with pytest.raises(Built) as got:  # --model wins over the config's
        cli.main(command + ["--config", config, "--model", "other"])
    assert got.value.args[0] == ("other",)


def test_serve_takes_the_config(tmp_path, monkeypatch):
    pytest.importorskip("uvicorn")  # the serve extra: installed by .ci/run
    from infergraft.core.serving.async_engine import AsyncEngine

    monkeypatch.setattr(AsyncEngine, "build", classmethod(
        lambda cls, model, **kw: (_ for _ in ()).throw(Built((model,), kw))))
    config = _write(tmp_path, {"model": "m", "enable_cuda_graph": False, "max_tokens": 80})
    with pytest.raises(Built) as got:
        cli.main(["serve", "--config", config, "--device", "cpu", "--max-batch-size", "3"])
    (model,), kw = got.value.args
    assert model == "m"
    assert (kw["cuda_graphs"], kw["max_seq_len"], kw["max_batch_size"]) == (False, 80, 3)
    assert kw["prefill_graphs"] is False  # as without a config: only --prefill-graphs asks


@pytest.mark.parametrize("module, argv", [
    (bench_cli, ["bench"]), (bench_throughput, ["bench", "throughput", "--num-prompts", "2"])])
def test_bench_builds_its_engine_from_the_config_and_hf_in_its_dtype(tmp_path, monkeypatch,
                                                                     module, argv):
    _spy(monkeypatch, module, "load_models")
    config = _write(tmp_path, {"dtype": "bf16", "quantization": {"kv_cache_quant": True},
                               "model": "ignored: --model names the bench's weights"})
    with pytest.raises(Built) as got:
        cli.main(argv + ["--model", "tiny", "--device", "cpu", "--config", config])
    args, kwargs = got.value.args
    import torch
    assert args[0] == "tiny" and args[2] == torch.bfloat16  # HF runs in the config's dtype
    options = args[-1] if len(args) > 6 else kwargs["config"]
    assert options["plugins"] == ["kv-int8"] and "model" not in options


def test_plan_prints_the_seed_configs_per_rank_plan(tmp_path, capsys):
    from infergraft.core.testing.models import tiny_llama_config

    tiny_llama_config(num_attention_heads=8, num_key_value_heads=4, hidden_size=128,
                      torch_dtype="float32").save_pretrained(tmp_path)
    assert cli.main(["plan", str(tmp_path), "--json"]) == 0
    whole = json.loads(capsys.readouterr().out)
    assert cli.main(["plan", str(tmp_path), "--config", SEED_CONFIG, "--json"]) == 0
    rank = json.loads(capsys.readouterr().out)
    assert (whole["dtype"], whole["kv_dtype"]) == ("float32", "float32")
    assert (rank["dtype"], rank["kv_dtype"]) == ("float16", "int8")
    # one rank's 2 of 4 kv heads, one byte each (and a scale) instead of four
    assert rank["kv_bytes_per_token"] < whole["kv_bytes_per_token"] / 2 / 2
    assert rank["weight_bytes"] < whole["weight_bytes"] / 2  # float16, and half the layers'
    # the demo model's 3 kv heads do not split over 2 ranks: refused as build refuses it
    assert cli.main(["plan", "smollm2-135m", "--config", SEED_CONFIG]) == 2
    assert "2 ranks do not divide num_heads=9" in capsys.readouterr().err


def test_plan_takes_four_bits_and_their_group_size_from_the_config(tmp_path, capsys):
    from infergraft.core.testing.models import tiny_llama_config

    tiny_llama_config(hidden_size=128, torch_dtype="float32").save_pretrained(tmp_path)

    def weight_bytes(*argv):
        assert cli.main(["plan", str(tmp_path), "--json", *argv]) == 0
        return json.loads(capsys.readouterr().out)["weight_bytes"]

    config = _write(tmp_path, {"quantization": {"bits": 4, "group_size": 32}})
    g32 = weight_bytes("--config", config)
    assert g32 == weight_bytes("--weights", "int4", "--group-size", "32")
    assert g32 > weight_bytes("--weights", "int4")  # 128 columns a group: fewer scales
    assert cli.main(["plan", str(tmp_path), "--group-size", "64"]) == 2
    assert "--group-size 64 sizes int4's groups: give --weights int4" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["generate", "hi"], ["chat"], ["plan"], ["bench"],
                                     ["bench", "throughput"], ["serve"]])
def test_a_config_that_is_not_json_is_one_error_line(tmp_path, capsys, command):
    config = _write(tmp_path, '{"dtype": "fp16",\n "max_tokens": 64,,\n}')
    assert cli.main(command + ["--config", config]) == 2
    err = capsys.readouterr().err
    assert err.startswith("infergraft: error:") and "line 2, column" in err, err
