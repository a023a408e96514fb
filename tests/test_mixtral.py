"""Mixtral (MixtralForCausalLM) against HF on random-initialised configs (float32, CPU):
the policy and layer kits, the MoE MLP's routing, chunked prefill through both caches,
both layouts of the expert weights (transformers 5's stacked tensors in memory, a
checkpoint's one tensor an expert), the Triton kernels in the interpreter, tensor and
pipeline parallel ranks, 8-bit expert weights, and the plan's counts."""
import attrs
import pytest
import torch

from infergraft import core
from infergraft.core.errors import PlanError, UnsupportedModelError, WeightLoadError
from infergraft.core.spec import ExpertSpec, LayerSpec
from infergraft.core.units import element_bytes
from infergraft.core.testing.layer_kit import LayerTests
from infergraft.core.testing.models import (random_model, random_prompt, tiny_mixtral_config,
                                            with_random_norm_weights)
from infergraft.core.testing.parity import (assert_greedy_match, assert_logits_match,
                                            hf_greedy, hf_logits, relative_error)
from infergraft.core.testing.planner_kit import PlannerTests
from infergraft.core.testing.policy_kit import PolicyTests, build_with_policy
from infergraft.policies.mixtral import MixtralPolicy

CONFIGS = {
    "top2-of-8": {},
    # a window of 16, one kv head, tied embeddings, top-3 of 4 experts
    "window-mqa-tied-top3": dict(sliding_window=16, num_key_value_heads=1, num_local_experts=4,
                                 num_experts_per_tok=3, tie_word_embeddings=True),
}


def mixtral(**overrides):
    hf = random_model(tiny_mixtral_config(**overrides), seed=11, scale=5.0)
    return with_random_norm_weights(hf, seed=2)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def mixtral_model(request):
    return mixtral(**CONFIGS[request.param])


@pytest.fixture(scope="module")
def hf():
    return mixtral()


@pytest.fixture
def policy():
    return core.get_plugin_manager().policies().get("mixtral")


class TestMixtralPolicy(PolicyTests):
    greedy_tokens = 12

    @pytest.fixture
    def hf_model(self, mixtral_model):
        return mixtral_model


class TestMixtureOfExperts(LayerTests):
    @pytest.fixture
    def layer_impl(self):
        return core.get_plugin_manager().layers()["mlp"].get("moe")

    @pytest.fixture
    def spec(self, policy, mixtral_model):
        return policy.describe(mixtral_model.config)


def test_spec_has_experts_in_place_of_the_dense_mlp(policy):
    from infergraft.core.slots import slot_layout

    spec = policy.describe(tiny_mixtral_config(num_hidden_layers=3))
    assert {(x.mlp, x.experts) for x in spec.layers} == \
        {("moe", ExpertSpec(num_experts=8, top_k=2, intermediate_size=32, renormalize=True))}
    layout = slot_layout(spec)
    assert not [s for s in layout if s.endswith((".gate_up.weight", ".down.weight"))]
    assert layout["layers.2.experts_gate_up.weight"] == ((8 * 64, 64), (32,) * 16)
    assert layout["layers.2.experts_down.weight"] == ((8 * 64, 32), (64,) * 8)
    assert layout["layers.2.router.weight"] == ((8, 64), None)
    experts, attention = 3 * (8 * 64 + 8 * 3 * 64 * 32), 3 * (64 * 128 + 64 * 64)
    other = spec.param_count - experts
    assert spec.active_param_count == other + 3 * (8 * 64 + 2 * 3 * 64 * 32)
    assert other == attention + 3 * 2 * 64 + 2 * 256 * 64 + 64  # norms, embed + head, final norm


def test_expert_specs_refuse_what_cannot_route():
    with pytest.raises(UnsupportedModelError, match="top_k=3 .* num_experts=2"):
        ExpertSpec(num_experts=2, top_k=3, intermediate_size=8)
    with pytest.raises(UnsupportedModelError, match="intermediate_size must be an integer"):
        ExpertSpec(num_experts=2, top_k=1, intermediate_size=0)
    with pytest.raises(UnsupportedModelError, match="experts_down"):
        LayerSpec(slots=(("experts_down.weight", (4, 4)),))  # the experts' own name


