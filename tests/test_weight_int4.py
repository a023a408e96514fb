"""The int4 weight-only quantiser (``plugins=["int4"]``, W4A16 in groups): projections
packed as the checkpoint streams in, the engine equal to the float one on the dequantised
weights, the plan sized for int4, a bad group size refused, and the demo model's quality."""
import json

import pytest
import torch

from infergraft import core
from infergraft.core.cli import main
from infergraft.core.errors import PlanError
from infergraft.core.memory import weight_bytes
from infergraft.core.runner.model import QuantizedLinear
from infergraft.core.testing.gptq_pack import write_quantized
from infergraft.core.testing.models import (random_model, random_prompt, tiny_llama_config,
                                            with_random_norm_weights)
from infergraft.core.testing.parity import relative_error
from infergraft.core.testing.quant_kit import QuantizerTests
from infergraft.kernels import int4_linear
from infergraft.kernels._triton import HAVE_TRITON, interpreting
from infergraft.kernels.int4_linear import Int4Weight, dequantize_int4, quantize_int4
from infergraft.plugins.weight_int4 import WeightInt4

from demo_support import demo_answer, demo_engine, float_reference

KW = dict(max_seq_len=64, max_batch_size=2)
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class TestBuiltinInt4(QuantizerTests):
    """The conformance kit, on the built-in quantiser (groups of 128)."""

    @pytest.fixture
    def quantizer(self):
        return core.get_plugin_manager().quantizers().get("int4")


class TestInt4Groups32(QuantizerTests):
    """Again with groups of 32: every kit weight (up to 96 columns) has several groups."""

    @pytest.fixture
    def quantizer(self):
        return WeightInt4(group_size=32)


def _dequantised_copy(hf, group_size):
    """``hf`` with every projection replaced by its int4 round trip: what the int4
    engine's weights stand for (rows are independent, so quantising q, k and v apart
    equals quantising the fused qkv; the same for gate and up)."""
    copy = random_model(hf.config, seed=0)
    copy.load_state_dict(hf.state_dict())
    with torch.no_grad():
        for layer in copy.model.layers:
            for name in PROJ:
                mod = getattr(layer.self_attn, name, None) or getattr(layer.mlp, name)
                mod.weight.copy_(dequantize_int4(quantize_int4(mod.weight, group_size)))
    return copy


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_engine_equals_the_float_engine_on_dequantised_weights(group_size):
    # hidden 96: two groups of 64 are 1.5 (a partial last one), 128 is one partial group
    hf = random_model(tiny_llama_config(hidden_size=96, intermediate_size=160), seed=3,
                      scale=2.0)
    opts = {} if group_size == 128 else {"group_size": group_size}
    engine = core.build(hf, plugins=["paged", "int4"], **KW, **opts)
    ref = core.build(_dequantised_copy(hf, group_size), plugins=["paged"], **KW)
    plain = core.build(hf, plugins=["paged"], **KW)
    assert engine.plan.quantizers == ("int4",)
    for layer in engine.model.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            lin = getattr(layer, name)
            assert isinstance(lin, QuantizedLinear) and isinstance(lin.packed, Int4Weight)
            assert lin.packed.group_size == group_size and lin.scaled_rows() is None
    assert not any(layer.fusable() for layer in engine.model.layers)
    prompt = random_prompt(12, hf.config.vocab_size, 1)
    got, want = engine.logits(prompt).float(), ref.logits(prompt).float()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert relative_error(got, plain.logits(prompt).float()) > 1e-3  # really quantised
    assert engine.generate(prompt, max_new_tokens=8)[0].token_ids == \
        ref.generate(prompt, max_new_tokens=8)[0].token_ids


