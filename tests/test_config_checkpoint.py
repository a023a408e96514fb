"""``checkpoint`` (a config key and build's argument): the weights from safetensors files
named by a directory, a file or DeepSpeed's checkpoint JSON, the model argument giving the
config (an HF model on the meta device, or its config directory); pickle refused."""
import json

import pytest
import torch

from infergraft import core
from infergraft.core.config import resolve_config
from infergraft.core.errors import ConfigError
from infergraft.core.loading.checkpoint import Checkpoint, describe_checkpoint
from infergraft.core.testing.models import random_model, random_prompt, tiny_llama_config

PROMPT = random_prompt(8, 256, 5)
KW = dict(device="cpu", max_seq_len=64, kernels="torch")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(the HF model, its save_pretrained directory, a config-only directory, its greedy
    tokens through our engine)."""
    root = tmp_path_factory.mktemp("ckpt")
    hf = random_model(tiny_llama_config(), seed=11, scale=5.0)
    hf.save_pretrained(root / "weights")  # model.safetensors + config.json
    hf.config.save_pretrained(root / "config-only")
    tokens = core.build(hf, **KW).generate(PROMPT, max_new_tokens=10)[0].token_ids
    return hf, root / "weights", root / "config-only", tokens


def greedy(engine):
    return engine.generate(PROMPT, max_new_tokens=10)[0].token_ids


def meta_model():
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(tiny_llama_config())


def test_a_deepspeed_checkpoint_json_with_a_meta_model(saved, tmp_path):
    _, weights, _, tokens = saved
    description = {"type": "ds_model", "checkpoints": ["model.safetensors"], "version": 1.0}
    (weights / "checkpoints.json").write_text(json.dumps(description))
    engine = core.build(meta_model(), config={"checkpoint": str(weights / "checkpoints.json")},
                        **KW)
    assert greedy(engine) == tokens
    # base_dir: the files are under it, the JSON elsewhere
    (tmp_path / "elsewhere.json").write_text(json.dumps(description))
    engine = core.build(meta_model(), config={"checkpoint": str(tmp_path / "elsewhere.json"),
                                              "base_dir": str(weights)}, **KW)
    assert greedy(engine) == tokens


def test_a_checkpoint_object_with_the_config_directory_as_model(saved):
    _, weights, config_only, tokens = saved
    config = {"checkpoint": {"type": "BLOOM", "checkpoints": ["model.safetensors"],
                             "version": 1.0}, "base_dir": str(weights)}
    engine = core.build(str(config_only), config=config, **KW)
    assert greedy(engine) == tokens


def test_a_checkpoint_directory_with_no_model_argument(saved):
    _, weights, _, tokens = saved
    assert greedy(core.build(config={"checkpoint": str(weights)}, **KW)) == tokens
    assert greedy(core.build(checkpoint=weights / "model.safetensors", model=meta_model(),
                             **KW)) == tokens  # build's own argument, a file


def test_weights_only_and_no_config_says_where_the_config_comes_from(saved, tmp_path):
    _, weights, _, _ = saved
    (tmp_path / "c.json").write_text(json.dumps({"checkpoints": [str(weights / "model.safetensors")]}))
    with pytest.raises(core.InfergraftError, match="the model's config comes from the model "
                                                   "argument.*got None, and the checkpoint's "
                                                   "directory has no config.json"):
        core.build(config={"checkpoint": str(tmp_path / "c.json")}, **KW)


def test_a_model_that_is_no_directory_beside_a_checkpoint_with_a_config(saved):
    # not "the checkpoint has no config.json": it has one, and leaving the model out uses it
    _, weights, _, _ = saved
    with pytest.raises(core.InfergraftError, match=r"got 'smollm2-135m', not a model "
                                                   r"directory; leave it out \(None\): the "
                                                   r"checkpoint's .*weights/config.json serves"):
        core.build("smollm2-135m", config={"checkpoint": str(weights)}, **KW)


@pytest.mark.parametrize("suffix", [".bin", ".pt", ".pth", ".ckpt"])
def test_pickle_checkpoints_are_refused_saying_how_to_convert(tmp_path, suffix):
    (tmp_path / f"pytorch_model{suffix}").write_bytes(b"not read")
    how = "pickle checkpoints are refused .*save_pretrained"
    with pytest.raises(ConfigError, match=how):  # the file itself
        resolve_config({"checkpoint": str(tmp_path / f"pytorch_model{suffix}")})
    with pytest.raises(ConfigError, match=how):  # named by a description
        resolve_config({"checkpoint": {"checkpoints": [f"pytorch_model{suffix}"]},
                        "base_dir": str(tmp_path)})
    with pytest.raises(ConfigError, match=f"holds pytorch_model{suffix}: {how}"):  # a folder of them
        resolve_config({"checkpoint": str(tmp_path)})


@pytest.mark.parametrize("description, why", [
    ({"type": "Megatron", "checkpoints": ["a.safetensors"]}, "type 'Megatron' is refused"),
    ({"checkpoints": {"tp": ["a"], "non_tp": ["b"]}}, "pre-sharded"),
    ({"parallelization": "tp", "checkpoints": ["a.safetensors"]}, "pre-sharded"),
    ({"dtype": "int8", "checkpoints": ["a.safetensors"]}, "pre-quantised"),
    ({"checkpoints": ["missing.safetensors"]}, "names missing files"),
    ({"checkpoints": []}, "must be a list of safetensors file names"),
])
def test_descriptions_we_cannot_read_are_refused(tmp_path, description, why):
    with pytest.raises(ConfigError, match=why):
        describe_checkpoint(description, base_dir=tmp_path)


def test_a_description_is_checked_once_into_files(saved):
    _, weights, _, _ = saved
    out = resolve_config({"checkpoint_config": {"checkpoint_dir": str(weights)}})
    assert out["checkpoint"] == Checkpoint((weights / "model.safetensors",), weights,
                                           str(weights))
