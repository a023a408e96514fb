"""Split-K o/down projections inside the model: their float32 partial sums [S, T, H] flow
into the next add+RMSNorm (kernels/linear.py, kernels/rms_norm.py). Runs the Triton
kernels in the interpreter (float16: the interpreter's bf16 differs from the GPU's) and
compares the model's logits and greedy tokens with the torch-reference kernels."""
import pytest

from infergraft import core
from infergraft.core.testing.models import random_model, random_prompt, tiny_llama_config
from infergraft.core.testing.parity import relative_error
from infergraft.kernels._triton import HAVE_TRITON, interpreting

pytestmark = pytest.mark.skipif(not (HAVE_TRITON and interpreting()),
                                reason="needs TRITON_INTERPRET=1 (or runs as a GPU test)")


def test_split_k_partials_through_the_model_match_the_reference():
    # K = 256 (o) and 512 (down): 2 and 4 tiles of 128, so the splits are real
    hf = random_model(tiny_llama_config(hidden_size=256, intermediate_size=512), seed=2, scale=2.0)
    kw = dict(max_seq_len=64, max_batch_size=2, dtype="float16", device="cpu")
    ref = core.build(hf, kernels="torch", **kw)
    engine = core.build(hf, kernels="triton", **kw)
    shapes = []

    def recording(op):
        def run(x, w, b=None):
            out = op(x, w, b)
            shapes.append(tuple(out.shape))
            return out
        return run

    for layer in engine.model.layers:  # record what o and down hand to the norms
        layer.o.linear, layer.down.linear = recording(layer.o.linear), recording(layer.down.linear)
    prompt = random_prompt(40, 256, 7)  # more rows than the fused layer takes (32)
    err = relative_error(engine.logits(prompt).float(), ref.logits(prompt).float())
    assert err < 1e-2, err
    assert shapes and all(len(s) == 3 and s[0] > 1 for s in shapes), shapes  # partials taken
    got = engine.generate(prompt, max_new_tokens=6)[0].token_ids
    assert got == ref.generate(prompt, max_new_tokens=6)[0].token_ids
