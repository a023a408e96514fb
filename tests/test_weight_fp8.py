"""The fp8 weight quantiser (``plugins=["fp8"]``, e4m3 rows with a float32 scale each):
projections packed as the checkpoint streams in, the engine equal to the float one on the
dequantised weights, the fused decode layer on the e4m3 rows (Triton in the interpreter)
equal to the plain one's, the plan sized for fp8, the reference path warned about once,
bad options refused, and the demo model's quality (``slow``). The fused layer with norm
weights folded before packing: tests/test_fused_decode_model.py."""
import json
import warnings

import pytest
import torch

from infergraft import core
from infergraft.core.build import _weight_quantizer
from infergraft.core.cli import main
from infergraft.core.errors import PerformanceWarning, PlanError
from infergraft.core.memory import weight_bytes
from infergraft.core.runner.model import QuantizedLinear
from infergraft.core.testing.models import (random_model, random_prompt, tiny_gpt2_config,
                                            tiny_llama_config)
from infergraft.core.testing.parity import relative_error
from infergraft.core.testing.quant_kit import QuantizerTests
from infergraft.kernels import fp8_linear, gemv
from infergraft.kernels._triton import HAVE_TRITON, interpreting
from infergraft.kernels.fp8_linear import Fp8Weight, dequantize_fp8, quantize_fp8
from infergraft.plugins import weight_fp8
from infergraft.plugins.weight_fp8 import WeightFp8
from infergraft.plugins.weight_int8 import WeightInt8

from demo_support import demo_answer, demo_engine, float_reference, perplexity

KW = dict(max_seq_len=64, max_batch_size=2)
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
pytestmark = pytest.mark.filterwarnings("ignore::infergraft.core.errors.PerformanceWarning")


class TestBuiltinFp8(QuantizerTests):
    """The conformance kit, on the built-in quantiser."""

    @pytest.fixture
    def quantizer(self):
        return core.get_plugin_manager().quantizers().get("fp8")


def _held(engine):
    """What the model holds: its buffers plus every packed projection."""
    return sum(b.numel() * b.element_size() for b in engine.model.buffers() if b is not None) \
        + sum(m.quantizer.packed_bytes(m.packed) for m in engine.model.modules()
              if isinstance(m, QuantizedLinear))


def _dequantised_copy(hf, dtype=torch.float32):
    """``hf`` with every projection replaced by its fp8 round trip (rows are independent:
    q, k and v quantised apart equal the fused qkv quantised, as gate and up), from the
    weight in ``dtype``, as an engine of that dtype packs it."""
    copy = random_model(hf.config, seed=0)
    copy.load_state_dict(hf.state_dict())
    with torch.no_grad():
        for layer in copy.model.layers:
            for name in PROJ:
                mod = getattr(layer.self_attn, name, None) or getattr(layer.mlp, name)
                mod.weight.copy_(dequantize_fp8(*quantize_fp8(mod.weight.to(dtype))))
    return copy


