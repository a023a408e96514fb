"""The memory planner: KV bytes from the config alone, `infergraft plan`, build refusals."""
import json

import pytest
import torch

from infergraft import core
from infergraft.core.cli import main
from infergraft.core.errors import PlanError
from infergraft.core.memory import kv_bytes_per_token, plan_memory
from infergraft.core.testing.models import random_model, tiny_llama_config
from infergraft.core.units import fmt_bytes

MiB, GiB = 2**20, 2**30
LLAMA2_7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                 max_position_embeddings=4096, tie_word_embeddings=False)


def _llama2_7b_spec():
    cfg = tiny_llama_config(**LLAMA2_7B)
    return core.get_plugin_manager().policies().get("llama").describe(cfg)


def test_llama2_7b_kv_is_half_a_mib_per_token_and_1_gib_per_2048_tokens():
    spec = _llama2_7b_spec()
    assert kv_bytes_per_token(spec, torch.float16) == MiB // 2
    mem = plan_memory(spec, dtype=torch.float16, max_seq_len=2048, max_batch_size=1,
                      budget=80 * GiB, budget_source="test")
    assert mem.kv_bytes_per_token == MiB // 2
    assert mem.kv_bytes_per_sequence == GiB
    assert mem.weight_bytes == 6_738_415_616 * 2  # LLaMA-2-7B's parameter count, fp16
    assert mem.max_batch_that_fits == (80 * GiB - mem.weight_bytes) // GiB == 67


def test_int8_kv_adds_its_scales():
    spec = _llama2_7b_spec()
    q = core.get_plugin_manager().quantizers().get("kv-int8")
    assert kv_bytes_per_token(spec, torch.float16, q) == 2 * 32 * 32 * (128 + 4)
    assert kv_bytes_per_token(spec, torch.float32) == MiB