@pytest.mark.parametrize("source", ["rtn", "gptq"])
def test_on_the_cpu_each_projection_is_dequantised_once_as_it_loads(tmp_path, monkeypatch,
                                                                    source):
    """Not at every call, as the reference op does (a token then took many times
    float32's): the dequantised weight is kept beside the packed form, from our quantiser
    or a GPTQ checkpoint alike, and the dense GEMM reads it."""
    hf = random_model(tiny_llama_config(hidden_size=96, intermediate_size=160), seed=4,
                      scale=2.0)
    if source == "rtn":
        engine = core.build(hf, plugins=["paged", "int4"], group_size=32, **KW)
    else:
        write_quantized(hf, tmp_path, "gptq", group_size=32)
        engine = core.build(str(tmp_path), **KW)
    assert engine.plan.quantizers == ("int4",)
    for layer in engine.model.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            lin = getattr(layer, name)
            assert isinstance(lin.packed, Int4Weight) and lin.packed.group_size == 32
            assert lin.dense.dtype == torch.float32
            assert torch.equal(lin.dense, lin.quantizer.unpack(lin.packed))
    unpacked = []
    real = int4_linear.dequantize_float
    monkeypatch.setattr(int4_linear, "dequantize_float",
                        lambda *a: unpacked.append(a[0].shape) or real(*a))
    prompt = random_prompt(9, hf.config.vocab_size, 3)
    assert len(engine.generate(prompt, max_new_tokens=4)[0].token_ids) == 4
    assert unpacked == []


def test_bad_group_size_is_refused_naming_the_accepted_ones():
    hf = random_model(tiny_llama_config(), seed=1)
    for bad in (100, 256, True, "128"):
        with pytest.raises(PlanError, match="group_size=.* is not accepted; choose one of "
                                            "32, 64, 128"):
            core.build(hf, plugins=["int4"], group_size=bad, **KW)
    with pytest.raises(PlanError, match="unknown option"):
        core.build(hf, plugins=["int8"], group_size=64, **KW)  # int8 has no groups


