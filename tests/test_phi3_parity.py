"""Phi-3 / Phi-4 (``Phi3ForCausalLM``) against HF on random-initialised configs (float32,
CPU): the fused qkv_proj / gate_up_proj checkpoint tensors, LongRoPE on both sides of
original_max_position_embeddings (32 here) through the paged and contiguous caches and
chunked prefill, partial rotary, a sliding window and tied embeddings.

Greedy tokens that cross 32 are compared with HF's forward over the whole sequence at
each step (``greedy_by_full_forwards``), not with its generate: that one changed there
between transformers 5.17 and 5.25 (docs/architecture.md, LongRoPE)."""
import os

import pytest
import torch

from infergraft import core
from infergraft.core.errors import PlanError
from infergraft.core.testing.models import (longrope_parameters, random_model, random_prompt,
                                            tiny_phi3_config, with_random_norm_weights)
from infergraft.core.testing.parity import (assert_greedy_match, assert_logits_match,
                                            greedy_by_full_forwards, hf_logits,
                                            relative_error)
from infergraft.core.testing.policy_kit import PolicyTests

B = 32  # original_max_position_embeddings of tiny_phi3_config
CONFIGS = {
    # LongRoPE, 12 of 16 dims rotated (Phi-4-mini's 0.75), GQA
    "longrope-partial": {},
    # Phi-3-mini-4k's shape: default RoPE, a sliding window; Phi-4-mini's tied head
    "window-tied-mqa": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                            sliding_window=7, num_key_value_heads=1, tie_word_embeddings=True),
}


def phi3(seed=1, **overrides):
    hf = random_model(tiny_phi3_config(**overrides), seed=seed, scale=5.0)
    return with_random_norm_weights(hf, seed=seed)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def phi3_model(request):
    return phi3(**CONFIGS[request.param])


@pytest.fixture
def policy():
    return core.get_plugin_manager().policies().get("phi3")


class TestPhi3Policy(PolicyTests):
    hf_full_forwards = True  # its greedy tokens cross 32
    @pytest.fixture
    def hf_model(self, phi3_model):
        return phi3_model


def test_spec_reads_longrope_partial_rotary_and_the_window(policy):
    spec = policy.describe(tiny_phi3_config(sliding_window=2047))
    rope = spec.rope
    assert (rope.type, rope.rotary_dim, rope.original_max_position) == ("longrope", 12, B)
    assert len(rope.short_factor) == len(rope.long_factor) == 6
    assert rope.attention_factor == pytest.approx((1 + torch.log(torch.tensor(16.0)).item()
                                                   / torch.log(torch.tensor(32.0)).item()) ** 0.5)
    assert spec.sliding_window == 2047 and spec.head_dim == 16 and not spec.qkv_bias


def test_the_fused_checkpoint_tensors_fill_our_slots_in_their_row_order():
    """qkv_proj is q | k | v and gate_up_proj gate | up, as our slots: taken whole."""
    hf = phi3()
    engine = core.build(hf, max_seq_len=64, max_batch_size=1)
    layer, ref = engine.model.layers[1], hf.model.layers[1]
    assert torch.equal(layer.qkv.weight, ref.self_attn.qkv_proj.weight)
    assert torch.equal(layer.gate_up.weight, ref.mlp.gate_up_proj.weight)


def test_a_checkpoint_directory_is_recognised_from_its_config(tmp_path):
    """A saved Phi-4-mini-like checkpoint (tied head: no lm_head.weight in the file) is
    built without naming a policy: config.json's architectures pick it."""
    hf = phi3(**CONFIGS["window-tied-mqa"])
    hf.save_pretrained(tmp_path)
    engine = core.build(str(tmp_path), max_seq_len=64, max_batch_size=1)
    assert (engine.plan.policy, engine.spec.architecture) == ("phi3", "Phi3ForCausalLM")
    assert engine.spec.tie_embeddings
    assert_logits_match(engine, hf, random_prompt(40, 256, 8), rtol=1e-4)


@pytest.mark.parametrize("cache", ["contiguous", "paged"])
def test_logits_match_hf_both_sides_of_the_original_length(phi3_model, cache):
    engine = core.build(phi3_model, plugins=[cache], max_seq_len=96, max_batch_size=2)
    for n in (1, 9, B, B + 1, 70):  # short table; one token past it: the long table
        assert_logits_match(engine, phi3_model, random_prompt(n, 256, n), rtol=1e-4)


