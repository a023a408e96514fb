"""The memory planner: KV and activation bytes from the config alone, `infergraft plan`,
build refusals."""
import json

import attrs
import pytest
import torch

from infergraft import core
from infergraft.core.cli import main
from infergraft.core.errors import PlanError
from infergraft.core.memory import activation_bytes, kv_bytes_per_token, plan_memory
from infergraft.core.testing.models import random_model, tiny_llama_config
from infergraft.core.units import fmt_bytes

MiB, GiB = 2**20, 2**30
LLAMA2_7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                 num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                 max_position_embeddings=4096, tie_word_embeddings=False)


# LLaMA-2-7B's activation row (elements; H = q = kv = 4096, I = 11008, see
# memory.activation_bytes): 4H + max(3q + 3kv, 3H + q, H + q + 3I) = 16384 + 41216
LLAMA2_7B_ROW = 4 * 4096 + max(6 * 4096, 4 * 4096, 2 * 4096 + 3 * 11008)  # 57600


def llama2_7b_activations(step, batch, elem=2):
    """step rows of LLAMA2_7B_ROW (the step's budget holds its decode tokens too), and
    batch rows of logits (32000 vocab) in the model dtype and float32."""
    return step * LLAMA2_7B_ROW * elem + batch * 32000 * (elem + 4)


def _spec(policy, cfg):
    return core.get_plugin_manager().policies().get(policy).describe(cfg)


def _llama2_7b_spec():
    return _spec("llama", tiny_llama_config(**LLAMA2_7B))


def test_llama2_7b_kv_is_half_a_mib_per_token_and_1_gib_per_2048_tokens():
    spec = _llama2_7b_spec()
    assert kv_bytes_per_token(spec, torch.float16) == MiB // 2
    mem = plan_memory(spec, dtype=torch.float16, max_seq_len=2048, max_batch_size=1,
                      budget=80 * GiB, budget_source="test")
    assert mem.kv_bytes_per_token == MiB // 2
    assert mem.kv_bytes_per_sequence == GiB
    assert mem.weight_bytes == 6_738_415_616 * 2  # LLaMA-2-7B's parameter count, fp16
    # the engine's default step: 2048 tokens
    assert mem.max_num_batched_tokens == 2048
    assert mem.activation_bytes == llama2_7b_activations(2048, 1) == 236_121_600
    assert mem.total_bytes == mem.weight_bytes + GiB + mem.activation_bytes
    assert mem.max_batch_that_fits == (80 * GiB - mem.weight_bytes - mem.activation_bytes) \
        // GiB == 67


def test_activation_bytes_follow_the_formula_and_grow_with_the_step():
    spec = _llama2_7b_spec()
    assert LLAMA2_7B_ROW == 57600  # the MLP phase is the largest
    fp16 = [activation_bytes(spec, torch.float16, step, 8) for step in (512, 2048, 4096)]
    assert fp16 == [llama2_7b_activations(step, 8) for step in (512, 2048, 4096)]
    assert fp16[0] < fp16[1] < fp16[2]
    assert fp16[2] - fp16[1] == 2048 * LLAMA2_7B_ROW * 2  # the rows alone grow
    # one more sequence: one more row of logits (its decode token is in the step's budget)
    assert activation_bytes(spec, torch.float16, 2048, 9) - fp16[1] == 32000 * 6
    # float32: the logits need no float32 copy
    assert activation_bytes(spec, torch.float32, 2048, 1) == \
        2048 * LLAMA2_7B_ROW * 4 + 32000 * 4
    # GPT-2 small (no gate, H = q = kv = 768, I = 3072): 4H + (H + q + 2I)
    from transformers import GPT2Config

    gpt2 = _spec("gpt2", GPT2Config(architectures=["GPT2LMHeadModel"]))
    assert activation_bytes(gpt2, torch.float32, 1024, 1) == \
        1024 * (4 * 768 + 768 + 768 + 2 * 3072) * 4 + 50257 * 4
    for bad in (0, -1, 2.5, True, None):
        with pytest.raises(PlanError, match="step_tokens must be an integer >= 1"):
            activation_bytes(spec, torch.float16, bad, 1)
    with pytest.raises(PlanError, match="max_num_batched_tokens must be an integer >= 1"):
        plan_memory(spec, max_num_batched_tokens=0)


