"""Tensor and pipeline parallelism (`plugins=["tp"]`, `["pp"]`): two CPU processes in a
gloo group against HF's own forward and greedy generate on the same weights, and the
errors around them."""
import pytest
import torch

from infergraft import core
from infergraft.core.errors import PlanError
from infergraft.core.plan import ParallelPlan, Planner
from infergraft.core.testing.distributed import build_verdicts, run_ranks, tp_parity_cases
from infergraft.core.testing.models import random_model, tiny_llama_config

PROMPTS = [[1, 5, 9, 33, 7, 80, 12], [1, 200, 3], [1, 17, 17, 4, 99]]


def _configs():
    from infergraft.core.testing.distributed import parity_configs

    gpt2, mistral = parity_configs()["gpt2"], parity_configs()["mistral"]
    cases = {  # name -> case for tp_parity (int8: weights as in tests/test_weight_int8.py)
        "llama-gqa-contiguous": dict(config=tiny_llama_config(), plugins=[]),
        # one kv head, two ranks: each holds a copy of it (kv_replicas)
        "llama-mqa-paged": dict(config=tiny_llama_config(num_key_value_heads=1),
                                plugins=["paged"]),
        "llama-paged-int8": dict(config=tiny_llama_config(), plugins=["paged", "int8"],
                                 seed=3, scale=2.0),
        "gpt2-biases": dict(config=gpt2, plugins=[]),  # tied head, learned positions
        "mistral-window-paged": dict(config=mistral, plugins=["paged"]),
    }
    return {f"{planner}-{name}": dict(case, plugins=[planner, *case["plugins"]])
            for planner in ("tp", "pp") for name, case in cases.items()}


@pytest.fixture(scope="module")
def two_ranks():
    """Every case on the same two ranks (one start-up): name -> [rank 0, rank 1] results."""
    configs = _configs()
    cases = [dict(case, prompts=PROMPTS) for case in configs.values()]
    ranks = run_ranks(tp_parity_cases, 2, cases, timeout=600)
    return {name: [r[i] for r in ranks] for i, name in enumerate(configs)}


@pytest.mark.parametrize("name", list(_configs()))
def test_two_ranks_match_hf(two_ranks, name):
    r0, r1 = two_ranks[name]
    assert (r0["tensor_parallel"], r0["stages"]) == ((2, 1) if name.startswith("tp") else (1, 2))
    assert r0["errors"] == r1["errors"]  # every rank computed the same logits
    if "int8" in name:  # quantised (not the float weights), and close: as on one process
        assert 0 < max(r0["errors"]) < 3e-2, r0["errors"]
        if name.startswith("pp"):  # the same int8 rows as one process packs: same tokens
            assert r0["ours"] == r0["alone"]
    else:
        assert max(r0["errors"]) < 1e-4, r0["errors"]
        assert r0["ours"] == r0["hf"] == r0["alone"]  # greedy tokens, whole continuations
    assert r0["ours"] == r1["ours"] and r0["sampled"] == r1["sampled"]  # ranks agree


