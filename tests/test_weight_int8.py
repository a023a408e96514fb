"""The int8 weight-only quantiser (``plugins=["int8"]``): projections packed as the
checkpoint streams in, the plan sized for int8, outputs close to the unquantised engine's
(the torch reference on the CPU, and the Triton kernel in the interpreter)."""
import attrs
import pytest
import torch

from infergraft import core
from infergraft.core.build import _weight_quantizer
from infergraft.core.errors import PlanError
from infergraft.core.testing.models import (random_model, random_prompt, tiny_gpt2_config,
                                            tiny_llama_config, with_random_norm_weights)
from infergraft.core.testing.parity import relative_error
from infergraft.kernels._triton import HAVE_TRITON, interpreting
from infergraft.core.runner.model import QuantizedLinear
from infergraft.core.testing.quant_kit import QuantizerTests
from infergraft.plugins.weight_int8 import WeightInt8

KW = dict(max_seq_len=64, max_batch_size=2)
PROJECTIONS = ("qkv", "o", "down")


def _weight_bytes(engine):
    """What the model holds: its buffers plus every packed projection."""
    packed = [m for m in engine.model.modules() if isinstance(m, QuantizedLinear)]
    return sum(b.numel() * b.element_size() for b in engine.model.buffers() if b is not None) \
        + sum(m.quantizer.packed_bytes(m.packed) for m in packed)


class TestBuiltinInt8(QuantizerTests):
    """The conformance kit, on the built-in quantiser."""

    @pytest.fixture
    def quantizer(self):
        return core.get_plugin_manager().quantizers().get("int8")


@pytest.mark.parametrize("config", [tiny_llama_config, tiny_gpt2_config])
def test_int8_engine_is_close_to_the_float_one(config):
    hf = random_model(config(), seed=3, scale=2.0)
    ref = core.build(hf, **KW)
    engine = core.build(hf, plugins=["paged", "int8"], **KW)
    assert engine.plan.quantizers == ("int8",)
    for layer in engine.model.layers:
        for name in PROJECTIONS + (("gate_up",) if hasattr(layer, "gate_up") else ("fc_in",)):
            lin = getattr(layer, name)
            assert isinstance(lin, QuantizedLinear) and lin.packed.q.dtype == torch.int8
    # the plan counts what is held: int8 projections + a float32 scale per row, the rest as is
    assert engine.plan.weight_bytes == _weight_bytes(engine) < 0.6 * ref.plan.weight_bytes
    prompt = random_prompt(12, hf.config.vocab_size, 1)
    err = relative_error(engine.logits(prompt).float(), ref.logits(prompt).float())
    assert 0 < err < 3e-2, err  # quantised (not the float weights), and close
    got = engine.generate(prompt, max_new_tokens=8)[0].token_ids
    assert got[:4] == ref.generate(prompt, max_new_tokens=8)[0].token_ids[:4]


def test_biases_survive_packing_and_the_dequantised_weights_are_within_half_a_step():
    hf = random_model(tiny_gpt2_config(), seed=4)  # c_attn / c_fc carry biases
    ref, engine = core.build(hf, **KW), core.build(hf, plugins=["int8"], **KW)
    for a, b in zip(ref.model.layers, engine.model.layers):
        for name in PROJECTIONS + ("fc_in",):
            plain, packed = getattr(a, name), getattr(b, name)
            assert torch.equal(packed.bias, plain.bias)
            dequant = packed.packed.q.float() * packed.packed.scale[:, None]
            step = packed.packed.scale[:, None]
            assert bool(((dequant - plain.weight.float()).abs() <= step / 2 + 1e-7).all())


@pytest.mark.skipif(not (HAVE_TRITON and interpreting()), reason="needs TRITON_INTERPRET=1")
def test_triton_kernel_in_the_model_matches_the_reference_ops():
    hf = random_model(tiny_llama_config(hidden_size=128, intermediate_size=128), seed=5,
                      scale=2.0)
    kw = dict(KW, dtype="float16")
    ref = core.build(hf, plugins=["int8"], kernels="torch", **kw)
    engine = core.build(hf, plugins=["int8"], kernels="triton", **kw)
    # the fused decode layer on int8 rows (HF's norm weights are ones here: folding them
    # before packing leaves the same int8 values as the reference's)
    assert engine.model.norms_folded and engine.model._fused(1)
    prompt = random_prompt(9, hf.config.vocab_size, 2)
    assert relative_error(engine.logits(prompt).float(), ref.logits(prompt).float()) < 5e-3
    assert engine.generate(prompt, max_new_tokens=5)[0].token_ids == \
        ref.generate(prompt, max_new_tokens=5)[0].token_ids


