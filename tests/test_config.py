"""core.build(model, config=...): reading a config (bad files each a clear error or
warning, nothing built), arguments over it, a build from it equal to the build from the
same keyword arguments, checkpoints, and tp_size checked before any weight is read."""
import importlib
import inspect
import json
from pathlib import Path

import attrs
import pytest
import torch

from infergraft import core
from infergraft.core.config import (DEEPSPEED_KEYS, OWN_KEYS, explicit_arguments, load_config,
                                    resolve_config)
from infergraft.core.errors import ConfigError, ConfigWarning, PlanError
from infergraft.core.testing.models import random_model, random_prompt, tiny_llama_config

B = importlib.import_module("infergraft.core.build")  # core.build is also the function
ROOT = Path(__file__).resolve().parents[1]
PROMPT = random_prompt(9, 256, 4)


@pytest.fixture(scope="module")
def hf():
    return random_model(tiny_llama_config(), seed=7, scale=5.0)


@pytest.fixture
def no_weights_read(monkeypatch):
    """build's model source, whose weights fail the test if anything reads them."""
    real = B.resolve_source

    def source(*args, **kwargs):
        def boom():
            raise AssertionError("weights were read")
        return attrs.evolve(real(*args, **kwargs), tensors=boom)
    monkeypatch.setattr(B, "resolve_source", source)


@pytest.fixture
def world_of_one(tmp_path):
    """A torch.distributed group of this one process (gloo), as torchrun would make."""
    dist = torch.distributed
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1),
                            rank=0, world_size=1)
    yield
    from infergraft.core.distributed.failure import leave_group

    leave_group()


def greedy(engine):
    return engine.generate(PROMPT, max_new_tokens=10)[0].token_ids


def test_not_json_names_the_file_line_and_column(tmp_path, hf, no_weights_read):
    bad = tmp_path / "run.json"
    bad.write_text('{"dtype": "fp16",\n  "max_seq_len": }\n')
    with pytest.raises(ConfigError, match=r"run\.json is not JSON: line 2, column 18"):
        load_config(bad)
    with pytest.raises(PlanError, match="line 2, column 18"):  # the CLI's exit 2
        core.build(hf, config=str(bad), device="cpu")


@pytest.mark.parametrize("text, why", [("[1, 2]", "not a JSON object"),
                                       ('"fp16"', "not a JSON object")])
def test_a_top_level_that_is_not_an_object_is_refused(tmp_path, text, why):
    path = tmp_path / "c.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=why):
        load_config(path)


def test_a_missing_file_and_a_wrong_source_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.json")
    with pytest.raises(ConfigError, match="a path to a JSON file or a dict, got int"):
        load_config(3)


def test_a_dict_is_copied():
    source = {"tensor_parallel": {"tp_size": 2}}
    copied = load_config(source)
    copied["tensor_parallel"]["tp_size"] = 4
    assert source == {"tensor_parallel": {"tp_size": 2}}


def test_an_unknown_key_warns_naming_the_closest_known_key():
    with pytest.warns(ConfigWarning, match="'max_seq_lne' is ignored; did you mean "
                                           "'max_seq_len'") as caught:
        out = resolve_config({"max_seq_lne": 64, "max_batch_size": 2})
    assert out == {"max_batch_size": 2, "plugins": []} and len(caught) == 1
    with pytest.warns(ConfigWarning, match="did you mean 'block_size'"):  # a plugin's option
        resolve_config({"block_sise": 32})
    with pytest.warns(ConfigWarning, match="did you mean 'tensor_parallel.tp_size'"):
        resolve_config({"tensor_parallel": {"tp_szie": 2}})


@pytest.mark.parametrize("config, named", [
    ({"max_seq_len": "long"}, 'max_seq_len="long" is not valid; accepted: an integer >= 1'),
    ({"fp16": {"enabled": "yes"}}, 'fp16.enabled="yes" is not valid; accepted: true or false'),
    ({"kernels": "cuda"}, 'kernels="cuda" is not valid; accepted: "auto", "triton", "torch"'),
    ({"plugins": {"paged": 1}}, 'plugins={"paged": 1} is not valid; accepted: a list'),
    ({"max_batch_size": True}, "max_batch_size=true is not valid"),
    ({"cuda_graphs": "on"}, 'cuda_graphs="on" is not valid; accepted: true or false (or null: the default)'),
])
def test_a_wrong_value_names_key_value_and_what_is_accepted(hf, no_weights_read, config, named):
    with pytest.raises(ConfigError) as e:
        core.build(hf, config=config, device="cpu")
    assert named in str(e.value)


def test_own_keys_are_builds_arguments():
    params = set(inspect.signature(core.build).parameters) - {"config", "plugin_options"}
    assert set(OWN_KEYS) == params


def test_every_key_is_in_the_docs():
    page = (ROOT / "docs" / "config.md").read_text()
    missing = [k for k in [*DEEPSPEED_KEYS, *OWN_KEYS] if f"`{k}`" not in page]
    assert missing == []