def _renormalized(renormalize: bool):
    class Policy(MixtralPolicy):
        name = f"mixtral-renormalize-{str(renormalize).lower()}"

        def describe(self, config):
            spec = super().describe(config)
            layer = attrs.evolve(spec.layers[0], experts=attrs.evolve(
                spec.layers[0].experts, renormalize=renormalize))
            return attrs.evolve(spec, layers=(layer,) * spec.num_layers)
    return Policy()


def test_the_parity_tests_see_the_renormalised_routing(hf):
    """Mixtral renormalises its top-k weights: without, the same weights are far from HF
    (the parity above holds because the routing is HF's)."""
    ids = random_prompt(20, hf.config.vocab_size, 5)
    ours = build_with_policy(_renormalized(False), hf, max_seq_len=64, max_batch_size=1)
    assert relative_error(ours.logits(ids), hf_logits(hf, ids)) > 1e-2
    ours = build_with_policy(_renormalized(True), hf, max_seq_len=64, max_batch_size=1)
    assert relative_error(ours.logits(ids), hf_logits(hf, ids)) < 1e-4


@pytest.mark.parametrize("cache", ["contiguous", "paged"])
def test_chunked_prefill_and_mixed_steps_match_hf(hf, cache):
    """Prompts fed 16 tokens a step (45 tokens: three chunks and a rest), a batch whose
    steps mix prompt chunks with decode tokens."""
    engine = core.build(hf, plugins=[cache], max_seq_len=128, max_batch_size=4,
                        max_num_batched_tokens=16)
    assert engine.plan.policy == "mixtral" and engine.plan.cache_backend == cache
    for n, seed in ((1, 0), (45, 1)):
        assert_logits_match(engine, hf, random_prompt(n, hf.config.vocab_size, seed), rtol=1e-4)
    assert_greedy_match(engine, hf, random_prompt(12, hf.config.vocab_size, 2), 16)
    prompts = [random_prompt(n, hf.config.vocab_size, 20 + n) for n in (3, 17, 40)]
    outs = [c.token_ids for c in engine.generate(prompts, max_new_tokens=10)]
    assert outs == [hf_greedy(hf, p, 10) for p in prompts]
    assert len({t for o in outs for t in o}) > 5, "degenerate output would make parity vacuous"


def test_a_checkpoint_with_one_tensor_an_expert_loads(hf, tmp_path):
    """save_pretrained writes the checkpoint layout (block_sparse_moe.experts.{j}.w1/w2/w3,
    block_sparse_moe.gate): built from that directory, the logits are HF's."""
    from safetensors import safe_open

    hf.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.layers.1.block_sparse_moe.experts.7.w3.weight" in keys
    assert not [k for k in keys if "gate_up_proj" in k]
    engine = core.build(str(tmp_path), max_seq_len=64, max_batch_size=1)
    assert_logits_match(engine, hf, random_prompt(30, hf.config.vocab_size, 3), rtol=1e-4)


def test_both_layouts_of_one_expert_matrix_are_refused(hf):
    """One layout or the other: a stray per-expert tensor beside the stacked one is an
    error naming both (it would fill the slot twice)."""
    class Both(torch.nn.Module):
        pass

    sd = dict(hf.state_dict())
    sd["model.layers.0.block_sparse_moe.experts.0.w1.weight"] = torch.zeros(32, 64)
    from infergraft.core.loading.weights import load_weights

    policy = MixtralPolicy()
    spec = policy.describe(hf.config)
    engine = core.build(hf, max_seq_len=32, max_batch_size=1)
    with pytest.raises(WeightLoadError, match="both fill 'layers.0.experts_gate_up.weight'"):
        load_weights(engine.model, spec, policy.weight_map(spec), sd.items(),
                     policy_name="mixtral", device="cpu", dtype=torch.float32)
    sd = {k: v for k, v in hf.state_dict().items() if "experts.down_proj" not in k}
    with pytest.raises(WeightLoadError, match="experts.0.w2.weight.*or, stacked, "
                                              "'model.layers.0.mlp.experts.down_proj'"):
        load_weights(engine.model, spec, policy.weight_map(spec), sd.items(),
                     policy_name="mixtral", device="cpu", dtype=torch.float32)