def test_plan_counts_the_packed_bytes(tmp_path, capsys):
    # 576 columns (the demo model's hidden size): 4.5 groups of 128, so 5 per row
    cfg = tiny_llama_config(hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                            num_key_value_heads=3, torch_dtype="float16")
    cfg.save_pretrained(tmp_path)
    q = WeightInt4()
    assert q.packed_bytes_of((640, 576), 2) == 640 * 288 + 640 * 5 * 5
    assert q.packed_bytes_of((576, 1536), 2) == 576 * 768 + 576 * 12 * 5
    assert WeightInt4(32).packed_bytes_of((10, 100), 2) == 10 * 50 + 10 * 4 * 5
    for w in (torch.randn(640, 576), torch.randn(9, 101)):
        assert q.packed_bytes(q.pack(w)) == q.packed_bytes_of(tuple(w.shape), 4)
    gpu = ["--device-memory", "80GiB"]  # a GPU's plan, here too
    assert main(["plan", str(tmp_path), "--json", *gpu]) == 0
    dense = json.loads(capsys.readouterr().out)["weight_bytes"]
    assert main(["plan", str(tmp_path), "--weights", "int4", "--json", *gpu]) == 0
    got = json.loads(capsys.readouterr().out)["weight_bytes"]
    layer = [(576 + 2 * 192, 576), (576, 576), (2 * 1536, 576), (576, 1536)]  # qkv o gu down
    packed = sum(q.packed_bytes_of(s, 2) for s in layer) * cfg.num_hidden_layers
    elements = sum(r * c for r, c in layer) * cfg.num_hidden_layers
    assert got == dense - 2 * elements + packed
    assert main(["plan", str(tmp_path), "--weights", "int4", *gpu]) == 0
    out = capsys.readouterr().out
    assert "weights" in out and "int4 on the CPU" not in out
    if not torch.cuda.is_available():  # this host's CPU: the dequantised copies as well
        assert main(["plan", str(tmp_path), "--weights", "int4", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["weight_bytes"] == dense + packed
        assert main(["plan", str(tmp_path), "--weights", "int4"]) == 0
        assert "int4 on the CPU" in capsys.readouterr().out
    # the engine holds what the plan counts
    hf = random_model(tiny_llama_config(hidden_size=96, intermediate_size=160), seed=2)
    engine = core.build(hf, plugins=["int4"], group_size=64, **KW)
    held = sum(b.numel() * b.element_size() for b in engine.model.buffers() if b is not None) \
        + sum(m.quantizer.packed_bytes(m.packed) for m in engine.model.modules()
              if isinstance(m, QuantizedLinear))
    assert engine.plan.weight_bytes == held


@pytest.mark.skipif(not (HAVE_TRITON and interpreting()), reason="needs TRITON_INTERPRET=1")
def test_triton_kernel_in_the_model_matches_the_reference_ops():
    hf = random_model(tiny_llama_config(hidden_size=96, intermediate_size=160), seed=5,
                      scale=2.0)
    kw = dict(KW, dtype="float16")
    ref = core.build(hf, plugins=["int4"], group_size=64, kernels="torch", **kw)
    engine = core.build(hf, plugins=["int4"], group_size=64, kernels="triton", **kw)
    prompt = random_prompt(9, hf.config.vocab_size, 2)
    assert relative_error(engine.logits(prompt).float(), ref.logits(prompt).float()) < 5e-3
    assert engine.generate(prompt, max_new_tokens=5)[0].token_ids == \
        ref.generate(prompt, max_new_tokens=5)[0].token_ids


@pytest.mark.skipif(not (HAVE_TRITON and interpreting()), reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("fused", ["0", "1"])
def test_where_the_fused_layer_runs_no_norm_folds_into_int4(monkeypatch, fused):
    """Triton ops, fp16: the plain layer (the default) or, with INFERGRAFT_INT4_FUSED=1,
    the fused decode layer (its int4 GEMMs apply the norm weights as they load x:
    test_fused_decode_int4.py) runs, on projections packed from W as loaded and the norms
    as loaded: folding g into W g first would widen each group by the norm's outliers (on
    SmolLM2 it takes int4-g128's perplexity ratio from 1.40 to 1.86)."""
    if fused == "1":
        monkeypatch.setenv("INFERGRAFT_INT4_FUSED", fused)
    hf = with_random_norm_weights(random_model(
        tiny_llama_config(hidden_size=96, intermediate_size=160), seed=6, dtype=torch.float16))
    kw = dict(KW, dtype="float16")
    plain = core.build(hf, kernels="torch", **kw)
    engine = core.build(hf, plugins=["int4"], group_size=32, kernels="triton", **kw)
    assert engine.model._fused(1) is (fused == "1")  # no norm folded either way
    q = WeightInt4(32)
    for a, b in zip(plain.model.layers, engine.model.layers):
        assert b.folded_norms == frozenset()
        for proj in ("qkv", "o", "gate_up", "down"):
            got, want = getattr(b, proj).packed, q.pack(getattr(a, proj).weight)
            for field in ("qweight", "scales", "zeros"):
                assert torch.equal(getattr(got, field), getattr(want, field)), (proj, field)
        for norm in ("attn_norm", "mlp_norm"):
            assert torch.equal(getattr(b, norm).weight, getattr(a, norm).weight)


@pytest.mark.slow
def test_demo_model_with_int4_weights_answers_paris_in_a_third_of_the_bytes():
    engine = demo_engine(["paged", "int4"])
    answer = demo_answer(engine)
    assert "Paris" in answer, answer
    dense = float_reference()[2]  # float32
    # the packed form alone, as a GPU holds it (the CPU keeps the dequantised copy too)
    quantizer = engine.model.layers[0].qkv.quantizer
    assert weight_bytes(engine.spec, torch.float32, quantizer, "cuda") < 0.35 * dense
    assert engine.plan.weight_bytes > dense
