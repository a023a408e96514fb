"""``infergraft quantize`` (core/quantize/): GPTQ's error against round to nearest on a
layer with correlated inputs, the staged layer forward against HF's, tiny models written by
the tool and built from the written directory against HF with the weights the checkpoint
holds, the CLI and its refusals, and (slow) the demo model's perplexity."""
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from infergraft import core
from infergraft.core.cli import main
from infergraft.core.errors import QuantizeError
from infergraft.core.loading.gptq import PrequantFormat, convert
from infergraft.core.loading.source import ModelSourceError
from infergraft.core.quantize import quantize_model
from infergraft.core.quantize.calibration import EVAL_TOPICS, calibration_ids, calibration_texts
from infergraft.core.quantize.gptq import Hessian, gptq_quantize
from infergraft.core.quantize.pack import dequantize, int4_grid, rtn_int4
from infergraft.core.quantize.sequential import first_layer_inputs, run_layer
from infergraft.core.testing.models import (byte_tokenizer, random_model, random_prompt,
                                            tiny_gpt2_config, tiny_llama_config,
                                            tiny_mistral_config, with_random_norm_weights)
from infergraft.core.testing.parity import assert_greedy_match, assert_logits_match
from infergraft.kernels.int4_linear import dequantize_float

KW = dict(dtype="float32", device="cpu", max_seq_len=128)


