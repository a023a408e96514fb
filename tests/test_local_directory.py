"""Loading from a local safetensors directory streams tensor by tensor."""
import json

import safetensors.torch
import torch

from infergraft import core
from infergraft.core.testing.models import random_model, random_prompt, tiny_llama_config


def test_directory_load_matches_in_memory(tmp_path):
    hf = random_model(tiny_llama_config(tie_word_embeddings=True), seed=3, scale=5.0)
    hf.config.save_pretrained(tmp_path)
    safetensors.torch.save_model(hf, str(tmp_path / "model.safetensors"))
    from_dir = core.build(str(tmp_path), max_seq_len=64, max_batch_size=2)
    in_mem = core.build(hf, max_seq_len=64, max_batch_size=2)
    ids = random_prompt(10, 256, 1)
    assert torch.equal(from_dir.logits(ids), in_mem.logits(ids))
    assert from_dir.plan.model == str(tmp_path)


def test_sharded_directory(tmp_path):
    hf = random_model(tiny_llama_config(), seed=4)
    hf.config.save_pretrained(tmp_path)
    sd = hf.state_dict()
    keys = sorted(sd)
    half = len(keys) // 2
    index = {}
    for n, part in enumerate((keys[:half], keys[half:])):
        name = f"model-0000{n + 1}-of-00002.safetensors"
        safetensors.torch.save_file({k: sd[k].contiguous() for k in part}, str(tmp_path / name))
        index.update({k: name for k in part})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    engine = core.build(str(tmp_path), max_seq_len=32, max_batch_size=1)
    ids = random_prompt(6, 256, 2)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert torch.allclose(engine.logits(ids), ref, rtol=1e-4, atol=1e-5)


def test_broken_directories_say_which_file_and_why(tmp_path):
    import pytest

    from infergraft.core.loading.source import ModelSourceError

    hf = random_model(tiny_llama_config())
    hf.config.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelSourceError, match="model.safetensors is not a readable safetensors"):
        core.build(str(tmp_path))
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"lm_head.weight": "pytorch_model.bin"}}))
    with pytest.raises(ModelSourceError, match="not safetensors.*pickle.*pytorch_model.bin"):
        core.build(str(tmp_path))
    index.write_text(json.dumps({"weight_map": {"lm_head.weight": "model-00002.safetensors"}}))
    with pytest.raises(ModelSourceError, match="missing shards: model-00002.safetensors"):
        core.build(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelSourceError, match="config.json cannot be read"):
        core.build(str(tmp_path))
