"""GPTQ act-order checkpoints (``desc_act: true``, core/loading/prequantized.py): codes
stored in the columns' own order, each column's group in ``g_idx``. Loaded with the codes
reordered by group and the input gathered the same way; built against HF with the
dequantised weights; g_idx that cannot be grouped, and fused parts in different orders,
refused by name."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from infergraft import core
from infergraft.core.loading import packing
from infergraft.core.loading.gptq import PrequantFormat, QuantizedCheckpointError, convert
from infergraft.core.testing.gptq_pack import dequantize, pack_gptq, rtn_int4, write_quantized
from infergraft.core.testing.models import random_model, random_prompt, tiny_llama_config
from infergraft.core.testing.parity import assert_greedy_match, assert_logits_match
from infergraft.kernels._triton import HAVE_TRITON, interpreting
from infergraft.plugins.weight_int4 import WeightInt4

ATTN, MLP = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")


def act_order_parts(w: torch.Tensor, group_size: int, order: torch.Tensor):
    """GPTQ tensors of ``w`` [N, K] quantised in the column order ``order`` (as GPTQ's
    desc_act does), stored in the columns' own order; and the weight they stand for."""
    q, zeros, scales = rtn_int4(w[:, order], group_size, min_zero=1)  # in quantising order
    where = torch.argsort(order)  # column k was quantised at position where[k]
    parts = pack_gptq(q[:, where].contiguous(), zeros, scales, group_size)
    parts["g_idx"] = (where // group_size).to(torch.int32)
    return parts, dequantize(q, zeros, scales, group_size)[:, where]


def write_act_order(hf, path, group_size=32, seed=0, split_qkv=False):
    """``hf`` as an act-order GPTQ checkpoint: one random order per input (q, k and v
    share one, gate and up one; ``split_qkv``: k its own); returns the reference model
    holding the dequantised weights."""
    ref = write_quantized(hf, path, "gptq", group_size=group_size)  # dense parts, config
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["desc_act"] = True
    (path / "config.json").write_text(json.dumps(config))
    tensors, g = load_file(str(path / "model.safetensors")), torch.Generator().manual_seed(seed)
    for i, layer in enumerate(hf.model.layers):
        orders = {}
        for group, names in (("attn", ATTN), ("o", ("o_proj",)), ("mlp", MLP),
                             ("down", ("down_proj",))):
            for name in names:
                kind = "self_attn" if name in ATTN + ("o_proj",) else "mlp"
                module = f"model.layers.{i}.{kind}.{name}"
                w = hf.get_submodule(module).weight.detach()
                key = name if split_qkv and name == "k_proj" else group
                order = orders.setdefault(key, torch.randperm(w.shape[1], generator=g))
                parts, deq = act_order_parts(w, group_size, order)
                tensors.update({f"{module}.{p}": t.contiguous() for p, t in parts.items()})
                with torch.no_grad():
                    ref.get_submodule(module).weight.copy_(deq)
    save_file(tensors, str(path / "model.safetensors"))
    return ref


def test_act_order_codes_reordered_by_group_give_the_same_product():
    g = torch.Generator().manual_seed(1)
    w, order = torch.randn(24, 112, generator=g), torch.randperm(112, generator=g)
    parts, deq = act_order_parts(w, 32, order)  # 112 columns: 3.5 groups of 32
    pre = convert("m.down_proj", parts, PrequantFormat("gptq", 32, 1))
    assert pre.perm is not None and sorted(pre.perm.tolist()) == list(range(112))
    packed = pre.to(dtype=torch.float32).int4()
    quant = WeightInt4(32)
    torch.testing.assert_close(quant.unpack(packed), deq, rtol=0, atol=0)
    x = torch.randn(5, 112, generator=g)
    torch.testing.assert_close(quant.matmul(x, packed), x @ deq.t(), rtol=1e-5, atol=1e-5)
    assert quant.packed_bytes(packed) == packed.qweight.numel() + 5 * packed.scales.numel() \
        + 8 * 112  # nibbles, scale + zero a group, the order (int64)


def test_an_act_order_checkpoint_matches_hf_with_the_dequantised_weights(tmp_path):
    hf = random_model(tiny_llama_config(), seed=0, scale=20.0)
    ref = write_act_order(hf, tmp_path)
    engine = core.build(str(tmp_path), device="cpu", max_seq_len=128)
    assert engine.plan.quantizers == ("int4",)
    for layer in engine.model.layers:  # down's order lives in gate_up's rows (next test)
        assert all(getattr(layer, s).packed.perm is not None for s in ("qkv", "o", "gate_up"))
        assert layer.down.packed.perm is None
    ids = random_prompt(12, 256, seed=1)
    assert_logits_match(engine, ref, ids)
    assert_greedy_match(engine, ref, ids, max_new_tokens=12)


@pytest.mark.skipif(not (HAVE_TRITON and interpreting()), reason="needs TRITON_INTERPRET=1")
def test_down_needs_no_gather_its_order_folded_into_gate_up_rows(tmp_path, monkeypatch):
    """Each down projection's act order moves into gate_up's rows at load (gate's and up's
    alike): down's input then comes in its codes' order, no gather a step. Exact: on the
    Triton kernels (the packed path; the interpreter, float16) the same logits bit for bit
    as without the fold, and the same greedy tokens."""
    hf = random_model(tiny_llama_config(), seed=0, scale=20.0)
    write_act_order(hf, tmp_path)
    kw = dict(kernels="triton", dtype="float16", max_seq_len=64, max_batch_size=2)
    folded = core.build(str(tmp_path), **kw)
    monkeypatch.setattr(packing, "fold_act_orders", lambda layers: 0)
    kept = core.build(str(tmp_path), **kw)
    for a, b in zip(folded.model.layers, kept.model.layers):
        perm = b.down.packed.perm
        assert a.down.packed.perm is None and perm is not None
        assert torch.equal(a.down.packed.qweight, b.down.packed.qweight)
        i = perm.numel()
        rows = torch.cat([perm, perm + i])  # gate's rows, then up's, each in down's order
        for field in ("qweight", "scales", "zeros"):
            assert torch.equal(getattr(a.gate_up.packed, field),
                               getattr(b.gate_up.packed, field)[rows]), field
        assert torch.equal(a.gate_up.packed.perm, b.gate_up.packed.perm)
    ids = random_prompt(10, 256, seed=2)
    torch.testing.assert_close(folded.logits(ids), kept.logits(ids), rtol=0, atol=0)
    assert folded.generate(ids, max_new_tokens=4)[0].token_ids == \
        kept.generate(ids, max_new_tokens=4)[0].token_ids


def test_fused_parts_in_different_orders_are_refused(tmp_path):
    write_act_order(random_model(tiny_llama_config(), seed=0), tmp_path, split_qkv=True)
    with pytest.raises(QuantizedCheckpointError, match="different act orders"):
        core.build(str(tmp_path), device="cpu", max_seq_len=64)


def test_a_g_idx_that_cannot_be_grouped_is_refused(tmp_path):
    write_quantized(random_model(tiny_llama_config(), seed=0), tmp_path, "gptq", group_size=32)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    key = "model.layers.1.mlp.up_proj.g_idx"
    g_idx = tensors[key].clone()
    g_idx[0] = 1  # group 0 one column short, group 1 one over
    tensors[key] = g_idx
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(QuantizedCheckpointError,
                       match=r"up_proj.g_idx does not give each group 32 of the 64 input "
                             r"columns \(columns per group: \[31, 33\]\)"):
        core.build(str(tmp_path), device="cpu", max_seq_len=64)
