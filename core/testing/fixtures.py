"""Shared pytest fixtures, loaded in every test run through the ``pytest11`` entry point
``infergraft = "infergraft.core.testing.fixtures"`` (nothing to import in a conftest).

Imports of torch/transformers happen inside the fixtures: a pytest plugin is loaded
before any conftest.py, and importing heavy modules here would run before a project's
conftest could set environment variables such as TRITON_INTERPRET.
"""
from __future__ import annotations

import contextlib
import random
from typing import Iterator

import pytest


@contextlib.contextmanager
def plugins_registered_during(pm) -> Iterator:
    """Unregister, on exit, every plugin registered on ``pm`` inside the block."""
    before = set(pm.info)
    try:
        yield pm
    finally:
        for name in [n for n in pm.info if n not in before]:
            pm.unregister(name)


@pytest.fixture
def infergraft_plugin_manager():
    """The process-wide plugin manager; plugins a test registers on it are removed after.

        def test_my_hook(infergraft_plugin_manager):
            infergraft_plugin_manager.register(MyPlugin(), name="mine")
            engine = core.build(model)          # sees "mine"
    """
    from infergraft.core import get_plugin_manager

    with plugins_registered_during(get_plugin_manager()) as pm:
        yield pm


@pytest.fixture
def infergraft_reset_plugins():
    """Forget the process-wide manager before and after the test, so that it is rebuilt
    from the INFERGRAFT_* variables the test sets (use with ``monkeypatch.setenv``)."""
    from infergraft.core import reset_plugin_manager

    reset_plugin_manager()
    yield reset_plugin_manager
    reset_plugin_manager()


@pytest.fixture
def infergraft_seed() -> int:
    """Seeds torch and random; returns the seed."""
    import torch

    seed = 0
    torch.manual_seed(seed)
    random.seed(seed)
    return seed


@pytest.fixture
def tiny_llama_config():
    """A tiny GQA LLaMA config (2 layers, 4 heads, 2 KV heads, vocab 256)."""
    from infergraft.core.testing.models import tiny_llama_config as make

    return make()


@pytest.fixture
def tiny_llama(tiny_llama_config):
    """A random-initialised ``LlamaForCausalLM`` of ``tiny_llama_config`` (float32, CPU),
    with weights scaled up so that logits differ clearly between tokens."""
    from infergraft.core.testing.models import random_model

    return random_model(tiny_llama_config, seed=0, scale=5.0)
