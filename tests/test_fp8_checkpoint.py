"""Checkpoints already in fp8 (core/loading/fp8_checkpoint.py): builds of checkpoints our
own writer makes (core/testing/fp8_pack.py), per tensor and per channel, against HF with
the dequantised weights; the static activation scheme warned about; the forms refused by
name; and ``infergraft plan`` on such a checkpoint."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from infergraft import core
from infergraft.core.cli import main
from infergraft.core.errors import ConfigWarning, PlanError, QuantizedCheckpointError
from infergraft.core.loading.fp8_checkpoint import Fp8Format, fp8_tensors
from infergraft.core.runner.model import QuantizedLinear
from infergraft.core.testing.fp8_pack import dequantize, quantize, write_fp8
from infergraft.core.testing.models import random_model, random_prompt, tiny_llama_config
from infergraft.core.testing.parity import assert_greedy_match, assert_logits_match
from infergraft.kernels.fp8_linear import Fp8Weight

pytestmark = pytest.mark.filterwarnings("ignore::infergraft.core.errors.PerformanceWarning")
KW = dict(device="cpu", max_seq_len=64)


def _hf(seed=0):
    return random_model(tiny_llama_config(), seed=seed, scale=20.0)


@pytest.mark.parametrize("scales", ["channel", "channel2d", "tensor", "tensor1"])
def test_build_matches_hf_with_the_dequantised_weights(tmp_path, scales):
    ref = write_fp8(_hf(), tmp_path, scales)
    engine = core.build(str(tmp_path), max_seq_len=128, device="cpu")
    assert engine.plan.quantizers == ("fp8",)
    layer, hf_layer = engine.model.layers[1], ref.model.layers[1]
    assert isinstance(layer.qkv, QuantizedLinear) and isinstance(layer.qkv.packed, Fp8Weight)
    want = torch.cat([hf_layer.self_attn.q_proj.weight, hf_layer.self_attn.k_proj.weight,
                      hf_layer.self_attn.v_proj.weight])
    torch.testing.assert_close(layer.qkv.quantizer.unpack(layer.qkv.packed), want,
                               rtol=0, atol=0)
    ids = random_prompt(12, 256, seed=1)
    assert_logits_match(engine, ref, ids)
    assert_greedy_match(engine, ref, ids, max_new_tokens=12)


def test_per_tensor_scales_give_every_row_the_scale_of_its_part(tmp_path):
    write_fp8(_hf(), tmp_path, "tensor")
    engine = core.build(str(tmp_path), **KW)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    scale = engine.model.layers[0].qkv.packed.scale  # q 64 rows, k 32, v 32
    for part, rows in (("q_proj", slice(0, 64)), ("k_proj", slice(64, 96)),
                       ("v_proj", slice(96, 128))):
        want = tensors[f"model.layers.0.self_attn.{part}.weight_scale"]
        assert torch.equal(scale[rows], want.expand(rows.stop - rows.start))


def test_static_activation_scales_are_ignored_with_a_warning(tmp_path):
    ref = write_fp8(_hf(), tmp_path, "tensor", activation_scheme="static")
    assert "model.layers.0.mlp.down_proj.input_scale" in load_file(
        str(tmp_path / "model.safetensors"))
    with pytest.warns(ConfigWarning, match="activation_scheme='static': the checkpoint's "
                                           "input_scale tensors are ignored"):
        engine = core.build(str(tmp_path), **KW)
    assert_logits_match(engine, ref, random_prompt(8, 256, seed=2))


def _rewrite_config(path, **changes):
    file = path / "config.json"
    config = json.loads(file.read_text())
    config["quantization_config"].update(changes)
    file.write_text(json.dumps(config))


@pytest.mark.parametrize("change,named", [
    ({"weight_block_size": [128, 128]}, r"weight_block_size=\[128, 128\]"),
    ({"fmt": "e5m2"}, "fmt='e5m2'"),
    ({"activation_scheme": "per_group"}, "activation_scheme='per_group'"),
    ({"ignored_layers": ["lm_head", "model.layers.0.mlp.down_proj"]}, "ignored_layers="),
    ({"modules_to_not_convert": ["model.layers.1.self_attn.q_proj"]}, "modules_to_not_convert="),
    ({"kv_cache_scheme": {"num_bits": 8, "type": "float"}}, "kv_cache_scheme="),
])
def test_unsupported_settings_are_refused_by_name(tmp_path, change, named):
    write_fp8(_hf(), tmp_path)
    _rewrite_config(tmp_path, **change)
    with pytest.raises(QuantizedCheckpointError, match=named) as e:
        core.build(str(tmp_path), **KW)
    assert "infergraft loads fp8 checkpoints with e4m3 weights" in str(e.value)


def _rewrite_tensors(path, edit):
    file = str(path / "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)


KEY = "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("edit,named", [
    (lambda t: t.update({f"{KEY}.weight_scale_inv": t.pop(f"{KEY}.weight_scale")}),
     r"q_proj.weight_scale_inv: a block-wise scale"),
    (lambda t: t.update({f"{KEY}.weight_scale": torch.ones(64, 2)}),
     r"q_proj.weight_scale is \(64, 2\); infergraft loads a per-tensor"),
    (lambda t: t.update({f"{KEY}.weight": t[f"{KEY}.weight"].to(torch.float8_e5m2)}),
     "q_proj.weight is float8_e5m2"),
    (lambda t: t.pop(f"{KEY}.weight_scale"), r"lacks model.layers.0.self_attn.q_proj.weight_s"),
])
def test_tensors_the_format_cannot_hold_are_refused_by_key(tmp_path, edit, named):
    write_fp8(_hf(), tmp_path)
    _rewrite_tensors(tmp_path, edit)
    with pytest.raises(core.WeightLoadError, match=named):
        core.build(str(tmp_path), **KW)


def test_the_stream_pairs_weights_with_scales_in_either_order():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 32, generator=g)
    q, s = quantize(w, "channel")
    norm = torch.ones(32)
    for items in ([("a.weight", q), ("a.weight_scale", s), ("n.weight", norm)],
                  [("a.input_scale", torch.tensor(1.0)), ("a.weight_scale", s), ("n.weight", norm),
                   ("a.weight", q)]):
        out = dict(fp8_tensors(iter(items), Fp8Format()))
        assert set(out) == {"a.weight", "n.weight"} and out["n.weight"] is norm
        assert out["a.weight"].shape == (16, 32) and torch.equal(out["a.weight"].scale, s)
        assert torch.equal(dequantize(out["a.weight"].q, s), dequantize(q, s))


def test_another_weight_quantizer_beside_an_fp8_checkpoint_is_refused(tmp_path):
    write_fp8(_hf(), tmp_path)
    with pytest.raises(PlanError, match="pre-quantised \\(fp8, e4m3\\).*weight quantiser "
                                        "'int8' cannot pack them"):
        core.build(str(tmp_path), plugins=["int8"], **KW)
    assert core.build(str(tmp_path), plugins=["fp8"], **KW).plan.quantizers == ("fp8",)


def test_plan_of_an_fp8_checkpoint_counts_its_packed_bytes(tmp_path, capsys):
    write_fp8(_hf(), tmp_path)
    engine = core.build(str(tmp_path), **KW)
    assert main(["plan", str(tmp_path), "--max-seq-len", "64", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["weight_bytes"] == engine.plan.weight_bytes
    assert main(["plan", str(tmp_path), "--weights", "int8"]) == 2
    assert "give --weights fp8 or leave it out" in capsys.readouterr().err