def test_plan_memory_defaults_to_the_engines_step_budget():
    spec = _llama2_7b_spec()
    for seq_len, step in ((512, 2048), (2048, 2048), (4096, 2048)):  # longer prompts chunk
        mem = plan_memory(spec, dtype=torch.float16, max_seq_len=seq_len, max_batch_size=2)
        assert mem.max_num_batched_tokens == step
        assert mem.activation_bytes == llama2_7b_activations(step, 2)
    hf = random_model(tiny_llama_config(), seed=0)
    for asked, step in ((None, 2048), (100, 100)):
        engine = core.build(hf, max_seq_len=256, max_batch_size=2, max_num_batched_tokens=asked)
        assert engine.plan.max_num_batched_tokens == engine.scheduler.max_num_batched_tokens == step
        assert engine.plan.activation_bytes == \
            activation_bytes(engine.spec, torch.float32, step, 2)
        assert f"activations (a {step}-token step)" in str(engine.plan)


def test_int8_kv_adds_its_scales():
    spec = _llama2_7b_spec()
    q = core.get_plugin_manager().quantizers().get("kv-int8")
    assert kv_bytes_per_token(spec, torch.float16, q) == 2 * 32 * 32 * (128 + 4)
    assert kv_bytes_per_token(spec, torch.float32) == MiB


