"""The seeds' configs and figures, as written: the ds_config.json of seed 004 (section 4.3.3)
byte for byte through core.build, init_inference and ``infergraft plan``; the K/V-cache
arithmetic of seed 000 (section 3.3) and seed 004 (4.2.3) through ``infergraft plan``; the
parallel layouts they name (tensor_parallel_size, model_parallel_size: TP=2 + MP=2 with 4
micro-batches). The two-rank run of the seed's file is tests/test_config_torchrun.py."""
import hashlib
import json
import warnings
from pathlib import Path

import pytest
import torch

from infergraft import core
from infergraft.core import cli
from infergraft.core.config import resolve_config
from infergraft.core.config.values import find_policy
from infergraft.core.errors import ConfigError, ConfigWarning, PlanError
from infergraft.core.plugin_manager import PluginManager
from infergraft.core.testing.models import random_model, tiny_gpt2_config, tiny_llama_config

ROOT = Path(__file__).resolve().parents[1]
# The JSON block after "# ds_config.json 关键配置示例" in seed 004, section 4.3.3 (the seed
# files are not in the repository): copied verbatim, its sha256 taken of the copy
SEED = ROOT / "tests" / "data" / "seed_ds_config.json"
SEED_SHA256 = "a55b6cd3e12dc81cdede50e5ce2ae23422db6af12700b446e4d200a08651e126"
RESOLVED = {"dtype": "float16", "plugins": ["llama", "tp", "kv-int8"], "tp_size": 2}


@pytest.fixture(scope="module")
def hf():
    return random_model(tiny_llama_config(), seed=3, scale=5.0)


def _resolve(config):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = resolve_config(config)
    return out, [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]