@pytest.mark.parametrize("cache", ["contiguous", "paged"])
def test_chunked_prefill_and_generation_across_the_original_length(cache):
    """16 tokens a step: a long prompt's first chunks (all below 32) read the long table;
    short prompts that grow past 32 are recomputed there (HF's forward over the whole
    sequence), in steps that mix prompt chunks with decode tokens."""
    hf = phi3()
    engine = core.build(hf, plugins=[cache], max_seq_len=96, max_batch_size=4,
                        max_num_batched_tokens=16)
    prompts = [random_prompt(n, 256, 40 + n) for n in (12, 28, 45)]
    outs = [c.token_ids for c in engine.generate(prompts, max_new_tokens=24)]
    assert outs == [greedy_by_full_forwards(hf, p, 24) for p in prompts]
    assert all(len(o) == 24 for o in outs) and len({t for o in outs for t in o}) >= 12
    # the two that started short crossed the boundary: each recomputed once, not preempted
    assert engine.scheduler.long_rope.recomputes == 2
    assert engine.scheduler.num_preemptions == 0
    assert_greedy_match(engine, hf, random_prompt(30, 256, 7), 8,  # crosses on its 3rd token
                        reference=greedy_by_full_forwards)


def test_each_rule_of_the_per_sequence_choice_is_needed():
    """Without the long rows of a chunked long prompt, or without the recompute at the
    boundary, the same engine leaves HF's tokens: the parity above rests on both."""
    hf = phi3()
    crossing, long = random_prompt(12, 256, 52), random_prompt(45, 256, 85)
    for part, prompt in (("scheduler", crossing), ("runner", long)):
        engine = core.build(hf, plugins=["paged"], max_seq_len=96, max_batch_size=4,
                            max_num_batched_tokens=16)
        setattr(getattr(engine, part), "long_rope", None)
        ours = engine.generate(prompt, max_new_tokens=24)[0].token_ids
        assert ours != greedy_by_full_forwards(hf, prompt, 24), part


def test_within_the_original_length_only_the_short_table_exists():
    hf = phi3()
    engine = core.build(hf, plugins=["paged"], max_seq_len=B, max_batch_size=2)
    assert engine.scheduler.long_rope is None and engine.model.rope[0].shape[0] == B
    assert_greedy_match(engine, hf, random_prompt(6, 256, 3), 20)
    assert engine.cache.prefix is not None  # prefix caching stays on


def test_prefix_caching_is_off_past_the_original_length_and_refused_when_asked():
    hf = phi3()
    engine = core.build(hf, plugins=["paged"], max_seq_len=64, max_batch_size=2)
    assert engine.cache.prefix is None and engine.scheduler.long_rope.boundary == B
    with pytest.raises(PlanError, match=r"prefix_caching=True cannot run with LongRoPE past "
                                        r"its original length \(32 tokens"):
        core.build(hf, plugins=["paged"], max_seq_len=64, prefix_caching=True)


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the fused decode layer runs Triton kernels: a GPU or "
                           "TRITON_INTERPRET=1 (conftest.py sets it without a GPU)")
def test_the_fused_decode_layer_reads_the_long_table_in_the_qkv_epilogue():
    """16-bit weights on Triton kernels take the fused decode layer, RoPE in the qkv
    GEMM's epilogue (full rotary: partial rotary keeps it beside the GEMM, the kernel
    tests' case), past 32 at the long table's rows; the tokens are those of the reference
    kernels."""
    from infergraft.core.testing.models import longrope_parameters

    hf = phi3(seed=4, hidden_size=128, intermediate_size=128, num_hidden_layers=1,
              rope_parameters=longrope_parameters(32))
    kw = dict(plugins=["paged"], max_seq_len=40, max_batch_size=1, dtype="float16",
              device="cuda" if torch.cuda.is_available() else "cpu")
    ref, engine = core.build(hf, kernels="torch", **kw), core.build(hf, kernels="triton", **kw)
    assert engine.model.norms_folded
    calls = []
    qkv_rope = engine.model.ops.normed_qkv_rope
    engine.model.ops.normed_qkv_rope = lambda *a, **k: calls.append(a[7]) or qkv_rope(*a, **k)
    prompt = random_prompt(30, 256, 3)
    got = engine.generate(prompt, max_new_tokens=5)[0].token_ids  # crosses 32 on its 3rd
    assert got == ref.generate(prompt, max_new_tokens=5)[0].token_ids
    assert engine.scheduler.long_rope.recomputes == 1
    # decode rows at 30 and 31 (the short table), 32 recomputed with the prompt, then 33:
    # row b + 33 of the long table
    assert [int(rows) for rows in calls] == [30, 31, 2 * B + 1]
    err = relative_error(engine.logits(prompt + got).float(), ref.logits(prompt + got).float())
    assert err < 1e-2, err