def test_plan_cli_reads_only_the_config(tmp_path, capsys):
    tiny_llama_config(**LLAMA2_7B).save_pretrained(tmp_path)  # config.json, no weights at all
    assert not list(tmp_path.glob("*.safetensors"))
    assert main(["plan", str(tmp_path), "--dtype", "float16", "--max-seq-len", "2048",
                 "--max-batch-size", "4", "--device-memory", "80GiB", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["kv_bytes_per_token"] == MiB // 2 and got["kv_bytes_per_sequence"] == GiB
    assert got["kv_bytes_total"] == 4 * GiB and got["weight_bytes"] == 6_738_415_616 * 2
    act = llama2_7b_activations(2048, 4)
    assert got["activation_bytes"] == act and got["max_num_batched_tokens"] == 2048
    assert got["total_bytes"] == 6_738_415_616 * 2 + 4 * GiB + act
    assert got["max_batch_that_fits"] == 67 and got["fits"] is True
    # exit 1: the plan is printed, and does not fit
    assert main(["plan", str(tmp_path), "--dtype", "float16", "--kv-dtype", "int8",
                 "--max-seq-len", "2048", "--device-memory", "16GiB"]) == 1
    text = capsys.readouterr().out
    assert "float16 / int8" in text and fmt_bytes(2 * 32 * 32 * 132) in text
    room = 16 * GiB - 6_738_415_616 * 2 - llama2_7b_activations(2048, 8)
    fit = room // (2 * 32 * 32 * 132 * 2048)  # 6 int8 sequences
    rows = dict(line.split("  ", 1) for line in text.splitlines())
    assert rows["fits"].strip() == "NO"  # 8 x 2048 tokens do not
    assert rows["largest batch at 2048 tokens"].strip() == str(fit) and fit == 6
    assert rows["activations (a 2048-token step)"].strip() == \
        fmt_bytes(llama2_7b_activations(2048, 8))
    assert main(["plan", str(tmp_path), "--dtype", "float16", "--max-seq-len", "2048",
                 "--max-num-batched-tokens", "512", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["max_num_batched_tokens"] == 512
    assert got["activation_bytes"] == llama2_7b_activations(512, 8)
    # int8 weights: the 32 layers' projections (qkv 12288, o 4096, gate_up 22016, down 4096
    # rows) at 1 byte + a float32 scale per row; embeddings, lm_head and norms at 2 bytes
    assert main(["plan", str(tmp_path), "--dtype", "float16", "--weights", "int8",
                 "--max-seq-len", "2048", "--json"]) == 0
    packed = 32 * (12288 * 4096 + 4096 * 4096 + 22016 * 4096 + 4096 * 11008)
    rows = 32 * (12288 + 4096 + 22016 + 4096)
    want = packed + 4 * rows + 2 * (6_738_415_616 - packed)
    assert json.loads(capsys.readouterr().out)["weight_bytes"] == want == 7_006_265_344


def test_plan_cli_demo_alias_and_bad_input(capsys):
    assert main(["plan", "smollm2-135m", "--max-seq-len", "1024", "--device-memory", "1GiB"]) == 0
    text = capsys.readouterr().out
    # 30 layers x 3 kv heads x 64 dims x 2 (K, V) x 4 bytes (float32 checkpoint)
    assert fmt_bytes(2 * 30 * 3 * 64 * 4) in text and "smollm2-135m" in text
    assert main(["plan", "smollm2-135m", "--device-memory", "lots"]) == 2
    assert "cannot read 'lots' as a size" in capsys.readouterr().err
    assert main(["plan", "/nonexistent/model"]) == 2
    assert "config.json" in capsys.readouterr().err
    assert main(["plan", "smollm2-135m", "--max-num-batched-tokens", "0"]) == 2
    assert "max_num_batched_tokens must be an integer >= 1, got 0" in capsys.readouterr().err


def test_sizes_must_be_positive_integers_or_none():
    import numpy as np

    hf = random_model(tiny_llama_config(), seed=0)
    for kw, msg in ((dict(max_batch_size=0), "max_batch_size must be an integer >= 1, got 0"),
                    (dict(max_seq_len=2.5), "max_seq_len must be an integer >= 1, got 2.5"),
                    (dict(max_seq_len=-3), "max_seq_len must be an integer >= 1, got -3")):
        with pytest.raises(PlanError, match=msg + r" \(or None for the default\)"):
            core.build(hf, **kw)
        with pytest.raises(PlanError, match=msg):
            plan_memory(_llama2_7b_spec(), **kw)
    engine = core.build(hf, max_seq_len=np.int64(128), max_batch_size=None)
    assert (engine.plan.max_seq_len, engine.plan.max_batch_size) == (128, 8)
    assert type(engine.plan.max_seq_len) is int


def test_build_refuses_what_does_not_fit_with_the_numbers():
    hf = random_model(tiny_llama_config(), seed=0)
    spec_bytes = 2 * 2 * 2 * 16 * 4  # K and V, L=2, Hkv=2, D=16, float32 -> 512 B per token
    with pytest.raises(PlanError) as e:
        core.build(hf, max_seq_len=512, max_batch_size=8, device_memory="1MiB")
    msg = str(e.value)
    assert "does not fit" in msg and "8 sequences x 512 tokens" in msg
    assert fmt_bytes(spec_bytes) in msg and "1.00 MiB (device_memory)" in msg
    assert "largest batch" in msg
    # the same budget fits a smaller batch, and a paged pool sized below the plan, with
    # 16-token prefill steps (the default 2048-token step alone needs over 5 MiB here)
    core.build(hf, max_seq_len=512, max_batch_size=2, device_memory="1MiB",
               max_num_batched_tokens=16)
    core.build(hf, plugins=["paged"], max_seq_len=512, max_batch_size=8, num_blocks=64,
               device_memory="1MiB", max_num_batched_tokens=16)
    with pytest.raises(PlanError, match="device_memory"):
        core.build(hf, max_seq_len=64, device_memory="a lot")


def test_plan_cli_finds_quantizers_by_format_and_name():
    from infergraft.core.tools.plan_cli import kv_quantizer_for, weight_quantizer_for

    assert kv_quantizer_for("int8").name == "kv-int8"
    assert weight_quantizer_for("int8").name == "int8"
    with pytest.raises(PlanError, match="no registered K/V quantizer stores 'int4'"):
        kv_quantizer_for("int4")
    with pytest.raises(PlanError, match="no registered weight quantizer named 'kv-int8'"):
        weight_quantizer_for("kv-int8")  # a K/V quantiser, not a weight one


def test_plan_counts_windows_for_sliding_window_models(tmp_path, capsys):
    from infergraft.core.testing.models import tiny_mistral_config

    # 2 layers x 2 kv heads x 16 dims x 2 (K, V) x 2 bytes = 256 B per token
    tiny_mistral_config(sliding_window=64).save_pretrained(tmp_path)
    args = ["plan", str(tmp_path), "--dtype", "float16", "--max-seq-len", "512",
            "--max-batch-size", "8", "--max-num-batched-tokens", "64"]
    assert main(args + ["--device-memory", "2MiB", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    per_token, weights = got["kv_bytes_per_token"], got["weight_bytes"]
    assert per_token == 256 and got["sliding_window"] == 64
    # one prompt at full length, then windows, beside the weights and the activations
    room = 2 * MiB - weights - got["activation_bytes"] - 512 * per_token
    assert got["max_batch_with_window"] == 1 + room // (64 * per_token)
    assert got["max_batch_with_window"] > 2 * got["max_batch_that_fits"] >= 2
    assert main(args + ["--device-memory", "2MiB"]) == 0
    rows = dict(line.split("  ", 1) for line in capsys.readouterr().out.splitlines())
    assert rows["KV per sequence in its window (64 tokens)"].strip() == fmt_bytes(64 * per_token)
    assert rows["largest batch with windows"].split()[0] == str(got["max_batch_with_window"])
    tiny_mistral_config(sliding_window=4096).save_pretrained(tmp_path)  # wider than 512
    assert main(args + ["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["max_batch_with_window"] is None


def test_build_refusal_of_a_window_model_says_what_its_windows_allow():
    from infergraft.core.testing.models import tiny_mistral_config

    hf = random_model(tiny_mistral_config(sliding_window=64), seed=1)
    with pytest.raises(PlanError, match=r"largest batch of 512-token sequences that fits is "
                                        r"\d+ \(\d+ with one prompt at full length and the "
                                        r"rest in their 64-token window\)"):
        core.build(hf, dtype="float16", device="cpu", max_seq_len=512,
                   max_batch_size=4096, device_memory="2MiB")
    # the paged pool shrinks to the budget instead (tests/test_pool_sizing.py), and is
    # refused only where it cannot hold one sequence: here the activations fill the budget
    with pytest.raises(PlanError, match="the K/V pool cannot hold one max_seq_len=512"):
        core.build(hf, plugins=["paged"], dtype="float16", device="cpu", max_seq_len=512,
                   max_batch_size=4096, device_memory="2MiB")


def _tiny_llama_budget(max_num_batched_tokens=None):
    """(model, weight bytes, K/V bytes, activation bytes) of the tiny LLaMA at 2 x 512
    tokens, float32, as the planner counts them."""
    cfg = tiny_llama_config()
    mem = plan_memory(_spec("llama", cfg), max_seq_len=512, max_batch_size=2,
                      max_num_batched_tokens=max_num_batched_tokens)
    return random_model(cfg, seed=0), mem.weight_bytes, mem.kv_bytes_total, mem.activation_bytes


def test_build_refuses_a_budget_that_only_weights_and_kv_fit():
    hf, weights, kv, act = _tiny_llama_budget()  # the default step: 2048 tokens
    assert kv == 2 * 512 * 512 and act > 2 * kv  # the activations are what overflows
    budget = weights + kv + act // 2
    with pytest.raises(PlanError) as e:
        core.build(hf, max_seq_len=512, max_batch_size=2, device_memory=budget)
    msg = str(e.value)
    assert f"+ activations {fmt_bytes(act)} (2048-token prefill steps)" in msg
    assert "Lower max_batch_size, max_seq_len or max_num_batched_tokens" in msg
    assert "that fits is 0" in msg  # (budget - weights - activations) // K/V per sequence
    # 64-token steps: the same budget fits, and the engine steps as planned
    _, _, _, small = _tiny_llama_budget(max_num_batched_tokens=64)
    assert weights + kv + small <= budget
    engine = core.build(hf, max_seq_len=512, max_batch_size=2, device_memory=budget,
                        max_num_batched_tokens=64)
    assert engine.plan.activation_bytes == small and engine.scheduler.max_num_batched_tokens == 64
    done = engine.generate([list(range(3, 103))], max_new_tokens=2)  # a 100-token prompt
    assert 1 <= len(done[0].token_ids) <= 2


def test_a_prepare_plan_hook_that_shrinks_the_step_shrinks_the_activations():
    class SmallSteps:
        @core.hookimpl
        def infergraft_prepare_plan(self, plan):
            return attrs.evolve(plan, max_num_batched_tokens=64)

    hf, weights, kv, act = _tiny_llama_budget()
    _, _, _, small = _tiny_llama_budget(max_num_batched_tokens=64)
    engine = core.build(hf, plugins=[SmallSteps()], max_seq_len=512, max_batch_size=2,
                        device_memory=weights + kv + act // 2)
    assert engine.plan.activation_bytes == small and engine.scheduler.max_num_batched_tokens == 64


def test_plan_refuses_what_build_refuses_past_learned_positions():
    from transformers import GPT2Config

    cfg = GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=64)
    cfg.architectures = ["GPT2LMHeadModel"]
    spec = core.get_plugin_manager().policies().get("gpt2").describe(cfg)
    assert plan_memory(spec, max_seq_len=64).max_seq_len == 64
    with pytest.raises(PlanError, match="max_seq_len=1000 exceeds the model's 64 learned"):
        plan_memory(spec, max_seq_len=1000)


def test_rope_past_the_trained_positions_warns():
    spec = core.get_plugin_manager().policies().get("llama").describe(tiny_llama_config())
    with pytest.warns(UserWarning, match="max_seq_len=1024 exceeds the model's max_position"):
        assert plan_memory(spec, max_seq_len=1024).max_seq_len == 1024  # allowed, with a word


def test_on_the_cpu_the_offload_host_pool_counts_too():
    hf = random_model(tiny_llama_config())
    kw = dict(plugins=["offload"], max_seq_len=64, max_batch_size=4, block_size=16,
              num_blocks=16, fast_blocks=8)
    plan = core.build(hf, **kw).plan
    pools = (8 + 16) * 16 * plan.kv_bytes_per_token  # fast blocks + the slow pool's room
    needed = plan.weight_bytes + plan.activation_bytes + pools
    core.build(hf, device_memory=needed, **kw)
    with pytest.raises(PlanError, match="does not fit"):
        core.build(hf, device_memory=needed - 1, **kw)