def _plan_json(capsys, *argv) -> dict:
    assert cli.main(["plan", *argv, "--json", "--device-memory", "80GiB"]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_fixture_is_the_seed_block_and_the_docs_example_is_it():
    data = SEED.read_bytes()
    assert hashlib.sha256(data).hexdigest() == SEED_SHA256
    assert data.startswith(b'{\n  "train_batch_size": 1,\n') and data.endswith(b"}\n}\n")
    assert (ROOT / "docs" / "examples" / "ds_config.json").read_bytes() == data


def test_the_seed_resolves_with_one_warning_for_its_training_key():
    out, warned = _resolve(SEED)
    # fp16 weights, the llama policy, tp over 2 ranks, int8 K/V ("KV Cache量化（INT8）")
    assert out == RESOLVED
    assert len(warned) == 1 and "training-only" in warned[0] and "train_batch_size" in warned[0]


@pytest.mark.parametrize("entry, policy", [
    ({"transformer": {"policy": "llama", "type": "layers"}}, "llama"),
    ({"transformer": {"policy": "gpt2"}}, "gpt2"),  # type: "layers" by default
    ({"decoder": {"policy": "MistralForCausalLM", "type": "layer"}}, "mistral"),
    ({"LlamaDecoderLayer": {"policy": "llama", "type": "layers"}}, "llama")])
def test_an_entry_naming_its_policy_chooses_it(entry, policy):
    assert _resolve({"injection_policy": entry}) == ({"plugins": [policy]}, [])


@pytest.mark.parametrize("entry, message", [
    ({"transformer": {"policy": "llama", "type": "attention"}},
     'injection_policy.transformer.type="attention" is not valid; accepted: "layers" or '
     '"layer". "type" says what the policy replaces: "layers", each decoder layer whole'),
    ({"transformer": {"type": "layers"}}, "injection_policy.transformer.policy=null is not "
                                          "valid; accepted: a policy name such as \"llama\""),
    ({"transformer": {"policy": "bert"}}, "injection_policy.transformer.policy=\"bert\" names "
                                          "no registered policy"),
    ({"GPT2Block": {"policy": "llama"}}, "ask for different policy")])
def test_a_wrong_entry_says_what_is_accepted(entry, message):
    with pytest.raises(ConfigError) as e:
        resolve_config({"injection_policy": entry})
    assert message in str(e.value)


def test_the_known_policies_are_listed_after_builds_from_hf_models(hf):
    core.build(hf, device="cpu", max_seq_len=16)
    core.build(random_model(tiny_gpt2_config(), seed=0), device="cpu", max_seq_len=16)
    with pytest.raises(ConfigError) as e:
        core.build(hf, config={"injection_policy": "transformer"}, device="cpu")
    for known in ("llama (LlamaForCausalLM)", "mistral (MistralForCausalLM)",
                  "gpt2 (GPT2LMHeadModel)"):
        assert known in str(e.value)


def test_no_policy_loaded_is_said_not_an_empty_list():
    with pytest.raises(ConfigError, match="known policies: none: no policy plugin is loaded"):
        find_policy(PluginManager(), "injection_policy", "llama")


def test_the_seed_in_one_process_says_to_start_two(hf, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert not torch.distributed.is_initialized()
    with pytest.raises(PlanError, match=r"torchrun --nproc-per-node 2 script\.py"):
        core.build(hf, config=str(SEED), device="cpu")
    # init_inference reads the file the same way
    with pytest.raises(PlanError, match=r"torchrun --nproc-per-node 2 script\.py"):
        core.init_inference(hf, config=str(SEED))


def test_plan_reads_the_seed_for_the_llama2_7b_shape(capsys):
    rank = _plan_json(capsys, "llama2-7b", "--config", str(SEED), "--max-seq-len", "2048")
    assert (rank["model"], rank["dtype"], rank["kv_dtype"]) == \
        ("llama2-7b, one of 2 ranks", "float16", "int8")
    # one rank's 16 of 32 heads, a byte each and a float32 scale per token and head
    assert rank["kv_bytes_per_token"] == 2 * 32 * 16 * (128 + 4)


def test_plan_prints_the_seeds_kv_cache_figures(capsys):
    # seed 000, 3.3: LLaMA-7B, 32 layers x 32 heads x 128, fp16, 2048 tokens: ~1.07 GB
    args = ("--dtype", "float16", "--max-seq-len", "2048", "--max-batch-size", "1")
    assert cli.main(["plan", "llama2-7b", *args]) in (0, 1)
    rows = capsys.readouterr().out
    assert "KV per sequence (2048 tokens)     1.00 GiB = 1.07 GB" in rows
    assert _plan_json(capsys, "llama2-7b", *args)["kv_bytes_per_sequence"] == \
        2 * 32 * 32 * 128 * 2048 * 2
    # seed 004, 4.2.3: 40 layers x 40 heads x 128, 2 bytes: 819,200 B a token. The seed
    # writes 1.6MB (and 100GB for 2048 x 32 tokens), twice the product it shows
    args = ("--dtype", "float16", "--max-seq-len", "2048", "--max-batch-size", "32")
    big = _plan_json(capsys, "llama2-13b", *args)
    assert big["kv_bytes_per_token"] == 2 * 40 * 40 * 128 * 2 == 819_200
    assert big["kv_bytes_total"] == 819_200 * 2048 * 32  # 53.69 GB
    assert cli.main(["plan", "llama2-13b", *args]) in (0, 1)
    assert "819.20 kB (819200 B)" in capsys.readouterr().out


def test_a_config_s_max_seq_len_and_max_batch_size_size_the_cache(capsys, tmp_path):
    # seed 004, 4.2.2: "KV Cache预分配：设置max_seq_len和max_batch_size"
    path = tmp_path / "sizes.json"
    path.write_text(json.dumps({"fp16": {"enabled": True}, "max_seq_len": 2048,
                                "max_batch_size": 32}))
    got = _plan_json(capsys, "llama2-13b", "--config", str(path))
    assert (got["max_seq_len"], got["max_batch_size"], got["dtype"]) == (2048, 32, "float16")
    assert got["kv_bytes_total"] == 819_200 * 2048 * 32


def test_tp2_plus_mp2_with_four_micro_batches(capsys, tmp_path):
    # seed 004, 4.3.4: TP=2 + MP=2 (pipeline stages), micro-batch=4, by the key names of
    # 4.2.2 ("tensor_parallel_size和model_parallel_size")
    config = {"tensor_parallel_size": 2, "model_parallel_size": 2, "micro_batches": 4,
              "fp16": {"enabled": True}}
    out, warned = _resolve(config)
    assert (out, warned) == ({"dtype": "float16", "stages": 2, "tensor_parallel": 2,
                              "micro_batches": 4, "plugins": ["pp"]}, [])
    assert _resolve({"pipeline_parallel_size": 2})[0] == {"stages": 2, "plugins": ["pp"]}
    assert _resolve({"tensor_parallel_size": 2})[0] == {"tp_size": 2, "plugins": ["tp"]}
    path = tmp_path / "tp2pp2.json"
    path.write_text(json.dumps(config))
    rank = _plan_json(capsys, "llama2-70b", "--config", str(path))
    assert rank["model"] == ("llama2-70b, stage 1 of 2 (layers 0-39), one of its 2 ranks, "
                             "4 micro-batches a step")
    assert rank["micro_batches"] == 4


def test_the_pipeline_planner_checks_the_stages_asked_for():
    pp = core.get_plugin_manager().planners().get("pp")
    spec = core.get_plugin_manager().policies().get("llama").describe(tiny_llama_config())
    plan = pp.plan(spec, 4, tensor_parallel=2, stages=2, micro_batches=4)
    assert (len(plan.stages), plan.tensor_parallel, plan.micro_batches) == (2, 2, 4)
    with pytest.raises(PlanError, match=r"2 stages x tensor_parallel=2 need 4 processes but "
                                        r"this run has 2: .*--nproc-per-node 4"):
        pp.plan(spec, 2, tensor_parallel=2, stages=2)
    assert pp.processes(tensor_parallel=2, stages=2) == 4


def test_tp2_plus_mp2_in_one_process_says_to_start_four(hf, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(PlanError, match=r"torchrun --nproc-per-node 4 script\.py"):
        core.build(hf, config={"tensor_parallel_size": 2, "model_parallel_size": 2},
                   device="cpu")
