"""The Qwen3-MoE plugin's suite: the policy and layer kits with their fixtures, and HF
parity where it leaves Qwen3's path: the routing with and without ``norm_topk_prob``,
dense layers between the sparse ones (``mlp_only_layers``, ``decoder_sparse_step``),
chunked prefill on the contiguous and paged caches, a checkpoint's one tensor an expert,
and tensor and pipeline parallel ranks."""
import attrs
import pytest

from infergraft import core
from infergraft.core.errors import UnsupportedModelError
from infergraft.core.spec import ExpertSpec
from infergraft.core.testing.layer_kit import LayerTests
from infergraft.core.testing.models import (random_model, random_prompt, tiny_qwen3_moe_config,
                                            with_random_norm_weights)
from infergraft.core.testing.parity import (assert_greedy_match, assert_logits_match,
                                            hf_greedy, hf_logits, relative_error)
from infergraft.core.testing.policy_kit import PolicyTests, build_with_policy
from infergraft_qwen.qwen3_moe import Qwen3MoePolicy

CONFIGS = {
    # layers 0 and 2 sparse, 1 dense (mlp_only_layers); top-2 weights as the softmax gives them
    "dense-between": {},
    # every second layer sparse (decoder_sparse_step=2: layer 1 of 3), top-3 renormalised, tied
    "sparse-step-renormalised": dict(decoder_sparse_step=2, mlp_only_layers=[],
                                     norm_topk_prob=True, num_experts_per_tok=3,
                                     tie_word_embeddings=True),
}


def qwen3_moe(**overrides):
    hf = random_model(tiny_qwen3_moe_config(**overrides), seed=17, scale=5.0)
    return with_random_norm_weights(hf, seed=3)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def qwen3_moe_model(request):
    return qwen3_moe(**CONFIGS[request.param])


@pytest.fixture(scope="module")
def hf():
    return qwen3_moe()


@pytest.fixture
def policy():
    # the installed entry point, not an import of our own module: proves registration
    return core.get_plugin_manager().policies().get("qwen3_moe")


class TestQwen3MoePolicy(PolicyTests):
    greedy_tokens = 12

    @pytest.fixture
    def hf_model(self, qwen3_moe_model):
        return qwen3_moe_model


class TestTheBuiltInMixtureOfExperts(LayerTests):
    @pytest.fixture
    def layer_impl(self):
        return core.get_plugin_manager().layers()["mlp"].get("moe")

    @pytest.fixture
    def spec(self, policy, qwen3_moe_model):
        return policy.describe(qwen3_moe_model.config)


def test_spec_names_experts_where_hf_has_them(policy):
    spec = policy.describe(tiny_qwen3_moe_config(num_hidden_layers=4))
    experts = ExpertSpec(num_experts=6, top_k=2, intermediate_size=24, renormalize=False)
    assert [(x.attention, x.mlp, x.experts) for x in spec.layers] == \
        [("qwen3", "moe", experts), ("qwen3", None, None), ("qwen3", "moe", experts),
         ("qwen3", "moe", experts)]
    assert spec.layer(1).mlp == "gated" and spec.intermediate_size == 112  # the dense layer's
    spec = policy.describe(tiny_qwen3_moe_config(num_hidden_layers=4, decoder_sparse_step=2,
                                                 mlp_only_layers=[3], norm_topk_prob=True))
    assert [x.experts is not None for x in spec.layers] == [False, True, False, False]
    assert spec.layers[1].experts.renormalize


def test_a_decoder_sparse_step_that_picks_no_layer_is_refused(policy):
    config = tiny_qwen3_moe_config()
    config.decoder_sparse_step = 0  # HF would divide by it
    with pytest.raises(UnsupportedModelError, match="decoder_sparse_step=0"):
        policy.describe(config)


class _Renormalized(Qwen3MoePolicy):
    name = "qwen3-moe-renormalized"

    def describe(self, config):
        spec = super().describe(config)
        return attrs.evolve(spec, layers=tuple(
            x if x.experts is None else attrs.evolve(x, experts=attrs.evolve(
                x.experts, renormalize=not x.experts.renormalize)) for x in spec.layers))


def test_the_parity_tests_see_norm_topk_prob(hf):
    """Renormalising where the config says not to: far from HF on the same weights."""
    engine = build_with_policy(_Renormalized(), hf, max_seq_len=64, max_batch_size=1)
    ids = random_prompt(20, hf.config.vocab_size, 5)
    assert relative_error(engine.logits(ids), hf_logits(hf, ids)) > 1e-2


@pytest.mark.parametrize("cache", ["contiguous", "paged"])
def test_chunked_prefill_and_mixed_steps_match_hf(hf, cache):
    engine = core.build(hf, plugins=[cache], max_seq_len=128, max_batch_size=4,
                        max_num_batched_tokens=16)
    assert engine.plan.policy == "qwen3_moe" and engine.plan.cache_backend == cache
    for n, seed in ((1, 0), (45, 1)):
        assert_logits_match(engine, hf, random_prompt(n, hf.config.vocab_size, seed), rtol=1e-4)
    assert_greedy_match(engine, hf, random_prompt(12, hf.config.vocab_size, 2), 16)
    prompts = [random_prompt(n, hf.config.vocab_size, 20 + n) for n in (3, 17, 40)]
    outs = [c.token_ids for c in engine.generate(prompts, max_new_tokens=8)]
    assert outs == [hf_greedy(hf, p, 8) for p in prompts]


def test_a_checkpoint_with_one_tensor_an_expert_loads(hf, tmp_path):
    hf.save_pretrained(tmp_path)
    engine = core.build(str(tmp_path), max_seq_len=64, max_batch_size=1)
    assert engine.plan.policy == "qwen3_moe"
    assert_logits_match(engine, hf, random_prompt(30, hf.config.vocab_size, 3), rtol=1e-4)


def test_two_tensor_parallel_and_two_pipeline_ranks_match_hf():
    from infergraft.core.testing.distributed import run_ranks, tp_parity_cases

    prompts = [[1, 5, 9, 33, 7, 80, 12], [1, 200, 3]]
    cases = [dict(config=tiny_qwen3_moe_config(), plugins=[planner, "paged"], prompts=prompts,
                  scale=5.0) for planner in ("tp", "pp")]
    ranks = run_ranks(tp_parity_cases, 2, cases, timeout=600)
    for i, planner in enumerate(("tp", "pp")):
        r0, r1 = ranks[0][i], ranks[1][i]
        assert (r0["tensor_parallel"], r0["stages"]) == ((2, 1) if planner == "tp" else (1, 2))
        assert max(r0["errors"]) < 1e-4 and r0["errors"] == r1["errors"], (planner, r0["errors"])
        assert r0["ours"] == r0["hf"] == r1["ours"], planner