def _correlated(rows, k, seed=0):
    """Inputs [rows, K] whose columns are correlated (as activations are), one dead."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.eye(k) + 2 * torch.randn(k, k, generator=g) / k ** 0.5
    x = torch.randn(rows, k, generator=g) @ mix
    x[:, 5] = 0  # an input that is always 0: a zero on H's diagonal
    return x


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("n,k", [(96, 256), (40, 200)])  # 200: a partial last group
def test_gptq_output_error_is_below_rtn(group_size, n, k, act_order):
    x = _correlated(1024, k)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(1))
    h = Hessian(k)
    for part in x.split(300):  # batch by batch, as the model's calibration batches come
        h.add(part)
    want = 2 * x.double().t() @ x.double() / len(x)  # each batch's product is float32
    torch.testing.assert_close(h.value(), want, rtol=0, atol=1e-6 * float(want.abs().max()))
    q, zeros, scales = gptq_quantize(w, h.value(), group_size, min_zero=1, act_order=act_order)
    groups = -(-k // group_size)
    assert q.shape == (n, k) and zeros.shape == scales.shape == (n, groups)
    assert q.dtype == zeros.dtype == torch.uint8 and scales.dtype == torch.float16
    assert int(q.max()) <= 15 and 1 <= int(zeros.min()) and int(zeros.max()) <= 15

    def error(codes):
        return float((x @ w.t() - x @ dequantize(*codes, group_size).t()).norm())

    rtn_codes = rtn_int4(w, group_size, min_zero=1)
    ours, rtn = error((q, zeros, scales)), error(rtn_codes)
    assert torch.isfinite(torch.tensor(ours)) and ours < 0.85 * rtn, (ours, rtn)
    if act_order:  # static groups: each grid is the one of the weights before any update
        w0 = w.clone()
        w0[:, 5] = 0  # the dead input's weights are zeroed first
        _, rtn_zeros, rtn_scales = rtn_int4(w0, group_size, min_zero=1)
        assert torch.equal(zeros, rtn_zeros) and torch.equal(scales, rtn_scales)


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_with_uncorrelated_inputs_stays_near_rtn(act_order):
    # H = I: no column can correct another, so GPTQ rounds as RTN does, bar the dampening
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(2))
    q, zeros, scales = gptq_quantize(w, torch.eye(64), 32, act_order=act_order)
    rq, rzeros, rscales = rtn_int4(w, 32)
    assert torch.equal(zeros, rzeros) and torch.equal(scales, rscales)
    assert (q != rq).float().mean() < 0.01


def test_the_grid_keeps_zero_points_writable_in_gptq_v1():
    # an all-positive group would need zero 0, which GPTQ v1 (zero - 1 stored) cannot hold:
    # with min_zero 1 the scale grows so that the group's max stays on the grid
    w = torch.linspace(0.1, 1.5, 32)[None, :]
    for min_zero in (0, 1):
        scale, zero = int4_grid(w, min_zero)
        assert int(zero) == min_zero
        top = (torch.round(w.max() / scale) + zero).clamp(0, 15)
        assert abs(float((top - zero) * scale) - 1.5) <= float(scale) / 2 + 1e-6
    assert int4_grid(torch.zeros(1, 8), 1)[0] == 1  # an all-zero group: scale 1


def test_calibration_text_is_disjoint_from_the_evaluation_text():
    import pydoc_data.topics

    texts = calibration_texts()
    assert len(texts) == len(pydoc_data.topics.topics) - len(EVAL_TOPICS)
    assert not any(pydoc_data.topics.topics[t] in texts for t in EVAL_TOPICS)
    tok = byte_tokenizer()
    a, b = calibration_ids(tok, 1024, 256, seed=0), calibration_ids(tok, 1024, 256, seed=1)
    assert a.shape == (4, 256) and a.dtype == torch.int64
    assert torch.equal(a, calibration_ids(tok, 1024, 256, seed=0)) and not torch.equal(a, b)
    with pytest.raises(ValueError, match="holds"):
        calibration_ids(tok, 10 ** 8, 256)
    # an instruct model's tokenizer: half the windows behind the chat template's prefix
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n"
                         "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    prefix = tok.encode("<user>Tell me about Python.\n<assistant>", add_special_tokens=False)
    chat = calibration_ids(tok, 1024, 256, seed=0)
    assert chat.shape == a.shape
    for row, plain in zip(chat[:2], a[:2]):
        assert row[:len(prefix)].tolist() == prefix
        assert torch.equal(row[len(prefix):], plain[:256 - len(prefix)])
    assert torch.equal(chat[2:], a[2:])


@pytest.mark.parametrize("make", [tiny_llama_config, tiny_mistral_config])
def test_the_staged_layer_forward_equals_hf(make):
    hf = with_random_norm_weights(random_model(make(sliding_window=8) if make is
                                               tiny_mistral_config else make(), scale=5.0))
    ids = torch.tensor([random_prompt(24, 256, seed=s) for s in range(3)])
    with torch.no_grad():
        batches = first_layer_inputs(hf, ids, batch_size=2)
        seen = []
        for layer in hf.model.layers:
            want = [layer(x, **kw) for x, kw in batches]
            batches = run_layer(layer, batches, lambda names, inputs: seen.append(names))
            for (got, _), w in zip(batches, want):
                torch.testing.assert_close(got, w[0] if isinstance(w, tuple) else w)
    assert len(seen) == 4 * len(hf.model.layers)


def _tiny_dir(tmp_path, make=tiny_llama_config, seed=0, name="src"):
    """A tiny random model saved as a user's directory would hold it, with a tokenizer."""
    hf = with_random_norm_weights(random_model(make(), seed=seed, scale=20.0))
    path = tmp_path / name
    hf.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return hf, path


def _reference(hf, out):
    """``hf`` with each projection's weight the dequantised one the checkpoint ``out``
    holds, read back through the GPTQ loader's unpacking."""
    tensors = load_file(str(out / "model.safetensors"))
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    fmt = PrequantFormat("gptq", qc["group_size"], 1)
    ref = type(hf)(hf.config).eval()
    ref.load_state_dict(hf.state_dict())
    with torch.no_grad():
        for name, mod in ref.named_modules():
            if f"{name}.qweight" in tensors:
                parts = {p: tensors[f"{name}.{p}"] for p in fmt.parts}
                pre = convert(name, parts, fmt)
                mod.weight.copy_(dequantize_float(pre.qweight, pre.scales, pre.zeros,
                                                  pre.group_size, pre.in_features))
    return ref, tensors


@pytest.mark.parametrize("make,method,group_size,act_order", [
    (tiny_llama_config, "gptq", 32, False), (tiny_llama_config, "rtn", 64, False),
    (tiny_mistral_config, "gptq", 128, False), (tiny_llama_config, "gptq", 64, True)])