@pytest.mark.parametrize("order", ["checkpoint", "norms-first", "shuffled"])
def test_norm_weights_fold_in_before_packing(monkeypatch, order):
    """Where the fused layer will run, qkv / gate_up are packed from W g (g the RMSNorm
    weight that feeds them), in whichever order the checkpoint delivers the two; o and
    down as loaded; the norms are ones after loading."""
    import importlib

    B = importlib.import_module("infergraft.core.build")  # core.build is also the function

    hf = with_random_norm_weights(random_model(tiny_llama_config(), seed=6, dtype=torch.float16))
    kw = dict(KW, dtype="float16", device="cpu")
    if order != "checkpoint":
        real = B.resolve_source

        def reordered_source(model, tokenizer=None, checkpoint=None, **kw):
            src = real(model, tokenizer, checkpoint=checkpoint, **kw)  # kw: revision=
            items = list(src.tensors())
            if order == "shuffled":
                perm = torch.randperm(len(items), generator=torch.Generator().manual_seed(1))
                items = [items[i] for i in perm]
            else:
                items.sort(key=lambda kv: "norm" not in kv[0])  # stable: norms, then the rest
            return attrs.evolve(src, tensors=lambda: iter(items))
        monkeypatch.setattr(B, "resolve_source", reordered_source)
    plain = core.build(hf, kernels="torch", **kw)  # never fuses: packs W as loaded
    fused = core.build(hf, plugins=["int8"], kernels="torch", **kw)
    assert not fused.model.norms_folded  # torch ops: no fused layer, nothing folded
    if not (HAVE_TRITON and interpreting()):
        return
    fused = core.build(hf, plugins=["int8"], kernels="triton", **kw)
    assert fused.model.norms_folded
    q = WeightInt8()
    for a, b in zip(plain.model.layers, fused.model.layers):
        for norm, proj in (("attn_norm", "qkv"), ("mlp_norm", "gate_up")):
            want = q.pack(getattr(a, proj).weight * getattr(a, norm).weight[None, :])
            got = getattr(b, proj).packed
            assert torch.equal(got.q, want.q) and torch.equal(got.scale, want.scale), proj
            assert torch.equal(getattr(b, norm).weight, torch.ones_like(getattr(a, norm).weight))
        for proj in ("o", "down"):
            assert torch.equal(getattr(b, proj).packed.q, q.pack(getattr(a, proj).weight).q)
    prompt = random_prompt(9, hf.config.vocab_size, 3)
    ref = core.build(hf, plugins=["int8"], kernels="torch", **kw)  # W packed unfolded
    err = relative_error(fused.logits(prompt).float(), ref.logits(prompt).float())
    assert err < 3e-2, err  # another int8 rounding of the same model, not another model


def test_one_weight_quantizer_at_most():
    class Other(WeightInt8):
        name = "int4"
    assert _weight_quantizer([]) is None
    with pytest.raises(PlanError, match="two weight quantizers, 'int8' and 'int4'"):
        _weight_quantizer([WeightInt8(), Other()])


@pytest.mark.slow
def test_demo_model_perplexity_with_int8_weights_within_one_percent():
    """Real weights (SmolLM2-135M): int8 projections cost < 1% perplexity on English text
    (measured 11.560 -> 11.587) and hold < 45% of the float32 weight bytes."""
    from demo_support import demo_engine, float_reference, perplexity

    ids, p_float, float_bytes = float_reference()
    engine = demo_engine(["paged", "int8"])
    ppl, plans = [p_float, perplexity(engine, ids)], [float_bytes, engine.plan.weight_bytes]
    print(f"perplexity over {len(ids)} tokens: float {ppl[0]:.4f}, int8 weights {ppl[1]:.4f}")
    assert 1.0 < ppl[0] < 100.0 and ppl[1] != ppl[0]
    assert abs(ppl[1] - ppl[0]) / ppl[0] < 0.01
    assert plans[1] < 0.45 * plans[0]


def test_a_plugin_still_naming_the_hook_int8_rows_is_warned_and_keeps_the_fused_layer():
    from infergraft.core.quant import Quantizer

    with pytest.warns(DeprecationWarning, match=r"OldRows.int8_rows is now called scaled_rows"):
        class OldRows(Quantizer):
            def int8_rows(self, packed):
                return packed
    assert OldRows().scaled_rows("rows") == "rows"
    assert Quantizer().scaled_rows("rows") is None