def test_each_rank_holds_its_share(two_ranks):
    from infergraft.core.memory import weight_bytes

    r0 = two_ranks["tp-llama-gqa-contiguous"][0]
    spec = core.get_plugin_manager().policies().get("llama").describe(tiny_llama_config())
    full = weight_bytes(spec, torch.float32)
    # per layer: qkv, o, gate_up, down halved; the embeddings and the (untied) LM head
    # halved too (vocab-parallel: 256 rows, 128 a rank); norms whole
    h, i, layers = spec.hidden_size, spec.intermediate_size, spec.num_layers
    halved = layers * (h * (spec.q_size + 2 * spec.kv_size) + spec.q_size * h + 3 * h * i) * 4 // 2
    vocab = 2 * spec.vocab_size * h * 4 // 2
    assert r0["weight_bytes"] == full - halved - vocab
    assert r0["kv_bytes_per_token"] == 2 * layers * (spec.num_kv_heads // 2) * spec.head_dim * 4


def test_fewer_kv_heads_than_ranks_copy_each_kv_head(two_ranks):
    """One kv head at tp 2: each rank caches a whole kv head (the one its query heads
    read), so its K/V bytes a token equal one process's; a kv head count that ranks
    neither divide nor are a multiple of is refused."""
    from infergraft.plugins.tensor_parallel import kv_replicas

    r0 = two_ranks["tp-llama-mqa-paged"][0]
    spec = core.get_plugin_manager().policies().get("llama").describe(
        tiny_llama_config(num_key_value_heads=1))
    assert kv_replicas(spec, 2) == 2
    assert r0["kv_bytes_per_token"] == 2 * spec.num_layers * 1 * spec.head_dim * 4
    planner = core.get_plugin_manager().planners().get("tp")
    odd = core.get_plugin_manager().policies().get("llama").describe(
        tiny_llama_config(num_attention_heads=6, num_key_value_heads=3, hidden_size=48))
    with pytest.raises(PlanError, match=r"2 ranks neither divide num_kv_heads=3 nor are a "
                                        r"multiple of it"):
        planner.plan(odd, 2)
    assert planner.plan(spec, 2).tensor_parallel == 2


def test_a_plan_that_fits_on_some_ranks_only_fails_on_every_rank():
    """Rank 1's budget is too small, rank 0's ample: both raise, before any weight loads,
    naming rank 1 and its reason (without agreeing, rank 0 would wait for rank 1 in its
    first collective)."""
    verdicts = run_ranks(build_verdicts, 2, tiny_llama_config(), ["tp"], ["8GiB", "1MiB"],
                         timeout=120)
    assert verdicts[0] == verdicts[1], verdicts
    assert "the plan does not fit on rank(s) [1] of 2; rank 1: " in verdicts[0], verdicts[0]
    fits = run_ranks(build_verdicts, 2, tiny_llama_config(), ["tp"], ["8GiB", "8GiB"],
                     timeout=120)
    assert fits == ["built", "built"]


def test_tp_without_a_process_group_says_how_to_launch(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(PlanError, match="torchrun --nproc-per-node"):
        core.build(random_model(tiny_llama_config()), plugins=["tp"], device="cpu")


def test_tp_refuses_a_world_that_does_not_divide_the_heads():
    planner = core.get_plugin_manager().planners().get("tp")
    spec = core.get_plugin_manager().policies().get("llama").describe(tiny_llama_config())
    with pytest.raises(PlanError, match=r"3 ranks do not divide num_heads=4"):
        planner.plan(spec, 3)


class TwoStages(Planner):
    name = "two-stages"

    def plan(self, spec, world_size=1, **options):
        return ParallelPlan(1, 1, ((0, 1), (1, spec.num_layers)))


def test_a_plan_for_more_ranks_than_there_are_is_refused_not_ignored():
    class Plugin:
        @core.hookimpl
        def infergraft_register_planners(self, register):
            register(TwoStages())

    with pytest.raises(PlanError, match=r"tensor_parallel=1 x 2 stage\(s\), but the process "
                                        r"group has 1 rank"):
        core.build(random_model(tiny_llama_config()), plugins=[Plugin()], device="cpu")


@pytest.mark.parametrize("planner, ranks", [("tp", 3), ("pp", 2)])
def test_demo_model_under_torchrun_answers_once(tmp_path, planner, ranks):
    """The real model (9 heads, 3 kv heads, 30 layers) on tp 3 / pp 2: the group comes
    from torchrun's environment, only rank 0 prints, every rank exits cleanly."""
    import os
    import subprocess
    import sys

    from infergraft.core.loading.demo import ensure_demo_model

    ensure_demo_model("smollm2-135m")  # fetched once, outside the ranks
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(ranks), "-m", "infergraft.core.cli", "generate",
           "--plugin", planner,
           "--device", "cpu", "--max-new-tokens", "12", "What is the capital of France?"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("The capital of France is Paris.") == 1, done.stdout


def test_plan_cli_prints_one_rank_and_refuses_what_does_not_divide(capsys):
    import json

    from infergraft.core.cli import main

    assert main(["plan", "smollm2-135m", "--json"]) == 0
    whole = json.loads(capsys.readouterr().out)
    assert main(["plan", "smollm2-135m", "--tensor-parallel", "3", "--json"]) == 0
    rank = json.loads(capsys.readouterr().out)
    assert rank["kv_bytes_per_token"] * 3 == whole["kv_bytes_per_token"]  # 3 kv heads, 1 each
    # a third of every projection and of the (tied) embeddings: 49152 rows, 16384 a rank;
    # the norms (2 a layer + the final one, 576 float32 each) whole on every rank
    norms = (2 * 30 + 1) * 576 * 4
    assert rank["weight_bytes"] == (whole["weight_bytes"] - norms) // 3 + norms
    assert main(["plan", "smollm2-135m", "--tensor-parallel", "2"]) == 2
    assert "2 ranks do not divide num_heads=9" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_two_gpus_match_hf():
    """The same check on two GPUs over NCCL (the Triton kernels of the plain layer)."""
    cases = [dict(config=tiny_llama_config(), plugins=["tp", "paged"], prompts=PROMPTS,
                  device="cuda")]
    (r0,), (r1,) = run_ranks(tp_parity_cases, 2, cases, backend="nccl", timeout=600)
    assert max(r0["errors"]) < 1e-4 and r0["ours"] == r0["hf"], r0
    assert r0["ours"] == r1["ours"] and r0["sampled"] == r1["sampled"]


def test_each_stage_counts_what_it_holds(two_ranks):
    from infergraft.core.memory import weight_bytes

    first, last = two_ranks["pp-gpt2-biases"]  # tied head: both stages hold the embeddings
    config = _configs()["pp-gpt2-biases"]["config"]
    spec = core.get_plugin_manager().policies().get("gpt2").describe(config)
    whole = weight_bytes(spec, torch.float32)
    h, v, p = spec.hidden_size, spec.vocab_size, spec.max_position
    # one layer each; the first adds the positions, the last the final LayerNorm (w + b)
    layer = (whole - (v * h + p * h + 2 * h) * 4) // 2
    assert first["weight_bytes"] == layer + (v * h + p * h) * 4
    assert last["weight_bytes"] == layer + (v * h + 2 * h) * 4


def test_plan_cli_prints_the_first_stage(capsys):
    import json

    from infergraft.core.cli import main

    assert main(["plan", "smollm2-135m", "--json"]) == 0
    whole = json.loads(capsys.readouterr().out)
    assert main(["plan", "smollm2-135m", "--pipeline-parallel", "4", "--json"]) == 0
    first = json.loads(capsys.readouterr().out)  # 30 layers: 8 + 8 + 7 + 7
    assert first["kv_bytes_per_token"] * 30 == whole["kv_bytes_per_token"] * 8
    assert "stage 1 of 4 (layers 0-7)" in first["model"]
    assert main(["plan", "smollm2-135m", "--pipeline-parallel", "31"]) == 2
    assert "31 stages for 30 layers" in capsys.readouterr().err
    assert main(["plan", "smollm2-135m", "--pipeline-parallel", "2", "--tensor-parallel", "3",
                 "--json"]) == 0  # 15 layers, a third of each
    both = json.loads(capsys.readouterr().out)
    assert both["kv_bytes_per_token"] * 30 * 3 == whole["kv_bytes_per_token"] * 15
    assert main(["plan", "smollm2-135m", "--pipeline-parallel", "2", "--tensor-parallel", "2"]) == 2


def test_four_ranks_two_stages_of_two_tensor_parallel_ranks():
    """plugins=["pp"], tensor_parallel=2 on 4 ranks: each stage's layers split in two, the
    first stage's embeddings and the last stage's head by vocab rows (GPT-2's 50257,
    tied: both stages hold 25129 rows a rank, the last rank 0 samples)."""
    from transformers import GPT2Config

    gpt2 = GPT2Config(vocab_size=50257, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                      bos_token_id=1, eos_token_id=2)
    gpt2.architectures = ["GPT2LMHeadModel"]
    cases = [dict(config=config, plugins=["pp"], prompts=prompts,
                  planner_options={"tensor_parallel": 2})
             for config, prompts in ((_configs()["pp-llama-gqa-contiguous"]["config"], PROMPTS),
                                     (gpt2, [[1, 50256, 25128, 25129], *PROMPTS[1:]]))]
    ranks = run_ranks(tp_parity_cases, 4, cases, timeout=600)
    for case in range(len(cases)):
        r = [ranks[k][case] for k in range(4)]
        assert (r[0]["tensor_parallel"], r[0]["stages"]) == (2, 2)
        assert max(r[3]["errors"]) < 1e-4, r[3]["errors"]
        assert r[0]["ours"] == r[0]["hf"] == r[0]["alone"]
        assert all(x["ours"] == r[0]["ours"] and x["sampled"] == r[0]["sampled"] for x in r)
        assert all(x["weight_bytes"] < 0.75 * x["alone_weight_bytes"] for x in r)
    # GPT-2, per rank: one layer's halves (6 h^2 + 9.5 h: norms, column biases halved, o /
    # down biases whole), 25129 of the tied rows, + the positions (first) or the final norm
    layer, rows = 6 * 32 * 32 + 19 * 32 // 2, 25129 * 32
    assert [ranks[k][1]["weight_bytes"] for k in range(4)] == \
        [(layer + rows + 64 * 32) * 4] * 2 + [(layer + rows + 2 * 32) * 4] * 2


def test_a_planner_whose_splits_the_runtime_does_not_run_is_refused():
    from infergraft.core.distributed.ranks import check_styles
    from infergraft.plugins.tensor_parallel import TensorParallelPlanner

    class ReplicatedMLP(TensorParallelPlanner):  # would pass the kit, then run wrong
        name = "replicated-mlp"

        def shard_style(self, spec, slot):
            return "replicated" if ".gate_up." in slot or ".down." in slot \
                else super().shard_style(spec, slot)

    spec = core.get_plugin_manager().policies().get("llama").describe(tiny_llama_config())
    check_styles(TensorParallelPlanner(), spec)
    with pytest.raises(PlanError, match="'replicated-mlp' shards 'layers.0.gate_up.weight' "
                                        "replicated, but the tensor-parallel runtime runs it "
                                        "column"):
        check_styles(ReplicatedMLP(), spec)