def test_two_tensor_parallel_and_two_pipeline_ranks_match_hf():
    """The fused checkpoint tensors cut by heads and columns across tp ranks; LongRoPE's
    recompute and long rows on every rank (a prompt that crosses 32, one past it, fed 16
    tokens a step, in two micro-batches on the pipeline)."""
    from infergraft.core.testing.distributed import run_ranks, tp_parity_cases

    prompts = [random_prompt(25, 256, 1), random_prompt(40, 256, 2)]
    common = dict(config=tiny_phi3_config(), prompts=prompts, max_seq_len=64,
                  max_num_batched_tokens=16, hf_full_forwards=True)
    cases = [dict(common, plugins=["tp", "paged"]),
             dict(common, plugins=["pp", "paged"], planner_options=dict(micro_batches=2))]
    ranks = run_ranks(tp_parity_cases, 2, cases, timeout=600)
    for i, planner in enumerate(("tp", "pp")):
        r0, r1 = ranks[0][i], ranks[1][i]
        assert (r0["tensor_parallel"], r0["stages"]) == ((2, 1) if planner == "tp" else (1, 2))
        assert max(r0["errors"]) < 1e-4 and r0["errors"] == r1["errors"], (planner, r0["errors"])
        assert r0["ours"] == r0["hf"] == r1["ours"], planner


# relative logits error against the float engine a quantiser stays within here (int4:
# groups of 32 over 64 columns, a rough grid)
QUANTIZED = {"int8": 3e-2, "fp8": 0.1, "int4": 0.3, "kv-int8": 3e-2, "kv-fp8": 0.06}


@pytest.mark.filterwarnings("ignore::infergraft.core.errors.PerformanceWarning")
def test_quantised_weights_and_kv_run_across_the_original_length():
    hf = random_model(tiny_phi3_config(), seed=3, scale=2.0)
    kw = dict(max_seq_len=64, max_batch_size=2)
    ids, crossing = random_prompt(40, 256, 4), random_prompt(25, 256, 5)
    ref = core.build(hf, plugins=["paged"], **kw).logits(ids)
    for name, bound in QUANTIZED.items():
        engine = core.build(hf, plugins=["paged", name], **kw)
        assert engine.plan.quantizers == (name,)
        err = relative_error(engine.logits(ids), ref)
        assert 0 < err < bound, (name, err)
        assert len(engine.generate(crossing, max_new_tokens=12)[0].token_ids) == 12
        assert engine.scheduler.long_rope.recomputes == 1, name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cache", ["contiguous", "paged"])
def test_cuda_graphs_across_the_original_length(cache):
    """Decode graphs (the greedy look-ahead among them) place rows past 32 from the
    positions inside the graph; a step with a long prompt's rows below 32 runs eagerly
    (the step and prefill graphs are captured without them); the step scheduled while the
    last short decode step runs leaves the sequence to its recompute (the test above, on
    the CPU): HF's tokens of the whole sequence throughout."""
    hf = phi3(hidden_size=128, intermediate_size=256,  # 32-dim heads: 24 rotated, 12 factors
              rope_parameters=longrope_parameters(24, partial_rotary_factor=0.75)).cuda()
    engine = core.build(hf, plugins=[cache], device="cuda", max_seq_len=96, max_batch_size=4,
                        max_num_batched_tokens=16)
    assert engine.decode_graphs is not None
    replays = engine.decode_graphs.replays
    prompts = [random_prompt(n, 256, 60 + n) for n in (12, 28, 45, 3)]
    outs = [c.token_ids for c in engine.generate(prompts, max_new_tokens=24)]
    assert outs == [greedy_by_full_forwards(hf, p, 24) for p in prompts]
    assert engine.decode_graphs.replays > replays
    assert engine.scheduler.long_rope.recomputes == 2
    alone = engine.generate(prompts[1], max_new_tokens=24)[0].token_ids  # the look-ahead
    assert alone == outs[1]
    ids = random_prompt(70, 256, 9)
    assert relative_error(engine.logits(ids), hf_logits(hf, ids)) < 1e-4


