"""Hub ids (``org/name``) load from the local Hugging Face cache, laid out here as
huggingface_hub leaves a download (blobs, snapshot symlinks, refs), with the network
forbidden: the same logits as the directory, ``revision`` picking a branch or a commit,
and a model not in the cache refused at once, saying how to fetch it or name a directory."""
import hashlib
import os
import shutil
import socket
from pathlib import Path

import pytest
import torch

from infergraft import core
from infergraft.core import cli
from infergraft.core.loading.source import ModelSourceError
from infergraft.core.testing.models import random_model, random_prompt, tiny_llama_config
from cli_support import tiny_chat_model

MAIN, OTHER = "a" * 40, "b" * 40  # the commits of the two snapshots


def hub_layout(cache: Path, repo_id: str, files: Path, commit: str, ref: str) -> Path:
    """``files``' files as a download leaves them in ``cache``: each a blob named by its
    hash, the snapshot's entries symlinks to the blobs, refs/``ref`` naming ``commit``."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    for f in files.iterdir():
        blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, blob)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """org/tiny: main (seed 3) and branch v2 (seed 4); org/chat: a model with a tokenizer."""
    root = tmp_path_factory.mktemp("hf")
    for seed, commit, ref in ((3, MAIN, "main"), (4, OTHER, "v2")):
        staged = root / f"staged-{seed}"
        random_model(tiny_llama_config(), seed=seed, scale=5.0).save_pretrained(staged)
        hub_layout(root / "hub", "org/tiny", staged, commit, ref)
    staged = tiny_chat_model(root / "staged-chat")
    hub_layout(root / "hub", "org/chat", staged, MAIN, "main")
    return root


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """Any connection or name lookup fails the test: the cache is read, never the hub."""
    def no_network(*args, **kwargs):
        raise AssertionError("infergraft reached for the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # offline without being told


@pytest.fixture
def hub(cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(cache / "hub"))
    return cache / "hub"


def logits(model, **kw):
    return core.build(model, max_seq_len=32, max_batch_size=1, **kw).logits(
        random_prompt(8, 256, 1))


def test_a_hub_id_loads_its_cached_snapshot_of_main(hub, cache):
    engine = core.build("org/tiny", max_seq_len=32, max_batch_size=1)
    assert engine.plan.model == "org/tiny"
    ids = random_prompt(8, 256, 1)
    assert torch.equal(engine.logits(ids), logits(str(cache / "staged-3")))


def test_revision_picks_a_branch_or_a_commit(hub, cache):
    other = logits(str(cache / "staged-4"))
    assert torch.equal(logits("org/tiny", revision="v2"), other)
    assert torch.equal(logits("org/tiny", revision=OTHER), other)
    assert torch.equal(logits("org/tiny", revision=MAIN), logits(str(cache / "staged-3")))
    assert not torch.equal(logits("org/tiny"), other)


def test_hf_home_names_the_cache_too(cache, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(cache))  # its hub/ folder
    assert core.build("org/tiny", max_seq_len=32).plan.model == "org/tiny"


def test_a_model_not_in_the_cache_is_refused_with_how_to_get_it(hub):
    with pytest.raises(ModelSourceError) as e:
        core.build("org/absent")
    message = str(e.value)
    assert "cannot load model 'org/absent': it is not a local directory" in message
    assert f"the Hugging Face cache ({hub}) holds no snapshot of it" in message
    assert "does not reach the hub" in message and "hf download org/absent" in message
    assert "--model DIR" in message
    with pytest.raises(ModelSourceError, match=r"no snapshot of revision 'v3' \(its refs: "
                                               r"main, v2\)"):
        core.build("org/tiny", revision="v3")


def test_revision_is_refused_where_there_is_no_hub_id(cache):
    with pytest.raises(ModelSourceError, match="picks a snapshot of a hub id"):
        core.build(str(cache / "staged-3"), revision="main")
    with pytest.raises(ModelSourceError, match="non-empty string"):
        core.build("org/tiny", revision="")
    with pytest.raises(core.InfergraftError, match="revision"):  # the config's key, checked
        core.build("org/tiny", config={"revision": 7})


def test_the_cli_takes_a_hub_id_and_its_revision(hub, cache, capsys, tmp_path):
    snapshot = hub / "models--org--chat" / "snapshots" / MAIN
    argv = ["generate", "hello", "--max-new-tokens", "4", "--max-seq-len", "64"]
    assert cli.main([*argv, "--model", "org/chat", "--revision", "main"]) == 0
    from_hub = capsys.readouterr().out
    assert cli.main([*argv, "--model", str(snapshot)]) == 0
    assert capsys.readouterr().out == from_hub and from_hub.strip()
    assert cli.main(["plan", "org/tiny", "--revision", "v2"]) == 0
    assert "org/tiny" in capsys.readouterr().out
    assert cli.main([*argv, "--model", "org/absent"]) == 2
    assert "hf download org/absent" in capsys.readouterr().err
    config = tmp_path / "config.json"  # the config's revision reaches plan and generate
    config.write_text('{"model": "org/tiny", "revision": "v3"}')
    for command in (["plan"], ["generate", "hello"]):
        assert cli.main([*command, "--config", str(config)]) == 2
        assert "no snapshot of revision 'v3'" in capsys.readouterr().err


def test_the_tools_that_read_a_model_directory_take_a_hub_id(hub, cache):
    """bench (its --model flag and HF's copy of the weights), the offline HF serve run and
    quantize (the tokenizer files it copies) find the same snapshot, offline."""
    import argparse

    from infergraft.core.quantize.model import source_dir
    from infergraft.core.tools.bench_cli import _model, load_hf

    assert _model("org/tiny") == "org/tiny"
    with pytest.raises(argparse.ArgumentTypeError, match="hub id in the Hugging Face cache"):
        _model("org/absent")
    hf = load_hf("org/tiny", "cpu", torch.float32)
    staged = random_model(tiny_llama_config(), seed=3, scale=5.0)
    assert all(torch.equal(t, staged.state_dict()[k]) for k, t in hf.state_dict().items())
    assert source_dir("org/chat") == hub / "models--org--chat" / "snapshots" / MAIN