def test_the_seed_example_resolves_as_written():
    out = resolve_config(ROOT / "docs" / "examples" / "ds_config.json")
    assert out == {"dtype": "float16", "plugins": ["llama", "tp", "kv-int8"], "tp_size": 2}


def test_the_seed_example_builds_on_one_rank(hf, world_of_one):
    # the example as written but for one process (the lead runs the two-rank one)
    config = {**load_config(ROOT / "docs" / "examples" / "ds_config.json"),
              "tensor_parallel": {"tp_size": 1}, "plugins": ["tp"]}
    engine = core.build(hf, config=config, device="cpu", max_seq_len=64)
    p = engine.plan
    assert (p.dtype, p.policy, p.planner, p.kv_dtype) == ("float16", "llama", "tp", "int8")
    assert len(greedy(engine)) == 10


def test_overrides_win_key_by_key_and_plugins_add_up():
    out = resolve_config({"dtype": "fp16", "max_seq_len": 64, "plugins": ["paged"]},
                         {"dtype": "bfloat16", "plugins": ["int8", "paged"], "block_size": 8})
    assert out == {"dtype": "bfloat16", "max_seq_len": 64, "plugins": ["paged", "int8"],
                   "block_size": 8}


def test_explicit_arguments_are_those_off_their_defaults():
    def fn(model=None, plugins=None, *, config=None, kernels="auto", progress=False, **kw):
        return explicit_arguments(fn, locals())
    assert fn("m", config={}, kernels="torch", progress=False, block_size=8) == \
        {"model": "m", "kernels": "torch", "block_size": 8}


def test_build_arguments_win_over_the_config(hf):
    engine = core.build(hf, config={"max_seq_len": 64, "max_batch_size": 2, "dtype": "bf16"},
                        max_seq_len=32, device="cpu")
    assert (engine.plan.max_seq_len, engine.plan.max_batch_size) == (32, 2)
    assert engine.plan.dtype == "bfloat16"


def test_a_build_from_a_config_equals_the_build_from_keywords(hf, tmp_path):
    config = {"dtype": "fp32", "max_out_tokens": 64, "max_batch_size": 2,
              "kernel_inject": False, "enable_cuda_graph": False,
              "injection_policy": {"LlamaDecoderLayer": ["self_attn.o_proj", "mlp.down_proj"]},
              "quantization": {"enabled": True, "bits": 8, "kv_cache_quant": True},
              "train_batch_size": 8}
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    with pytest.warns(ConfigWarning):  # the linear names, the training key
        from_file = core.build(hf, config=str(path), device="cpu")
    from_kwargs = core.build(hf, plugins=["llama", "int8", "kv-int8"], dtype="float32",
                             max_seq_len=64, max_batch_size=2, kernels="torch",
                             cuda_graphs=False, device="cpu")
    assert from_file.plan == from_kwargs.plan
    assert from_file.plan.quantizers == ("int8", "kv-int8")
    assert greedy(from_file) == greedy(from_kwargs)


def test_the_config_model_is_used_when_the_argument_is_none(hf, tmp_path):
    hf.save_pretrained(tmp_path / "m")
    engine = core.build(config={"model": str(tmp_path / "m"), "max_seq_len": 64},
                        device="cpu")
    assert engine.plan.model == str(tmp_path / "m")
    assert greedy(engine) == greedy(core.build(hf, max_seq_len=64, device="cpu"))


def test_tp_size_not_dividing_the_heads_fails_before_any_weight(hf, world_of_one,
                                                                 no_weights_read):
    with pytest.raises(PlanError, match="3 ranks do not divide num_heads=4"):
        core.build(hf, config={"tensor_parallel": {"tp_size": 3}}, device="cpu")


def test_tp_size_other_than_the_world_says_how_to_launch(hf, world_of_one, no_weights_read):
    with pytest.raises(PlanError, match=r"tp_size=2 but this run has 1 process\(es\): start "
                                        r"it with `torchrun --nproc-per-node 2"):
        core.build(hf, config={"mp_size": 2}, device="cpu")


def test_nothing_is_built_for_a_refused_config(hf, monkeypatch):
    monkeypatch.setattr(B, "select_plugins", lambda *a: pytest.fail("build began"))
    for bad in ({"moe": True}, {"checkpoint": "model.bin"}, {"quantization": {"bits": 3}}):
        with pytest.raises(ConfigError):
            core.build(hf, config=bad, device="cpu")


def test_four_bits_build_the_int4_quantizer_in_the_groups_asked(hf):
    config = {"quantization": {"enabled": True, "bits": 4, "group_size": 32}}
    engine = core.build(hf, config=config, device="cpu", max_seq_len=64)
    same = core.build(hf, plugins=["int4"], group_size=32, device="cpu", max_seq_len=64)
    assert engine.plan == same.plan and engine.plan.quantizers == ("int4",)
    assert dict(engine.plan.options)["group_size"] == 32
    assert torch.equal(engine.logits(PROMPT), same.logits(PROMPT))
