"""The fused decode layer (norms, SwiGLU and residual adds inside the GEMMs) inside the
model: steps of <= ``fuse_max_rows`` tokens take it. Runs the Triton kernels in the
interpreter (float16: the interpreter's bf16 differs from the GPU's) and compares logits
and greedy tokens with the torch-reference kernels, which never fuse."""
import pytest

from infergraft import core
from infergraft.core.testing.models import random_model, random_prompt, tiny_llama_config
from infergraft.core.testing.parity import relative_error
from infergraft.kernels._triton import HAVE_TRITON, interpreting

pytestmark = pytest.mark.skipif(not (HAVE_TRITON and interpreting()),
                                reason="needs TRITON_INTERPRET=1 (or runs as a GPU test)")

KW = dict(max_seq_len=48, max_batch_size=2, dtype="float16", device="cpu")


def _count_fused_calls(engine):
    calls = []
    ops = engine.model.ops
    for name in ("rms_norm_linear", "rms_norm_swiglu", "linear_residual"):
        op = getattr(ops, name)
        setattr(ops, name, lambda *a, _op=op, _n=name, **k: calls.append((_n, a[0].shape[0])) or _op(*a, **k))
    return calls


@pytest.mark.parametrize("prompt_len", [5, 20])  # a fused prefill too / only the decode steps
def test_fused_decode_layer_matches_the_reference(prompt_len):
    hf = random_model(tiny_llama_config(), seed=4, scale=2.0)
    ref = core.build(hf, kernels="torch", **KW)
    engine = core.build(hf, kernels="triton", **KW)
    assert engine.model.ops.fuse_max_rows >= 1 and ref.model.ops.fuse_max_rows == 0
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


def test_gpt2_and_zero_fuse_rows_keep_the_plain_layer():
    from infergraft.core.testing.models import tiny_gpt2_config
    gpt2 = core.build(random_model(tiny_gpt2_config(), seed=1), kernels="triton", **KW)
    assert not gpt2.model._fused(1)  # LayerNorm + GELU: nothing to fuse
    llama = core.build(random_model(tiny_llama_config(), seed=1), kernels="triton", **KW)
    assert llama.model._fused(1)
    llama.model.ops.fuse_max_rows = 0
    assert not llama.model._fused(1)
