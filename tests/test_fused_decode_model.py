"""The fused decode layer (norm weights folded into the GEMMs, SwiGLU and residual adds
inside them) inside the model: steps of <= ``fuse_max_rows`` tokens take it. Runs the
Triton kernels in the interpreter (float16: the interpreter's bf16 differs from the GPU's)
and compares logits and greedy tokens with the torch-reference kernels, which never fuse
and keep the weights as loaded; 16-bit weights, and 8-bit rows (int8, fp8) packed from the
folded weights."""
import copy

import pytest
import torch

from infergraft import core
from infergraft.core.runner.model import gemm_operands
from infergraft.core.slots import folded
from infergraft.core.testing.models import (random_model, random_prompt, tiny_llama_config,
                                            with_random_norm_weights)
from infergraft.core.testing.parity import relative_error
from infergraft.kernels._triton import HAVE_TRITON, interpreting

pytestmark = pytest.mark.skipif(not (HAVE_TRITON and interpreting()),
                                reason="needs TRITON_INTERPRET=1 (or runs as a GPU test)")

KW = dict(max_seq_len=48, max_batch_size=2, dtype="float16", device="cpu")


@pytest.fixture(autouse=True)
def fused_layer_on(monkeypatch):
    monkeypatch.delenv("INFERGRAFT_FUSE", raising=False)  # the default: on


def _count_fused_calls(engine, names=("normed_linear", "normed_swiglu", "linear_residual")):
    calls = []
    ops = engine.model.ops
    for name in names:
        op = getattr(ops, name)
        setattr(ops, name, lambda *a, _op=op, _n=name, **k: calls.append((_n, a[0].shape[0])) or _op(*a, **k))
    return calls


def test_folding_moves_the_norm_weights_into_qkv_and_gate_up():
    hf = with_random_norm_weights(random_model(tiny_llama_config(), seed=2, dtype=torch.float16))
    before = {k: v.clone() for k, v in hf.state_dict().items()}
    plain, folded = core.build(hf, kernels="torch", **KW), core.build(hf, kernels="triton", **KW)
    # the caller's model is untouched (loading can share its storage: same dtype and device)
    assert all(torch.equal(v, before[k]) for k, v in hf.state_dict().items())
    for a, b in zip(plain.model.layers, folded.model.layers):
        assert torch.equal(b.attn_norm.weight, torch.ones_like(a.attn_norm.weight))
        assert torch.allclose(b.qkv.weight, a.qkv.weight * a.attn_norm.weight[None, :])
        assert torch.allclose(b.gate_up.weight, a.gate_up.weight * a.mlp_norm.weight[None, :])
        assert torch.equal(b.o.weight, a.o.weight) and torch.equal(b.down.weight, a.down.weight)
    assert torch.equal(folded.model.final_norm.weight, plain.model.final_norm.weight)
    fp32 = core.build(hf, kernels="triton", **{**KW, "dtype": "float32"})
    assert not fp32.model.norms_folded and not fp32.model._fused(1)  # cuBLAS: plain layer
    before = folded.model.layers[0].qkv.weight.clone()
    assert folded.model.fold_norm_weights() and torch.equal(folded.model.layers[0].qkv.weight, before)  # once


# a fused prefill too (5, 24 rows) / only the decode steps (40: more than FUSE_MAX_ROWS)
@pytest.mark.parametrize("prompt_len", [5, 24, 40])
def test_fused_decode_layer_matches_the_reference(prompt_len):
    config = tiny_llama_config(hidden_size=128, intermediate_size=256)
    hf = with_random_norm_weights(random_model(config, seed=4, scale=2.0))
    ref = core.build(hf, kernels="torch", **KW)
    engine = core.build(hf, kernels="triton", **KW)
    assert engine.model.ops.fuse_max_rows >= 1 and ref.model.ops.fuse_max_rows == 0
    assert engine.model.norms_folded and not ref.model.norms_folded
    calls = _count_fused_calls(engine)
    prompt = random_prompt(prompt_len, hf.config.vocab_size, 3)
    err = relative_error(engine.logits(prompt).float(), ref.logits(prompt).float())
    assert err < 1e-2, err
    assert bool(calls) == (prompt_len <= engine.model.ops.fuse_max_rows)
    calls.clear()
    got = engine.generate(prompt, max_new_tokens=6)[0].token_ids
    assert got == ref.generate(prompt, max_new_tokens=6)[0].token_ids
    layers = hf.config.num_hidden_layers
    decode = [c for c in calls if c[1] == 1]  # one token per decode step
    assert len(decode) == 4 * layers * 5, (len(decode), calls[:8])  # 4 per layer, 5 steps


def test_gpt2_and_zero_fuse_rows_keep_the_plain_layer(monkeypatch):
    from infergraft.core.testing.models import tiny_gpt2_config
    gpt2 = core.build(random_model(tiny_gpt2_config(), seed=1), kernels="triton", **KW)
    assert not gpt2.model._fused(1) and not gpt2.model.norms_folded  # LayerNorm + GELU
    llama = core.build(random_model(tiny_llama_config(), seed=1), kernels="triton", **KW)
    assert llama.model._fused(1) and not llama.model._fused(llama.model.ops.fuse_max_rows + 1)
    monkeypatch.setenv("INFERGRAFT_FUSE", "0")  # the A/B knob: weights as loaded, plain layer
    off = core.build(random_model(tiny_llama_config(), seed=1), kernels="triton", **KW)
    assert off.model.ops.fuse_max_rows == 0 and not off.model.norms_folded
    assert not off.model._fused(1)