def test_the_triton_kernels_match_hf_in_the_interpreter(hf):
    """kernels='triton' (the interpreter on the CPU): the fused MoE kernel in the model."""
    from infergraft.kernels._triton import interpreting

    if not (interpreting() or torch.cuda.is_available()):
        pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1 (conftest.py sets it)")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    engine = core.build(hf.to(device), plugins=["paged"], max_seq_len=48, max_batch_size=2,
                        kernels="triton", device=device)
    calls = []
    real = engine.model.ops.fused_moe
    engine.model.ops.fused_moe = lambda *a, **k: calls.append(1) or real(*a, **k)
    ids = random_prompt(9, hf.config.vocab_size, 1)
    assert_logits_match(engine, hf, ids, rtol=1e-4)
    assert real.__name__ == "fused_moe_triton" and calls
    assert_greedy_match(engine, hf, ids, 4)
    hf.to("cpu")


def test_two_tensor_parallel_and_two_pipeline_ranks_match_hf():
    """tp: every expert's intermediate rows split over the two ranks (and the router
    whole on each), the output all-reduced; pp: a layer's experts stay with its stage."""
    from infergraft.core.testing.distributed import run_ranks, tp_parity_cases

    prompts = [[1, 5, 9, 33, 7, 80, 12], [1, 200, 3]]
    cases = [dict(config=tiny_mixtral_config(), plugins=[planner, "paged"], prompts=prompts,
                  scale=5.0) for planner in ("tp", "pp")]
    ranks = run_ranks(tp_parity_cases, 2, cases, timeout=600)
    for i, planner in enumerate(("tp", "pp")):
        r0, r1 = ranks[0][i], ranks[1][i]
        assert (r0["tensor_parallel"], r0["stages"]) == ((2, 1) if planner == "tp" else (1, 2))
        assert max(r0["errors"]) < 1e-4 and r0["errors"] == r1["errors"], (planner, r0["errors"])
        assert r0["ours"] == r0["hf"] == r1["ours"], planner
    # tp: each rank holds half of every expert (and of the attention), not all of them
    assert ranks[0][0]["weight_bytes"] < 0.6 * ranks[0][0]["alone_weight_bytes"]


class TestTensorParallelPlannerWithExperts(PlannerTests):
    """The planner kit on a Mixtral spec: each expert's gate, up and down cut and
    reassembled, the router replicated."""
    world_sizes = (1, 2, 4)
    bad_world_sizes = (3,)

    @pytest.fixture
    def planner(self):
        return core.get_plugin_manager().planners().get("tp")

    @pytest.fixture
    def spec(self):
        return MixtralPolicy().describe(tiny_mixtral_config(num_key_value_heads=4))


def test_tp_refuses_experts_it_cannot_split():
    spec = MixtralPolicy().describe(tiny_mixtral_config(intermediate_size=34))
    spec = attrs.evolve(spec, intermediate_size=128)  # only the experts' 34 is indivisible
    with pytest.raises(PlanError, match="4 ranks do not divide the experts' intermediate_size=34"):
        core.get_plugin_manager().planners().get("tp").plan(spec, 4)
    core.get_plugin_manager().planners().get("tp").plan(spec, 2)


def _rounded_like(hf, quantizer):
    """A copy of ``hf`` whose projections and experts went through the quantiser and
    back, row by row (as the engine packs them: an expert's rows have scales of their
    own), the router and norms untouched: what an 8-bit engine computes."""
    import copy
    import re

    hf = copy.deepcopy(hf)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if re.search(r"(self_attn\.[qkvo]_proj\.weight|experts\.(gate_up|down)_proj)$", name):
                rows = p.reshape(-1, p.shape[-1])
                p.copy_(quantizer.unpack(quantizer.pack(rows)).reshape(p.shape))
    return hf


@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_eight_bit_expert_weights(hf, name):
    """int8 / fp8 pack the stacked expert matrices too (a scale an expert's row), the
    router stays in the model's dtype: the logits are HF's on the rounded weights."""
    from infergraft.core.runner.layers import Linear, QuantizedLinear

    engine = core.build(hf, plugins=["paged", name], max_seq_len=48, max_batch_size=1)
    layer = engine.model.layers[0]
    assert isinstance(layer.experts_gate_up, QuantizedLinear)
    assert isinstance(layer.experts_down, QuantizedLinear)
    assert type(layer.router) is Linear
    quantizer = core.get_plugin_manager().quantizers().get(name)
    ids = random_prompt(12, hf.config.vocab_size, 4)
    assert_logits_match(engine, _rounded_like(hf, quantizer), ids, rtol=1e-4)
    assert relative_error(engine.logits(ids), hf_logits(hf, ids)) > 1e-4  # rounded, truly
    dense = core.build(hf, plugins=["paged"], max_seq_len=48, max_batch_size=1).plan.weight_bytes
    # packed as a GPU holds them (on the CPU fp8 also keeps a dense copy: Quantizer.dense_on)
    packed = quantizer.weight_bytes(engine.spec, element_bytes(hf.dtype), "cuda", "triton")
    assert packed < 0.5 * dense