def test_the_step_scheduled_during_the_last_short_decode_step_recomputes_first():
    """The decode graphs' greedy path (run eagerly here: ``use_graphs=False``) with the next
    step scheduled while one runs, as on CUDA: the step feeding 31 is read before its row
    is counted, so the step scheduled meanwhile must see the sequence due its recompute
    and leave it to ``schedule``, not feed 32 over the short K/V (the GPU test's token 21,
    94 where the whole sequence's forward gives 105)."""
    from infergraft.core.runner.cuda_graph import CudaGraphRunner

    hf = phi3(hidden_size=128, intermediate_size=256,
              rope_parameters=longrope_parameters(24, partial_rotary_factor=0.75))
    engine = core.build(hf, plugins=["paged"], max_seq_len=96, max_batch_size=4,
                        max_num_batched_tokens=16, cuda_graphs=False)
    runner = CudaGraphRunner(engine.model, engine.cache, 4, use_graphs=False)
    runner.capture()
    engine.decode_graphs, engine.schedule_ahead = runner, True
    scheduler = engine.scheduler
    resume, fed_over_short = scheduler.resume, []

    def resume_watched(step):  # rows at 32 or past it of a sequence still short
        fed_over_short.extend(s.num_computed_tokens for s in step.seqs
                              if scheduler.long_rope.stale(s))
        return resume(step)
    scheduler.resume = resume_watched
    prompt = random_prompt(12, 256, 72)
    ours = engine.generate(prompt, max_new_tokens=24)[0].token_ids
    assert fed_over_short == [] and runner.replays > 0
    assert ours == greedy_by_full_forwards(hf, prompt, 24)
    assert scheduler.long_rope.recomputes == 1


def test_steps_with_long_rows_leave_the_mixed_step_graphs_to_the_others():
    """The mixed-step graphs' static path (run eagerly here: ``use_graphs=False``) takes
    the steps whose every row its position places, and not those feeding a long
    prompt's rows below 32: HF's tokens either way."""
    from infergraft.core.runner.step_graph import StepGraphRunner

    hf = phi3()
    engine = core.build(hf, plugins=["paged"], max_seq_len=96, max_batch_size=3,
                        max_num_batched_tokens=16, cuda_graphs=False)
    runner = StepGraphRunner(engine.model, engine.cache, 16, 3, buckets=(8, 16),
                             use_graphs=False)
    runner.capture()
    engine.runner.step_graphs = runner
    prompts = [random_prompt(12, 256, 52), random_prompt(45, 256, 85)]
    outs = [c.token_ids for c in engine.generate(prompts, max_new_tokens=24)]
    assert outs == [greedy_by_full_forwards(hf, p, 24) for p in prompts]
    assert runner.replays > 0


def test_a_long_prompt_alone_leaves_the_prefill_graphs():
    """The contiguous cache's prefill graphs (run eagerly here) take a short prompt alone,
    not one longer than 32, whose rows all read the long table."""
    from infergraft.core.runner.prefill_graph import PrefillGraphRunner

    hf = phi3()
    engine = core.build(hf, plugins=["contiguous"], max_seq_len=64, max_batch_size=1,
                        cuda_graphs=False)
    runner = PrefillGraphRunner(engine.model, engine.cache, 64, buckets=(16, 64),
                                use_graphs=False)
    engine.prefill_graphs = runner
    for n, replays in ((10, 1), (40, 1)):
        assert_greedy_match(engine, hf, random_prompt(n, 256, n), 4)
        assert runner.replays == replays