def test_plan_cli_reads_only_the_config(tmp_path, capsys):
    tiny_llama_config(**LLAMA2_7B).save_pretrained(tmp_path)  # config.json, no weights at all
    assert not list(tmp_path.glob("*.safetensors"))
    assert main(["plan", str(tmp_path), "--dtype", "float16", "--max-seq-len", "2048",
                 "--max-batch-size", "4", "--device-memory", "80GiB", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["kv_bytes_per_token"] == MiB // 2 and got["kv_bytes_per_sequence"] == GiB
    assert got["kv_bytes_total"] == 4 * GiB and got["weight_bytes"] == 6_738_415_616 * 2
    assert got["max_batch_that_fits"] == 67 and got["fits"] is True
    assert main(["plan", str(tmp_path), "--dtype", "float16", "--kv-dtype", "int8",
                 "--max-seq-len", "2048", "--device-memory", "16GiB"]) == 0
    text = capsys.readouterr().out
    assert "float16 / int8" in text and fmt_bytes(2 * 32 * 32 * 132) in text
    fit = (16 * GiB - 6_738_415_616 * 2) // (2 * 32 * 32 * 132 * 2048)  # 6 int8 sequences
    rows = dict(line.split("  ", 1) for line in text.splitlines())
    assert rows["fits"].strip() == "NO"  # 8 x 2048 tokens do not
    assert rows["largest batch at 2048 tokens"].strip() == str(fit) and fit == 6
    # int8 weights: the 32 layers' projections (qkv 12288, o 4096, gate_up 22016, down 4096
    # rows) at 1 byte + a float32 scale per row; embeddings, lm_head and norms at 2 bytes
    assert main(["plan", str(tmp_path), "--dtype", "float16", "--weights", "int8",
                 "--max-seq-len", "2048", "--json"]) == 0
    packed = 32 * (12288 * 4096 + 4096 * 4096 + 22016 * 4096 + 4096 * 11008)
    rows = 32 * (12288 + 4096 + 22016 + 4096)
    want = packed + 4 * rows + 2 * (6_738_415_616 - packed)
    assert json.loads(capsys.readouterr().out)["weight_bytes"] == want == 7_006_265_344


def test_plan_cli_demo_alias_and_bad_input(capsys):
    assert main(["plan", "smollm2-135m", "--max-seq-len", "1024", "--device-memory", "1GiB"]) == 0
    text = capsys.readouterr().out
    # 30 layers x 3 kv heads x 64 dims x 2 (K, V) x 4 bytes (float32 checkpoint)
    assert fmt_bytes(2 * 30 * 3 * 64 * 4) in text and "smollm2-135m" in text
    assert main(["plan", "smollm2-135m", "--device-memory", "lots"]) == 2
    assert "cannot read 'lots' as a size" in capsys.readouterr().err
    assert main(["plan", "/nonexistent/model"]) == 2
    assert "config.json" in capsys.readouterr().err


def test_build_refuses_what_does_not_fit_with_the_numbers():
    hf = random_model(tiny_llama_config(), seed=0)
    spec_bytes = 2 * 2 * 2 * 16 * 4  # L=2, Hkv=2, D=16, float32 -> 256 B per token
    with pytest.raises(PlanError) as e:
        core.build(hf, max_seq_len=512, max_batch_size=8, device_memory="1MiB")
    msg = str(e.value)
    assert "does not fit" in msg and "8 sequences x 512 tokens" in msg
    assert fmt_bytes(spec_bytes) in msg and "1.00 MiB (device_memory)" in msg
    assert "largest batch" in msg
    # the same budget fits a smaller batch, and a paged pool sized below the plan
    core.build(hf, max_seq_len=512, max_batch_size=2, device_memory="1MiB")
    core.build(hf, plugins=["paged"], max_seq_len=512, max_batch_size=8, num_blocks=64,
               device_memory="1MiB")
    with pytest.raises(PlanError, match="device_memory"):
        core.build(hf, max_seq_len=64, device_memory="a lot")


def test_plan_cli_finds_quantizers_by_format_and_name():
    from infergraft.core.plan_cli import kv_quantizer_for, weight_quantizer_for

    assert kv_quantizer_for("int8").name == "kv-int8"
    assert weight_quantizer_for("int8").name == "int8"
    with pytest.raises(PlanError, match="no registered K/V quantizer stores 'int4'"):
        kv_quantizer_for("int4")
    with pytest.raises(PlanError, match="no registered weight quantizer named 'kv-int8'"):
        weight_quantizer_for("kv-int8")  # a K/V quantiser, not a weight one


def test_plan_counts_windows_for_sliding_window_models(tmp_path, capsys):
    from infergraft.core.testing.models import tiny_mistral_config

    # 2 layers x 2 kv heads x 16 dims x 2 (K, V) x 2 bytes = 256 B per token
    tiny_mistral_config(sliding_window=64).save_pretrained(tmp_path)
    args = ["plan", str(tmp_path), "--dtype", "float16", "--max-seq-len", "512",
            "--max-batch-size", "8"]
    assert main(args + ["--device-memory", "2MiB", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    per_token, weights = got["kv_bytes_per_token"], got["weight_bytes"]
    assert per_token == 256 and got["sliding_window"] == 64
    room = 2 * MiB - weights - 512 * per_token  # one prompt at full length, then windows
    assert got["max_batch_with_window"] == 1 + room // (64 * per_token)
    assert got["max_batch_with_window"] > 2 * got["max_batch_that_fits"] >= 2
    assert main(args + ["--device-memory", "2MiB"]) == 0
    rows = dict(line.split("  ", 1) for line in capsys.readouterr().out.splitlines())
    assert rows["KV per sequence in its window (64 tokens)"].strip() == fmt_bytes(64 * per_token)
    assert rows["largest batch with windows"].split()[0] == str(got["max_batch_with_window"])
    tiny_mistral_config(sliding_window=4096).save_pretrained(tmp_path)  # wider than 512
    assert main(args + ["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["max_batch_with_window"] is None


def test_build_refusal_of_a_window_model_says_what_its_windows_allow():
    from infergraft.core.testing.models import tiny_mistral_config

    hf = random_model(tiny_mistral_config(sliding_window=64), seed=1)
    with pytest.raises(PlanError, match=r"largest batch of 512-token sequences that fits is "
                                        r"\d+ \(\d+ with one prompt at full length and the "
                                        r"rest in their 64-token window\)"):
        core.build(hf, plugins=["paged"], dtype="float16", device="cpu", max_seq_len=512,
                   max_batch_size=4096, device_memory="2MiB")