@pytest.mark.parametrize("backend", ["paged", "offload"])
def test_paged_decode_steps_write_k_v_from_the_qkv_gemm(backend):
    """With the paged caches a decode step's qkv GEMM rotates q and k and writes K/V to the
    cache itself (``normed_qkv_rope``, no rotary kernel): the same greedy tokens as the
    torch reference, one such call per layer and step, prompts still on ``normed_linear``."""
    config = tiny_llama_config(hidden_size=256, intermediate_size=256)  # head_dim 64
    hf = with_random_norm_weights(random_model(config, seed=5, scale=2.0))
    ref = core.build(hf, kernels="torch", plugins=[backend], **KW)
    engine = core.build(hf, kernels="triton", plugins=[backend], **KW)
    calls = []
    ops = engine.model.ops
    for name in ("normed_qkv_rope", "normed_linear"):
        op = getattr(ops, name)
        setattr(ops, name, lambda *a, _op=op, _n=name, **k: calls.append((_n, a[0].shape[0])) or _op(*a, **k))
    prompts = [random_prompt(9, hf.config.vocab_size, 6), random_prompt(4, hf.config.vocab_size, 7)]
    got = [r.token_ids for r in engine.generate(prompts, max_new_tokens=5)]
    assert got == [r.token_ids for r in ref.generate(prompts, max_new_tokens=5)]
    layers = hf.config.num_hidden_layers
    fused = [rows for name, rows in calls if name == "normed_qkv_rope"]
    assert len(fused) == 4 * layers and set(fused) == {2}, calls  # 4 decode steps, 2 rows each
    assert all(rows > 2 for name, rows in calls if name == "normed_linear")  # the prompts


def _norms_folded_by_hand(hf):
    """A copy of ``hf`` with each RMSNorm weight moved into the projections it feeds as
    ``core.slots.folded`` moves it (in ``hf``'s dtype) and the norms ones: the same model,
    whose projections a quantiser packs as a build that folds them packs ``hf``'s."""
    out = copy.deepcopy(hf)
    with torch.no_grad():
        for layer in out.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for norm, projs in ((layer.input_layernorm, (attn.q_proj, attn.k_proj, attn.v_proj)),
                                (layer.post_attention_layernorm, (mlp.gate_proj, mlp.up_proj))):
                for proj in projs:
                    proj.weight.copy_(folded(proj.weight, norm.weight))
                norm.weight.fill_(1)
    return out


@pytest.mark.filterwarnings("ignore::infergraft.core.errors.PerformanceWarning")  # fp8, torch ops
@pytest.mark.parametrize("quantizer", ["int8", "fp8"])
def test_8bit_rows_take_the_fused_layer_with_their_norms_folded_before_packing(quantizer):
    """An int8 or fp8 engine on the Triton ops runs the fused layer on its 8-bit rows, qkv
    and gate_up packed from W g (norms ones), decode steps through the qkv + RoPE GEMM:
    the same packed rows, greedy tokens and (closely) logits as the plain layer (torch
    ops) on the same model with its norms folded by hand."""
    config = tiny_llama_config(hidden_size=256, intermediate_size=256)  # head_dim 64
    hf = with_random_norm_weights(random_model(config, seed=8, dtype=torch.float16, scale=2.0))
    plugins = ["paged", quantizer]
    ref = core.build(_norms_folded_by_hand(hf), kernels="torch", plugins=plugins, **KW)
    engine = core.build(hf, kernels="triton", plugins=plugins, **KW)
    assert engine.model.norms_folded and engine.model._fused(1) and not ref.model._fused(1)
    for a, b in zip(ref.model.layers, engine.model.layers):
        for name in ("qkv", "o", "gate_up", "down"):
            pa, pb = getattr(a, name).packed, getattr(b, name).packed
            assert pb.q.dtype == pa.q.dtype and pb.q.element_size() == 1, name
            assert torch.equal(pa.q.view(torch.uint8), pb.q.view(torch.uint8)), name
            assert torch.equal(pa.scale, pb.scale), name
            assert gemm_operands(getattr(b, name))[0] is pb.q  # what the fused GEMMs read
        for norm in ("attn_norm", "mlp_norm"):
            assert torch.equal(getattr(b, norm).weight, getattr(a, norm).weight)  # ones
    calls = _count_fused_calls(engine, ("normed_qkv_rope", "normed_linear", "normed_swiglu",
                                        "linear_residual"))
    prompt = random_prompt(9, hf.config.vocab_size, 9)
    err = relative_error(engine.logits(prompt).float(), ref.logits(prompt).float())
    assert err < 1e-2, err
    calls.clear()
    assert engine.generate(prompt, max_new_tokens=6)[0].token_ids == \
        ref.generate(prompt, max_new_tokens=6)[0].token_ids
    layers = hf.config.num_hidden_layers
    decode = [name for name, rows in calls if rows == 1]  # 5 decode steps, 4 GEMMs a layer
    assert len(decode) == 4 * layers * 5 and decode.count("normed_qkv_rope") == layers * 5
