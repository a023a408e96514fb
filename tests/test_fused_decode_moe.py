"""Mixtral and Qwen3-MoE in the fused decode layer: the attention fused as LLaMA's, the
mixture of experts with its input norm unfolded, a decode step of one token on
``ops.moe_decode`` (three kernels), wider steps on the grouped kernels adding the stream.
Triton in the interpreter (float16) against the torch-reference kernels (the plain layer,
weights as loaded): logits, greedy tokens, which path each step took, and no host sync
inside the layer (what keeps a decode step capturable in a CUDA graph)."""
import contextlib
import os
import sys

import pytest
import torch

import infergraft.core
from infergraft import core
from infergraft.core.testing.models import (random_model, random_prompt, tiny_mixtral_config,
                                            tiny_qwen3_moe_config, with_random_norm_weights)
from infergraft.core.testing.parity import relative_error
from infergraft.kernels._triton import HAVE_TRITON, interpreting

KW = dict(max_seq_len=48, max_batch_size=2, dtype="float16", device="cpu")
CONFIGS = {"mixtral": tiny_mixtral_config, "qwen3_moe": tiny_qwen3_moe_config}
interpreter = pytest.mark.skipif(not (HAVE_TRITON and interpreting()),
                                 reason="needs TRITON_INTERPRET=1 (or runs as a GPU test)")


@pytest.fixture(autouse=True)
def fused_layer_on(monkeypatch):
    monkeypatch.delenv("INFERGRAFT_FUSE", raising=False)  # the default: on


def _hf(family, dtype=torch.float32):
    if family == "qwen3_moe":
        pytest.importorskip("infergraft_qwen")
    return with_random_norm_weights(random_model(CONFIGS[family](), seed=3, scale=2.0,
                                                 dtype=dtype), seed=2)


def _count(engine, names=("moe_decode", "fused_moe")):
    calls, ops = [], engine.model.ops
    for name in names:
        op = getattr(ops, name)
        setattr(ops, name, lambda *a, _op=op, _n=name, **k:
                calls.append((_n, a[0].shape[0])) or _op(*a, **k))
    return calls


_SYNCS = ("item", "tolist", "cpu", "numpy", "nonzero", "unique", "__bool__", "__int__",
          "__float__", "__index__")


@contextlib.contextmanager
def host_syncs():
    """Records each tensor method that waits for the device (``.item()``, ``.tolist()``,
    ``.nonzero()``, ``bool(t)``, ...) called from infergraft's own code: under a CUDA graph
    capture each one fails. (Triton's interpreter reads tensors on the host itself: its
    calls come from Triton's files and do not count.)"""
    # the package's root (a namespace package: its core's parent)
    root = os.path.dirname(os.path.dirname(infergraft.core.__file__)) + os.sep
    seen, real = [], {name: getattr(torch.Tensor, name) for name in _SYNCS}

    def watched(name):
        def call(self, *a, **k):
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(root) and "site-packages" not in caller:
                seen.append((name, os.path.relpath(caller, root)))
            return real[name](self, *a, **k)
        return call

    for name in _SYNCS:
        setattr(torch.Tensor, name, watched(name))
    try:
        yield seen
    finally:
        for name, fn in real.items():
            setattr(torch.Tensor, name, fn)


def _watch_moe_layers(engine):
    """Each MoE layer's fused forward under ``host_syncs``: a list of what each call saw."""
    found = []
    for layer in engine.model.layers:
        mlp = layer.mlp
        if type(mlp).__name__ != "MixtureOfExperts":
            continue
        fused = mlp.forward_fused

        def under_watch(*a, _fused=fused, **k):
            with host_syncs() as seen:
                out = _fused(*a, **k)
            found.append(list(seen))
            return out
        mlp.forward_fused = under_watch
    return found