def test_the_written_checkpoint_builds_and_matches_hf(tmp_path, make, method, group_size,
                                                      act_order):
    hf, src = _tiny_dir(tmp_path, make)
    out = tmp_path / "out"
    done = quantize_model(src, out, method=method, group_size=group_size,
                          calibration_tokens=1024, act_order=act_order)
    assert done.projections == 7 * hf.config.num_hidden_layers
    assert done.calibration_tokens == (1024 if method == "gptq" else 0)
    config = json.loads((out / "config.json").read_text())
    qc = config["quantization_config"]
    assert {k: qc[k] for k in ("quant_method", "bits", "group_size", "desc_act", "sym",
                               "checkpoint_format")} == \
        {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": act_order,
         "sym": False, "checkpoint_format": "gptq"}
    assert qc["meta"]["method"] == method
    assert (out / "tokenizer.json").exists()
    ref, tensors = _reference(hf, out)
    # every tensor but the projections' weights as it was
    source = load_file(str(src / "model.safetensors"))
    for key, t in source.items():
        if key.endswith("_proj.weight"):
            assert key not in tensors and key.replace(".weight", ".qweight") in tensors
            g_idx = tensors[key.replace(".weight", ".g_idx")]  # contiguous groups, always
            assert torch.equal(g_idx, (torch.arange(t.shape[1]) // group_size).int())
        else:
            assert torch.equal(tensors[key], t), key
    # quantised, not copied: the weights moved, but not far
    w, wq = (m.model.layers[0].mlp.down_proj.weight.detach() for m in (hf, ref))
    assert 0 < float((w - wq).abs().max()) < 0.2 * float(w.abs().max())
    engine = core.build(str(out), plugins=["int4"], **KW)
    assert engine.plan.quantizers == ("int4",)
    assert engine.model.layers[0].qkv.packed.group_size == group_size
    ids = random_prompt(16, 256, seed=3)
    assert_logits_match(engine, ref, ids)
    assert_greedy_match(engine, ref, ids, max_new_tokens=12)


def test_an_in_memory_model_with_its_own_calibration_ids(tmp_path):
    hf = random_model(tiny_llama_config(tie_word_embeddings=True), seed=4, scale=20.0)
    ids = torch.tensor([random_prompt(64, 256, seed=s) for s in range(4)])
    quantize_model(hf, tmp_path / "out", group_size=32, calibration=ids)
    tensors = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert "lm_head.weight" not in tensors  # tied: stored once, as save_pretrained does
    engine = core.build(str(tmp_path / "out"), **KW)
    assert_logits_match(engine, _reference(hf, tmp_path / "out")[0], random_prompt(8, 256, 5))
    with pytest.raises(QuantizeError, match="no tokenizer"):
        quantize_model(hf, tmp_path / "again", group_size=32)


def test_the_cli_writes_a_checkpoint_that_generates(tmp_path):
    _, src = _tiny_dir(tmp_path)
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "infergraft.core.cli", "quantize", str(src),
                           "--out", str(out), "--group-size", "64", "--calibration-tokens",
                           "512", "--seed", "3"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"wrote {out}: 14 projections, gptq int4 in groups of 64, 512 calibration tokens" \
        in done.stderr
    assert "512 calibration tokens, act-order" in done.stderr  # the default
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (qc["group_size"], qc["meta"]["seed"], qc["meta"]["calibration_tokens"]) == \
        (64, 3, 512)
    assert qc["desc_act"] is True and qc["static_groups"] is True
    assert main(["generate", "hello", "--model", str(out), "--device", "cpu",
                 "--max-new-tokens", "4", "--raw"]) == 0


@pytest.mark.parametrize("args,named", [
    (["--group-size", "48"], "group_size=48 is not accepted; choose one of 32, 64, 128"),
    (["--bits", "8"], "bits=8 is not accepted"),
    (["--method", "awq"], "method='awq' is not accepted; choose one of gptq, rtn"),
    (["--calibration-tokens", "100"], "calibration_tokens=100 is not accepted"),
])
def test_the_cli_refuses_bad_settings_by_name(tmp_path, capsys, args, named):
    _, src = _tiny_dir(tmp_path)
    assert main(["quantize", str(src), "--out", str(tmp_path / "out"), *args]) == 2
    assert named in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_cli_refuses_a_missing_model_another_architecture_and_a_full_out(tmp_path, capsys):
    assert main(["quantize", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o1")]) == 2
    assert "cannot load model" in capsys.readouterr().err
    gpt2 = random_model(tiny_gpt2_config())
    gpt2.save_pretrained(tmp_path / "gpt2")
    assert main(["quantize", str(tmp_path / "gpt2"), "--out", str(tmp_path / "o2")]) == 2
    assert "cannot quantise GPT2LMHeadModel: the quantize tool handles LlamaForCausalLM, " \
           "MistralForCausalLM" in capsys.readouterr().err
    _, src = _tiny_dir(tmp_path)
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    assert main(["quantize", str(src), "--out", str(full), "--method", "rtn"]) == 2
    assert "is not an empty directory; the tool never overwrites" in capsys.readouterr().err
    assert [p.name for p in full.iterdir()] == ["keep.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()  # an empty directory is taken
    assert main(["quantize", str(src), "--out", str(empty), "--method", "rtn"]) == 0
    with pytest.raises(QuantizeError, match="already quantised"):
        quantize_model(empty, tmp_path / "o3", method="rtn")
    with pytest.raises(ModelSourceError):
        quantize_model(tmp_path / "nowhere", tmp_path / "o4")


@pytest.mark.slow
def test_demo_model_quantised_by_gptq_act_order(tmp_path):
    """SmolLM2-135M by GPTQ with act-order in groups of 128 (the default calibration: 8,192
    tokens, half of them behind the chat prefix), against the float32 engine over
    tests/demo_support's 2,048 tokens: issue 28's ratio <= 1.10 (round to nearest reaches
    1.40) and the demo answer once it opens as the float model's does: the float model's
    first answer token leads its runner-up by 0.01 in probability, and whether the
    quantised model opens "The" or "L'" (then in French) changed with the machine that
    quantised it (this 2-core host: "L'..." at cd38a44 too, where CI opened "The").
    Methods and seeds side by side: docs/bench/int4_quality.py."""
    from demo_support import (demo_answer, demo_answer_after_float_opening, demo_engine,
                              float_reference, perplexity)

    quantize_model("smollm2-135m", tmp_path / "gptq", group_size=128, act_order=True)
    ids, base, _ = float_reference()
    engine = demo_engine(["paged", "int4"], model=tmp_path / "gptq")
    assert engine.plan.quantizers == ("int4",)
    ratio = perplexity(engine, ids) / base
    answer = demo_answer_after_float_opening(engine)
    print(f"\nfloat32 perplexity {base:.3f}; int4-g128 by GPTQ act-order: ratio {ratio:.3f}, "
          f"answer opening as float32's: {answer!r}")
    assert ratio <= 1.10, ratio
    assert "Paris" in answer, (answer, f"its own opening: {demo_answer(engine)!r}")


@pytest.mark.parametrize("args, desc_act", [(["--no-act-order"], False), ([], True),
                                            (["--method", "rtn"], False)])
def test_act_order_is_gptqs_default_and_can_be_turned_off(tmp_path, args, desc_act):
    _, src = _tiny_dir(tmp_path)
    out = tmp_path / "out"
    assert main(["quantize", str(src), "--out", str(out), "--group-size", "64",
                 "--calibration-tokens", "512", *args]) == 0
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc.get("desc_act") == desc_act


def test_act_order_with_rtn_is_refused_by_name(tmp_path, capsys):
    _, src = _tiny_dir(tmp_path)
    assert main(["quantize", str(src), "--out", str(tmp_path / "o"), "--method", "rtn",
                 "--act-order"]) == 2
    assert "act_order is a GPTQ setting" in capsys.readouterr().err