def test_int4_is_refused_by_name_before_weights_load(hf):
    with pytest.raises(PlanError, match="'int4' packs the mixture-of-experts weights "
                                        r"\(experts_gate_up, experts_down\).*'int8' or 'fp8'"):
        core.build(hf, plugins=["paged", "int4"], max_seq_len=48, max_batch_size=1)


def test_plan_counts_total_and_active_parameters(tmp_path):
    from infergraft.core.cli import main

    cfg = tiny_mixtral_config()
    cfg.save_pretrained(tmp_path)
    spec = MixtralPolicy().describe(cfg)
    import io
    from contextlib import redirect_stdout

    out = io.StringIO()
    with redirect_stdout(out):
        main(["plan", str(tmp_path), "--dtype", "float32", "--device-memory", "1GiB"])
    text = out.getvalue()
    assert f"{spec.param_count / 1e9:.3g}B, {spec.active_param_count / 1e9:.3g}B active " \
           "(top-2 of 8 experts a layer)" in text, text
    from infergraft.core.memory import active_weight_bytes, weight_bytes

    idle = 2 * 6 * (64 * 3 * 32) * 4  # 2 layers, 6 experts of 8 unread, float32
    assert active_weight_bytes(spec, torch.float32) == weight_bytes(spec, torch.float32) - idle


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["contiguous", "paged"])
def test_fp32_greedy_matches_hf_through_cuda_graphs(backend):
    """The fused MoE kernel inside the decode graphs (and the paged cache's mixed-step
    graphs, the contiguous cache's prefill graphs): greedy tokens and logits as HF's."""
    cfg = tiny_mixtral_config(hidden_size=256, intermediate_size=128, num_hidden_layers=3,
                              num_attention_heads=8, num_key_value_heads=2, vocab_size=1024)
    hf = random_model(cfg, seed=5, scale=5.0).cuda()
    engine = core.build(hf, plugins=[backend], device="cuda", dtype=torch.float32,
                        max_seq_len=256, max_batch_size=8)
    assert engine.decode_graphs is not None and engine.model.ops.backend == "triton"
    replays = engine.decode_graphs.replays
    prompts = [random_prompt(n, 1024, n) for n in (5, 23, 61)]
    outs = engine.generate(prompts, max_new_tokens=24)
    assert engine.decode_graphs.replays > replays
    for p, c in zip(prompts, outs):
        assert c.token_ids == hf_greedy(hf, p, 24)
    assert relative_error(engine.logits(prompts[1]), hf_logits(hf, prompts[1])) < 1e-4


def test_the_bench_roofline_reads_the_experts_a_batch_routes_to(hf):
    """bench's TPOT floor: the active weights at batch 1, nearly all by batch 32."""
    from infergraft.core.memory import active_weight_bytes, weight_bytes
    from infergraft.core.tools.bench import expert_bytes, shape_config, step_bytes

    engine = core.build(hf, max_seq_len=32, max_batch_size=1)
    experts = expert_bytes(engine.model)
    assert experts == 2 * 8 * 3 * 64 * 32 * 4  # two layers of 8 float32 experts
    spec = MixtralPolicy().describe(shape_config("mixtral-8x7b"))
    total, active = (f(spec, torch.bfloat16) for f in (weight_bytes, active_weight_bytes))
    experts = (total - active) * 8 // 6  # 6 of 8 experts unread at batch 1
    assert abs(step_bytes(spec, total, 0, 1, 0, experts) - active) <= 1
    assert 0.98 * total < step_bytes(spec, total, 0, 32, 0, experts) < total
    assert step_bytes(spec, total, 0, 1, 0) == total  # no expert bytes given: every weight