@interpreter
@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_moe_models_take_the_fused_decode_layer(family):
    hf = _hf(family)
    ref = core.build(hf, kernels="torch", **KW)
    engine = core.build(hf, kernels="triton", **KW)
    model = engine.model
    assert model.norms_folded and model._fused(1) and not ref.model.norms_folded
    moe = [i for i, layer in enumerate(model.layers) if layer.layer_spec.experts is not None]
    for i, (a, b) in enumerate(zip(ref.model.layers, model.layers)):
        assert torch.allclose(b.qkv.weight, a.qkv.weight * a.attn_norm.weight[None, :])
        # the experts read the normed row too: the norm keeps its weight, the router its own
        if i in moe:
            assert torch.equal(b.mlp_norm.weight, a.mlp_norm.weight)
            assert torch.equal(b.router.weight, a.router.weight)
    calls = _count(engine)
    prompt = random_prompt(9, hf.config.vocab_size, 3)
    err = relative_error(engine.logits(prompt).float(), ref.logits(prompt).float())
    assert err < 1e-2, err
    assert calls == [("fused_moe", 9)] * len(moe)  # a fused prefill: the grouped kernels
    calls.clear()
    syncs = _watch_moe_layers(engine)
    got = engine.generate(prompt, max_new_tokens=6)[0].token_ids
    want = ref.generate(prompt, max_new_tokens=6)[0].token_ids
    assert got == want and len(set(got)) > 1, (got, want)
    # the prompt's step on the grouped kernels, each of 5 decode steps on moe_decode
    assert calls == [("fused_moe", 9)] * len(moe) + [("moe_decode", 1)] * len(moe) * 5
    assert len(syncs) == 6 * len(moe) and not any(syncs), syncs


@interpreter
def test_two_tokens_sharing_experts_take_the_grouped_kernels():
    """Mixtral's top-2 of 8: two rows often share an expert, so a step of two sequences
    takes the grouped kernels (each expert read once), with the stream added there."""
    hf = _hf("mixtral")
    ref = core.build(hf, kernels="torch", **KW)
    engine = core.build(hf, kernels="triton", **KW)
    calls = _count(engine)
    prompts = [random_prompt(7, hf.config.vocab_size, 6), random_prompt(4, hf.config.vocab_size, 7)]
    syncs = _watch_moe_layers(engine)
    got = [r.token_ids for r in engine.generate(prompts, max_new_tokens=4)]
    assert got == [r.token_ids for r in ref.generate(prompts, max_new_tokens=4)]
    decode = [c for c in calls if c[1] == 2]
    assert decode and set(decode) == {("fused_moe", 2)}, calls
    assert not any(syncs), syncs


@interpreter
def test_the_sync_watch_sees_a_host_sync():
    """The watch above is not blind: the torch reference's loop over the routed experts
    on the CPU (``.unique().tolist()``) is a host sync, and it is seen."""
    from infergraft.kernels.moe_decode import moe_decode_torch

    hf = _hf("mixtral")
    engine = core.build(hf, kernels="triton", **KW)
    engine.model.ops.moe_decode = moe_decode_torch
    syncs = _watch_moe_layers(engine)
    engine.generate(random_prompt(5, hf.config.vocab_size, 2), max_new_tokens=2)
    assert any(("tolist", os.path.join("kernels", "fused_moe.py")) in s for s in syncs), syncs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_bf16_decode_graphs_take_moe_decode_and_keep_the_tokens(family):
    """On the GPU: the decode graphs replay the fused layer with ``moe_decode`` inside;
    greedy tokens as the plain layer's (INFERGRAFT_FUSE=0) on the same weights."""
    hf = _hf(family, torch.bfloat16)
    kw = dict(max_seq_len=64, max_batch_size=2, dtype="bfloat16", device="cuda")
    engine = core.build(hf, plugins=["paged"], **kw)
    calls = _count(engine, ("moe_decode",))
    engine.decode_graphs.capture()  # again, through the counter (build captured them first)
    assert calls  # captured into the graphs (a graph's replays call no Python)
    prompt = random_prompt(9, hf.config.vocab_size, 3)
    got = engine.generate(prompt, max_new_tokens=8)[0].token_ids
    assert engine.decode_graphs.replays > 0
    os.environ["INFERGRAFT_FUSE"] = "0"
    try:
        plain = core.build(hf, plugins=["paged"], **kw)
    finally:
        del os.environ["INFERGRAFT_FUSE"]
    assert not plain.model.norms_folded
    assert_greedy_up_to_ties(plain, prompt, got, plain.generate(prompt, max_new_tokens=8)[0])


def assert_greedy_up_to_ties(plain, prompt, got, want, tie=0.02):
    """bf16 greedy tokens ``got`` against the plain layer: at every position of ``got`` the
    token taken must be one the plain layer's own logits (teacher-forced on ``got``) rate
    within ``tie`` of their best (a near-tie that another summation order flips); a wrong
    expert or weight lands far below. The first token (the prefill's path) must be
    ``want``'s, the plain engine's own answer."""
    want = want.token_ids
    logits = plain.logits(prompt + got[:-1])[len(prompt) - 1:]  # [len(got), V] float32
    for i, token in enumerate(got):
        best = logits[i].max().item()
        assert logits[i, token].item() >= best - tie * max(1.0, abs(best)), (
            i, token, logits[i, token].item(), best, got, want)
    assert got[0] == want[0]  # the prompt's token: the prefill's path, not the fused layer
