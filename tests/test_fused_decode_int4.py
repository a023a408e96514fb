"""An int4 model in the fused decode layer: the projections stay int4 groups, the norms
unfolded (their weights applied in the GEMMs' prologues), decode steps on the int4 fused
kernels (RoPE + the K/V write in the qkv GEMM); against the plain layer
(``INFERGRAFT_FUSE=0``, today's path) on the same Triton ops and against the torch
references: greedy tokens, logits, no host sync inside the layer (what keeps a decode step
capturable in a CUDA graph). A GPTQ act-order checkpoint takes it too, its perms gathered
in the prologues. Triton in the interpreter (float16)."""
import pytest
import torch

from infergraft import core
from infergraft.core.runner.model import gemm_operands
from infergraft.core.testing.models import (random_model, random_prompt, tiny_llama_config,
                                            with_random_norm_weights)
from infergraft.core.testing.parity import relative_error
from infergraft.kernels._triton import HAVE_TRITON, interpreting
from infergraft.kernels.int4_format import Int4Weight

from test_fused_decode_moe import host_syncs

interpreter = pytest.mark.skipif(not (HAVE_TRITON and interpreting()),
                                 reason="needs TRITON_INTERPRET=1 (or runs as a GPU test)")

KW = dict(max_seq_len=48, max_batch_size=2, dtype="float16", device="cpu")
GEMMS = ("normed_qkv_rope", "normed_linear", "normed_swiglu", "linear_residual")


@pytest.fixture(autouse=True)
def int4_fused(monkeypatch):
    """The fused layer's int4 GEMMs are off by default until their GPU run."""
    monkeypatch.setenv("INFERGRAFT_INT4_FUSED", "1")


def _count(engine):
    """(op, rows, whether its weight is int4) of each fused GEMM the engine calls."""
    calls, ops = [], engine.model.ops
    for name in GEMMS:
        op = getattr(ops, name)
        setattr(ops, name, lambda *a, _op=op, _n=name, **k: calls.append(
            (_n, a[0].shape[0], isinstance(a[1], Int4Weight))) or _op(*a, **k))
    return calls


def _hf():
    config = tiny_llama_config(hidden_size=128, intermediate_size=256)  # head_dim 32
    return with_random_norm_weights(random_model(config, seed=8, dtype=torch.float16, scale=2.0))


@interpreter
def test_an_int4_step_takes_the_fused_layer(monkeypatch):
    hf = _hf()
    plugins = ["paged", "int4"]
    ref = core.build(hf, kernels="torch", plugins=plugins, **KW)
    engine = core.build(hf, kernels="triton", plugins=plugins, **KW)
    monkeypatch.setenv("INFERGRAFT_FUSE", "0")
    plain = core.build(hf, kernels="triton", plugins=plugins, **KW)
    assert engine.model.norms_folded and engine.model._fused(1)
    assert not plain.model._fused(1) and not ref.model._fused(1)
    for a, b in zip(ref.model.layers, engine.model.layers):
        for name in ("qkv", "o", "gate_up", "down"):  # the int4 groups, as loaded
            assert gemm_operands(getattr(b, name))[0] is getattr(b, name).packed
            assert torch.equal(getattr(b, name).packed.qweight, getattr(a, name).packed.qweight)
        for norm in ("attn_norm", "mlp_norm"):  # unfolded: the GEMMs apply them
            assert not torch.equal(getattr(b, norm).weight, torch.ones_like(b.attn_norm.weight))
            assert torch.equal(getattr(b, norm).weight, getattr(a, norm).weight)
            assert b.input_norm(norm)["norm"] is getattr(b, norm).weight
    calls = _count(engine)
    prompt = random_prompt(6, hf.config.vocab_size, 9)
    assert relative_error(engine.logits(prompt).float(), ref.logits(prompt).float()) < 1e-2
    calls.clear()
    with host_syncs() as syncs:
        tokens = engine.generate(prompt, max_new_tokens=4)[0].token_ids
    assert tokens == plain.generate(prompt, max_new_tokens=4)[0].token_ids
    assert tokens == ref.generate(prompt, max_new_tokens=4)[0].token_ids
    layers = hf.config.num_hidden_layers
    decode = [(name, int4) for name, rows, int4 in calls if rows == 1]  # 3 steps, 4 a layer
    assert len(decode) == 4 * layers * 3 and all(int4 for _, int4 in decode)
    assert [n for n, _ in decode].count("normed_qkv_rope") == layers * 3
    inside = [s for s in syncs if s[1].endswith(("int4_fused.py", "int4_fused_ops.py",
                                                 "fused_linear.py", "llama_layers.py"))]
    assert not inside, inside


@interpreter
def test_an_act_order_checkpoint_takes_the_fused_layer(tmp_path):
    """GPTQ act order: qkv, o and gate_up keep a perm (down's folded into gate_up's rows),
    gathered in the fused GEMMs' prologues; the same greedy tokens as the plain layer."""
    from test_gptq_act_order import write_act_order

    hf = random_model(tiny_llama_config(), seed=0, scale=20.0)
    ref = write_act_order(hf, tmp_path)
    kw = dict(kernels="triton", dtype="float16", max_seq_len=64, max_batch_size=2)
    engine = core.build(str(tmp_path), **kw)
    assert engine.model._fused(1)
    layer = engine.model.layers[0]
    assert all(getattr(layer, s).packed.perm is not None for s in ("qkv", "o", "gate_up"))
    calls = _count(engine)
    ids = random_prompt(10, 256, seed=2)
    reference = core.build(ref.half(), kernels="torch", dtype="float16", max_seq_len=64,
                           max_batch_size=2)
    assert relative_error(engine.logits(ids).float(), reference.logits(ids).float()) < 2e-2
    assert engine.generate(ids, max_new_tokens=4)[0].token_ids == \
        reference.generate(ids, max_new_tokens=4)[0].token_ids
    assert any(rows == 1 and int4 for _, rows, int4 in calls)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("group_size", [128, 32])
def test_gpu_fused_int4_under_the_decode_graphs(monkeypatch, group_size):
    """On the GPU, decode replayed from CUDA graphs (the split-K counters inside them), one
    sequence and three at once, float16: the fused layer's int4 GEMMs give the plain
    layer's (``INFERGRAFT_FUSE=0``) greedy tokens and close logits."""
    config = tiny_llama_config(hidden_size=256, intermediate_size=512, num_hidden_layers=2)
    hf = with_random_norm_weights(random_model(config, seed=8, scale=2.0))
    kw = dict(plugins=["paged", "int4"], group_size=group_size, device="cuda", dtype="float16",
              max_seq_len=96, max_batch_size=4)
    prompts = [random_prompt(n, config.vocab_size, seed) for n, seed in ((7, 1), (5, 2), (9, 3))]

    def run(engine):
        assert engine.decode_graphs is not None
        return (engine.logits(prompts[2]).float(),
                engine.generate(prompts[0], max_new_tokens=6)[0].token_ids,
                [c.token_ids for c in engine.generate(prompts, max_new_tokens=4)])

    monkeypatch.setenv("INFERGRAFT_FUSE", "0")
    plain = core.build(hf, **kw)
    want = run(plain)
    del plain
    monkeypatch.delenv("INFERGRAFT_FUSE")
    engine = core.build(hf, **kw)
    assert engine.model._fused(1)  # (the graphs captured its GEMMs: none are called here)
    assert isinstance(gemm_operands(engine.model.layers[0].qkv)[0], Int4Weight)
    got = run(engine)
    assert relative_error(got[0], want[0]) < 5e-3
    assert got[1:] == want[1:]
