"""Pre-quantised GPTQ and AWQ checkpoints (core/loading/gptq.py): exact unpacking of the
public layouts, builds of checkpoints our own packer writes (core/testing/gptq_pack.py)
against HF with the dequantised weights, and the formats refused by name."""
import json

import pytest
import torch

from infergraft import core
from infergraft.core.errors import PlanError, WeightLoadError
from infergraft.core.loading.gptq import (PrequantFormat, QuantizedCheckpointError, convert,
                                          prequant_format, prequantized_tensors)
from infergraft.core.testing.gptq_pack import (dequantize, pack_awq, pack_gptq, rtn_int4,
                                               write_quantized)
from infergraft.core.testing.models import random_model, random_prompt, tiny_llama_config
from infergraft.core.testing.parity import assert_greedy_match, assert_logits_match
from infergraft.kernels.int4_linear import dequantize_float, unpack_nibbles


def _random_codes(n, k, group_size, seed=0):
    g = torch.Generator().manual_seed(seed)
    groups = -(-k // group_size)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    zeros = torch.randint(1, 16, (n, groups), generator=g, dtype=torch.uint8)
    scales = (torch.rand(n, groups, generator=g) * 0.1 + 0.01).half()
    return q, zeros, scales


@pytest.mark.parametrize("method,v1", [("gptq", True), ("gptq", False), ("awq", False)])
@pytest.mark.parametrize("n,k,group_size", [(64, 128, 32), (112, 64, 64), (24, 112, 32)])
def test_unpacking_is_exact(method, v1, n, k, group_size):
    q, zeros, scales = _random_codes(n, k, group_size)
    parts = pack_gptq(q, zeros, scales, group_size, v1) if method == "gptq" else \
        pack_awq(q, zeros, scales)
    pre = convert("model.layers.0.mlp.up_proj", parts,
                  PrequantFormat(method, group_size, int(method == "gptq" and v1)))
    assert pre.shape == (n, k)
    assert torch.equal(unpack_nibbles(pre.qweight, k), q)
    assert torch.equal(pre.zeros, zeros)
    assert torch.equal(pre.scales, scales.float())
    w = dequantize_float(pre.qweight, pre.scales, pre.zeros, group_size, k)
    assert torch.equal(w, dequantize(q, zeros, scales, group_size))
    packed = pre.to(dtype=torch.float16).int4()
    assert (packed.group_size, packed.in_features, packed.dtype) == (group_size, k, torch.float16)


def test_layouts_match_the_published_bit_order():
    # one int32 each: GPTQ packs K (row j of the int32's 8 in nibble j); AWQ packs N in
    # the order [0, 2, 4, 6, 1, 3, 5, 7]
    q = torch.arange(8, dtype=torch.uint8)[None, :].repeat(8, 1)  # q[n, k] = k
    gptq = pack_gptq(q, torch.full((8, 1), 8, dtype=torch.uint8),
                     torch.ones(8, 1).half(), 32)
    assert gptq["qweight"].shape == (1, 8) and int(gptq["qweight"][0, 0]) == 0x76543210
    assert int(gptq["qzeros"][0, 0]) == 0x77777777  # v1: zero 8 stored as 7
    awq = pack_awq(q.t().contiguous(), torch.arange(8, dtype=torch.uint8)[:, None],
                   torch.ones(8, 1).half())  # q[n, k] = n: each row of qweight is 0..7
    assert int(awq["qweight"][0, 0]) == 0x75316420
    assert int(awq["qzeros"][0, 0]) == 0x75316420


def _hf(seed=0):
    return random_model(tiny_llama_config(), seed=seed, scale=20.0)


@pytest.mark.parametrize("method,sym,v1", [("gptq", True, True), ("gptq", False, True),
                                           ("gptq", False, False), ("awq", False, False)])
def test_build_matches_hf_with_the_dequantised_weights(tmp_path, method, sym, v1):
    hf = _hf()
    ref = write_quantized(hf, tmp_path, method, group_size=32, sym=sym, v1=v1)
    engine = core.build(str(tmp_path), device="cpu", max_seq_len=128)
    assert engine.plan.quantizers == ("int4",)
    layer = engine.model.layers[0]
    assert type(layer.qkv).__name__ == "QuantizedLinear" and layer.qkv.packed.group_size == 32
    ids = random_prompt(12, 256, seed=1)
    assert_logits_match(engine, ref, ids)
    assert_greedy_match(engine, ref, ids, max_new_tokens=12)


def test_build_packs_each_layer_as_the_checkpoint_stores_it(tmp_path):
    hf = _hf()
    ref = write_quantized(hf, tmp_path, "awq", group_size=32)
    engine = core.build(str(tmp_path), device="cpu", max_seq_len=64)
    layer, hf_layer = engine.model.layers[1], ref.model.layers[1]
    want = torch.cat([hf_layer.mlp.gate_proj.weight, hf_layer.mlp.up_proj.weight])
    torch.testing.assert_close(layer.gate_up.quantizer.unpack(layer.gate_up.packed), want,
                               rtol=0, atol=0)


def _rewrite_config(path, **changes):
    file = path / "config.json"
    config = json.loads(file.read_text())
    config["quantization_config"].update(changes)
    file.write_text(json.dumps(config))


@pytest.mark.parametrize("method,change,named", [
    ("gptq", {"bits": 8}, "bits=8"),
    ("awq", {"bits": 3}, "bits=3"),
    ("awq", {"version": "gemv"}, "version='gemv'"),
    ("awq", {"version": "marlin"}, "version='marlin'"),
    ("awq", {"zero_point": False}, "zero_point=False"),
    ("gptq", {"checkpoint_format": "marlin"}, "checkpoint_format='marlin'"),
    ("gptq", {"group_size": -1}, "group_size=-1"),
    ("gptq", {"quant_method": "bitsandbytes"}, "quant_method='bitsandbytes'"),
    ("gptq", {"dynamic": {".*1.*": {"bits": 8}}}, "dynamic="),
])
def test_unsupported_settings_are_refused_by_name(tmp_path, method, change, named):
    write_quantized(_hf(), tmp_path, method, group_size=32)
    _rewrite_config(tmp_path, **change)
    with pytest.raises(QuantizedCheckpointError, match=named) as e:
        core.build(str(tmp_path), device="cpu", max_seq_len=64)
    assert "infergraft loads" in str(e.value)


def test_act_order_with_the_trivial_g_idx_loads(tmp_path):
    ref = write_quantized(_hf(), tmp_path, "gptq", group_size=32)
    _rewrite_config(tmp_path, desc_act=True)
    engine = core.build(str(tmp_path), device="cpu", max_seq_len=64)
    ids = random_prompt(8, 256, seed=2)
    assert_logits_match(engine, ref, ids)


def test_gptq_v1_zero_of_sixteen_is_refused():
    q, zeros, scales = _random_codes(8, 32, 32)
    zeros[3, 0] = 0  # v1 writes zero - 1 = -1: nibble 15, read back as 16
    parts = pack_gptq(q, zeros, scales, 32, v1=True)
    with pytest.raises(QuantizedCheckpointError, match="zero-point of 16"):
        convert("x.down_proj", parts, PrequantFormat("gptq", 32, 1))


def test_a_weight_quantizer_beside_a_prequantized_checkpoint_is_refused(tmp_path):
    write_quantized(_hf(), tmp_path, "gptq", group_size=32)
    with pytest.raises(PlanError, match="weight quantiser 'int8' cannot pack them"):
        core.build(str(tmp_path), plugins=["int8"], device="cpu", max_seq_len=64)
    with pytest.raises(PlanError, match="quantised in groups of 32; drop group_size"):
        core.build(str(tmp_path), device="cpu", max_seq_len=64, group_size=128)


def test_int4_named_explicitly_is_accepted(tmp_path):
    write_quantized(_hf(), tmp_path, "awq", group_size=64)
    engine = core.build(str(tmp_path), plugins=["int4"], device="cpu", max_seq_len=64)
    assert engine.plan.quantizers == ("int4",)
    assert engine.model.layers[0].o.packed.group_size == 64


def test_a_group_missing_a_tensor_is_named():
    q, zeros, scales = _random_codes(8, 32, 32)
    parts = pack_awq(q, zeros, scales)
    stream = [("m.q_proj.qweight", parts["qweight"]), ("m.q_proj.scales", parts["scales"])]
    with pytest.raises(WeightLoadError, match="lacks m.q_proj.qzeros"):
        list(prequantized_tensors(stream, PrequantFormat("awq", 32)))


def test_a_config_without_quantization_config_is_dense():
    assert prequant_format(tiny_llama_config()) is None


def test_plan_sizes_a_prequantized_checkpoint_as_its_build_does(tmp_path, capsys):
    import json

    from infergraft.core.cli import main

    hf = _hf()
    hf.save_pretrained(tmp_path / "dense")
    write_quantized(hf, tmp_path / "gptq", "gptq", group_size=32)
    plans = {}
    for name, gpu in (("dense", False), ("gptq", False), ("gptq", True)):
        flags = ["--device-memory", "80GiB"] if gpu else []  # a GPU's plan, here too
        assert main(["plan", str(tmp_path / name), "--json", *flags]) == 0
        plans[name, gpu] = json.loads(capsys.readouterr().out)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    built = core.build(str(tmp_path / "gptq"), dtype="float32", device=device).plan
    # on the CPU the projections' dequantised copies too (Quantizer.dense_on)
    assert plans["gptq", False]["weight_bytes"] == built.weight_bytes
    assert plans["gptq", True]["weight_bytes"] < plans["dense", False]["weight_bytes"]
    assert main(["plan", str(tmp_path / "gptq"), "--weights", "int8"]) == 2
    assert "give --weights int4 or leave it out" in capsys.readouterr().err