def test_round_trip_error_per_element():
    """|q s - w| <= 2^-4 |w| where w / s is a normal e4m3 value, 2^-10 s in the subnormal
    tail; over a row, <= max|row| / 28 (the top binade's half step, 16 s)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 300, generator=g) * torch.logspace(-3, 2, 40)[:, None]
    w[3] = 0
    packed = WeightFp8().pack(w)
    assert isinstance(packed, Fp8Weight) and packed.q.dtype == torch.float8_e4m3fn
    err = (WeightFp8().unpack(packed) - w).abs()
    s = packed.scale[:, None]
    assert bool((err <= torch.maximum(w.abs() / 16, s / 1024) * (1 + 1e-5)).all())
    assert bool((err.amax(1) <= w.abs().amax(1) / 28 * 1.001).all())
    assert float(packed.scale[3]) == 1.0 and not err[3].any()


def test_fp8_engine_equals_the_float_engine_on_dequantised_weights():
    hf = random_model(tiny_llama_config(), seed=3, scale=2.0)
    engine = core.build(hf, plugins=["paged", "fp8"], **KW)
    ref = core.build(_dequantised_copy(hf), plugins=["paged"], **KW)
    plain = core.build(hf, plugins=["paged"], **KW)
    assert engine.plan.quantizers == ("fp8",)
    for layer in engine.model.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            lin = getattr(layer, name)
            assert isinstance(lin, QuantizedLinear) and isinstance(lin.packed, Fp8Weight)
            assert lin.packed.q.dtype == torch.float8_e4m3fn
            q, scale = lin.scaled_rows()  # what the fused decode GEMMs read
            assert q is lin.packed.q and scale is lin.packed.scale
    # the plan counts what is held: e4m3 projections + a float32 scale a row, the rest as
    # is; on the CPU each projection's dequantised copy too (the dense GEMM reads it), so
    # fp8's saving is a GPU's
    assert engine.plan.weight_bytes == _held(engine)
    on_gpu = weight_bytes(engine.spec, torch.float32, engine.model.layers[0].qkv.quantizer,
                          "cuda")
    assert on_gpu < 0.55 * plain.plan.weight_bytes < engine.plan.weight_bytes
    prompt = random_prompt(12, hf.config.vocab_size, 1)
    got, want = engine.logits(prompt).float(), ref.logits(prompt).float()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert relative_error(got, plain.logits(prompt).float()) > 1e-3  # really quantised
    assert engine.generate(prompt, max_new_tokens=8)[0].token_ids == \
        ref.generate(prompt, max_new_tokens=8)[0].token_ids


def test_on_the_cpu_each_projection_is_dequantised_once_as_it_loads(monkeypatch):
    """Not widened at every call (a token then took several times float32's): the
    dequantised weight is kept beside the e4m3 rows, and the dense GEMM reads it."""
    hf = random_model(tiny_llama_config(), seed=4, scale=2.0)
    engine = core.build(hf, plugins=["paged", "fp8"], **KW)
    for layer in engine.model.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            lin = getattr(layer, name)
            assert torch.equal(lin.dense, dequantize_fp8(lin.packed.q, lin.packed.scale))
    widened = []
    real = fp8_linear.int8_linear_cpu
    monkeypatch.setattr(fp8_linear, "int8_linear_cpu",
                        lambda *a, **k: widened.append(a[1].shape) or real(*a, **k))
    prompt = random_prompt(9, hf.config.vocab_size, 3)
    assert len(engine.generate(prompt, max_new_tokens=4)[0].token_ids) == 4
    assert widened == []


def test_biases_survive_packing_and_gpt2_stays_close_to_float():
    hf = random_model(tiny_gpt2_config(), seed=4)  # c_attn / c_fc carry biases
    ref, engine = core.build(hf, **KW), core.build(hf, plugins=["fp8"], **KW)
    for a, b in zip(ref.model.layers, engine.model.layers):
        for name in ("qkv", "o", "fc_in", "down"):
            plain, packed = getattr(a, name), getattr(b, name)
            assert torch.equal(packed.bias, plain.bias)
            assert torch.equal(packed.packed.q, quantize_fp8(plain.weight)[0])
    prompt = random_prompt(12, hf.config.vocab_size, 1)
    err = relative_error(engine.logits(prompt).float(), ref.logits(prompt).float())
    assert 0 < err < 5e-2, err


@pytest.mark.skipif(not (HAVE_TRITON and interpreting()), reason="needs TRITON_INTERPRET=1")
def test_triton_kernels_in_the_model_match_the_reference_ops(monkeypatch):
    """fp16 on the Triton ops: the fused decode layer on the e4m3 rows at every step (the
    9-token prefill and decode: <= fuse_max_rows rows; HF's norm weights are ones here, so
    folding them before packing leaves the reference's e4m3 values), and with
    INFERGRAFT_FUSE=0 the plain layer on the skinny e4m3 kernel, norms as loaded: each
    gives the reference ops' greedy tokens and close logits, as does the float engine on
    the dequantised weights."""
    hf = random_model(tiny_llama_config(hidden_size=128, intermediate_size=256), seed=5,
                      scale=2.0)
    kw = dict(KW, dtype="float16")
    ref = core.build(hf, plugins=["fp8"], kernels="torch", **kw)
    monkeypatch.delenv("INFERGRAFT_FUSE", raising=False)  # the default: the fused layer
    fused = core.build(hf, plugins=["fp8"], kernels="triton", **kw)
    monkeypatch.setenv("INFERGRAFT_FUSE", "0")
    plain = core.build(hf, plugins=["fp8"], kernels="triton", **kw)
    dequantised = core.build(_dequantised_copy(hf, torch.float16), kernels="torch", **kw)
    assert fused.model.norms_folded and fused.model._fused(9) and fused.model._fused(1)
    assert not plain.model.norms_folded and not plain.model._fused(1)
    prompt = random_prompt(9, hf.config.vocab_size, 2)
    logits, tokens = ref.logits(prompt).float(), ref.generate(prompt, max_new_tokens=5)[0].token_ids
    arms = (("fused", fused, False), ("fused, one row through the word loop", fused, True),
            ("plain", plain, False), ("dequantised", dequantised, False))
    for name, engine, words in arms:
        monkeypatch.setattr(gemv, "GEMV_FP8", words)  # INFERGRAFT_GEMV_FP8, read per launch
        err = relative_error(engine.logits(prompt).float(), logits)
        assert err < 5e-3, (name, err)
        assert engine.generate(prompt, max_new_tokens=5)[0].token_ids == tokens, name


def test_the_reference_path_is_warned_about_once(monkeypatch):
    monkeypatch.setattr(weight_fp8, "_warned", set())
    hf = random_model(tiny_llama_config(), seed=1)
    kw = dict(KW, device="cpu", kernels="torch")
    with pytest.warns(PerformanceWarning, match=r"quantizer 'fp8' runs its reference path "
                                                r"here \(torch kernels on cpu\)"):
        core.build(hf, plugins=["fp8"], **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PerformanceWarning)
        core.build(hf, plugins=["fp8"], **kw)  # once per device and process
        core.build(hf, plugins=["int8"], **kw)  # and never without fp8
    assert weight_fp8.fast_here("cpu", "triton") is False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available()
                    or torch.cuda.get_device_capability() < (8, 9), reason="needs CUDA sm_89+")
def test_gpu_paths_in_the_model_match_the_reference_ops(monkeypatch):
    """On a GPU with fp8, no warning; fp16: the skinny e4m3 kernel at every step equals the
    reference ops' model (dequantised weights, float GEMMs); bf16 prompts above 64 tokens
    run W8A8 (x rounded to e4m3 per token): close, not equal."""
    monkeypatch.setattr(weight_fp8, "_warned", set())
    hf = random_model(tiny_llama_config(hidden_size=128, intermediate_size=256), seed=7,
                      scale=2.0)
    kw = dict(KW, device="cuda", max_seq_len=256)
    # bf16 at 100 tokens: x rounded to e4m3 per token (up to 2^-4 of each value; measured
    # 0.073 of the largest logit on the H200), which the reference does not do
    for dtype, n, tol in (("float16", 9, 5e-3), ("bfloat16", 100, 0.12)):
        with warnings.catch_warnings():
            warnings.simplefilter("error", PerformanceWarning)
            engine = core.build(hf, plugins=["paged", "fp8"], dtype=dtype, **kw)
        # the reference ops sync (they drop padding rows by mask): no graphs for them
        ref = core.build(hf, plugins=["paged", "fp8"], kernels="torch", dtype=dtype,
                         cuda_graphs=False, **kw)
        prompt = random_prompt(n, hf.config.vocab_size, 3)
        err = relative_error(engine.logits(prompt).float(), ref.logits(prompt).float())
        assert err < tol, (dtype, err)
        if dtype == "float16":
            assert engine.generate(prompt, max_new_tokens=8)[0].token_ids == \
                ref.generate(prompt, max_new_tokens=8)[0].token_ids


def test_bad_options_and_two_weight_quantizers_are_refused():
    hf = random_model(tiny_llama_config(), seed=1)
    with pytest.raises(PlanError, match=r"unknown option\(s\) \['group_size'\]"):
        core.build(hf, plugins=["fp8"], group_size=64, **KW)  # fp8 has no options
    with pytest.raises(PlanError, match="two weight quantizers, 'fp8' and 'int8'"):
        _weight_quantizer([WeightFp8(), WeightInt8()])
    with pytest.raises(PlanError, match="two weight quantizers"):
        core.build(hf, plugins=["int8", "fp8"], **KW)


def test_plan_counts_the_packed_bytes(tmp_path, capsys):
    """``infergraft plan --weights fp8``: LLaMA-2-7B's 32 layers of projections (qkv 12288,
    o 4096, gate_up 22016, down 4096 rows) at a byte + a float32 scale a row, embeddings,
    lm_head and norms at 2 bytes; printed as a table too."""
    tiny_llama_config(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                      max_position_embeddings=4096).save_pretrained(tmp_path)
    gpu = ["--device-memory", "80GiB"]  # a GPU's plan, here too
    assert main(["plan", str(tmp_path), "--dtype", "float16", "--weights", "fp8",
                 "--max-seq-len", "2048", "--json", *gpu]) == 0
    packed = 32 * (12288 * 4096 + 4096 * 4096 + 22016 * 4096 + 4096 * 11008)
    rows = 32 * (12288 + 4096 + 22016 + 4096)
    want = packed + 4 * rows + 2 * (6_738_415_616 - packed)
    assert json.loads(capsys.readouterr().out)["weight_bytes"] == want == 7_006_265_344
    assert main(["plan", str(tmp_path), "--dtype", "float16", "--weights", "fp8"]) in (0, 1)
    out = capsys.readouterr().out
    assert "weights" in out
    if not torch.cuda.is_available():  # this host's CPU: each projection's float16 copy too
        assert "fp8 on the CPU" in out
        assert main(["plan", str(tmp_path), "--dtype", "float16", "--weights", "fp8",
                     "--max-seq-len", "2048", "--json"]) in (0, 1)
        assert json.loads(capsys.readouterr().out)["weight_bytes"] == want + 2 * packed
    q = WeightFp8()
    for w in (torch.randn(640, 576), torch.randn(9, 101)):
        assert q.packed_bytes(q.pack(w)) == q.packed_bytes_of(tuple(w.shape), 4)


@pytest.mark.slow
def test_demo_model_perplexity_with_fp8_weights_within_two_percent():
    """Real weights (SmolLM2-135M) on English text, 2048 tokens of pydoc's topics: the
    ratio of fp8's perplexity to float's <= 1.02, in < 45% of the float32 weight bytes."""
    ids, p_float, float_bytes = float_reference()
    engine = demo_engine(["paged", "fp8"])
    # the packed form alone, as a GPU holds it (the CPU keeps the dequantised copy too)
    on_gpu = weight_bytes(engine.spec, torch.float32, engine.model.layers[0].qkv.quantizer,
                          "cuda")
    ppl, plans = [p_float, perplexity(engine, ids)], [float_bytes, on_gpu]
    print(f"perplexity over {len(ids)} tokens: float {ppl[0]:.4f}, fp8 weights {ppl[1]:.4f} "
          f"(ratio {ppl[1] / ppl[0]:.4f}); weight bytes {plans[1]} vs {plans[0]}")
    assert 1.0 < ppl[0] < 100.0 and ppl[1] != ppl[0]
    assert ppl[1] / ppl[0] <= 1.02
    assert plans[1] < 0.45 * plans[0]


@pytest.mark.slow
def test_demo_model_with_fp8_weights_answers_paris():
    answer = demo_answer(demo_engine(["paged", "fp8"]))
    print(f"fp8 answer: {answer!r}")
    assert "Paris" in answer, answer
