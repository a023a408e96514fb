"""The Qwen3 plugin's suite: the policy and layer conformance kits with their fixtures,
and HF parity where Qwen3's attention leaves the LLaMA one's path: chunked prefill on
the contiguous and paged caches, tensor and pipeline parallel ranks (the q/k norms
replicated, each stage's layers keeping their parts), and the fused decode layer (RoPE
outside the qkv GEMM)."""
import os

import attrs
import pytest
import torch

from infergraft import core
from infergraft.core.testing.layer_kit import LayerTests
from infergraft.core.testing.models import (random_model, random_prompt, tiny_qwen3_config,
                                            with_random_norm_weights)
from infergraft.core.testing.parity import (assert_greedy_match, assert_logits_match,
                                            hf_greedy, hf_logits, relative_error)
from infergraft.core.testing.policy_kit import PolicyTests, build_with_policy
from infergraft_qwen.qwen3 import Qwen3Policy

CONFIGS = {
    "gqa-untied": {},  # head_dim 24, not hidden / heads (16)
    "mqa-tied": dict(num_attention_heads=6, num_key_value_heads=1, hidden_size=48,
                     tie_word_embeddings=True),
    "attention-bias": dict(attention_bias=True, num_key_value_heads=4),
}


def qwen3(**overrides):
    # q_norm / k_norm (and the layers' norms) drawn around 1: HF initialises them to ones
    hf = random_model(tiny_qwen3_config(**overrides), seed=13, scale=5.0)
    return with_random_norm_weights(hf, seed=3)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def qwen3_model(request):
    return qwen3(**CONFIGS[request.param])


@pytest.fixture
def policy():
    # the installed entry point, not an import of our own module: proves registration
    return core.get_plugin_manager().policies().get("qwen3")


class TestQwen3Policy(PolicyTests):
    @pytest.fixture
    def hf_model(self, qwen3_model):
        return qwen3_model


class TestQwen3Attention(LayerTests):
    @pytest.fixture
    def layer_impl(self):
        return core.get_plugin_manager().layers()["attention"].get("qwen3")

    @pytest.fixture
    def spec(self, policy, qwen3_model):
        return policy.describe(qwen3_model.config)


def test_spec_names_the_qk_norm_attention_with_its_weights(policy):
    spec = policy.describe(tiny_qwen3_config(num_hidden_layers=3))
    assert spec.head_dim == 24 and spec.q_size == 96 != spec.hidden_size
    assert {(x.attention, x.slots) for x in spec.layers} == \
        {("qwen3", (("q_norm.weight", (24,)), ("k_norm.weight", (24,))))}
    assert len(spec.layers) == 3 and not spec.qkv_bias and not spec.o_bias


@pytest.mark.parametrize("cache", ["contiguous", "paged"])
def test_chunked_prefill_and_mixed_steps_match_hf(cache):
    """Prompts fed 16 tokens a step (45 tokens: three chunks and a rest), a batch whose
    steps mix prompt chunks with decode tokens."""
    hf = qwen3()
    engine = core.build(hf, plugins=[cache], max_seq_len=128, max_batch_size=4,
                        max_num_batched_tokens=16)
    assert engine.plan.policy == "qwen3" and engine.plan.cache_backend == cache
    for n, seed in ((1, 0), (45, 1)):
        assert_logits_match(engine, hf, random_prompt(n, hf.config.vocab_size, seed), rtol=1e-4)
    assert_greedy_match(engine, hf, random_prompt(12, hf.config.vocab_size, 2), 32)
    prompts = [random_prompt(n, hf.config.vocab_size, 20 + n) for n in (3, 17, 40)]
    outs = [c.token_ids for c in engine.generate(prompts, max_new_tokens=12)]
    assert outs == [hf_greedy(hf, p, 12) for p in prompts]


def test_two_tensor_parallel_and_two_pipeline_ranks_match_hf():
    from infergraft.core.testing.distributed import run_ranks, tp_parity_cases

    prompts = [[1, 5, 9, 33, 7, 80, 12], [1, 200, 3]]
    cases = [dict(config=tiny_qwen3_config(), plugins=[planner, "paged"], prompts=prompts)
             for planner in ("tp", "pp")]
    ranks = run_ranks(tp_parity_cases, 2, cases, timeout=600)
    for i, planner in enumerate(("tp", "pp")):
        r0, r1 = ranks[0][i], ranks[1][i]
        assert (r0["tensor_parallel"], r0["stages"]) == ((2, 1) if planner == "tp" else (1, 2))
        assert max(r0["errors"]) < 1e-4 and r0["errors"] == r1["errors"], (planner, r0["errors"])
        assert r0["ours"] == r0["hf"] == r1["ours"], planner


class _WithoutQKNorm(Qwen3Policy):
    """Qwen3 read as if it were LLaMA-shaped: the LLaMA attention, q_norm / k_norm dropped."""

    name = "qwen3-without-qk-norm"

    def describe(self, config):
        return attrs.evolve(super().describe(config), layers=())

    def weight_map(self, spec):
        wmap = super().weight_map(spec)
        rules = tuple(r for r in wmap.rules if not r.slot.endswith(("q_norm.weight",
                                                                    "k_norm.weight")))
        return attrs.evolve(wmap, rules=rules,
                            ignore=wmap.ignore + (r".*self_attn\.[qk]_norm\.weight$",))


def test_the_parity_tests_see_the_qk_norms():
    """Without its per-head norms the same weights are far from HF: the parity above
    holds because the qwen3 attention runs them."""
    hf = qwen3()
    engine = build_with_policy(_WithoutQKNorm(), hf, max_seq_len=64, max_batch_size=1)
    ids = random_prompt(20, hf.config.vocab_size, 5)
    assert relative_error(engine.logits(ids), hf_logits(hf, ids)) > 1e-2


def _count(engine, names):
    calls = []
    for name in names:
        op = getattr(engine.model.ops, name)
        setattr(engine.model.ops, name,
                lambda *a, _op=op, _n=name, **k: calls.append(_n) or _op(*a, **k))
    return calls


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the fused decode layer runs Triton kernels: a GPU or "
                           "TRITON_INTERPRET=1 (conftest.py sets it without a GPU)")
def test_the_fused_decode_layer_norms_q_and_k_outside_the_qkv_gemm():
    """16-bit weights on Triton kernels take the fused decode layer: its qkv GEMM keeps the
    input norm, but RoPE and the K/V write stay out of its epilogue (the paged cache would
    offer them there), and the tokens are those of the reference kernels."""
    hf = random_model(tiny_qwen3_config(hidden_size=128, intermediate_size=128), seed=4,
                      scale=2.0)
    hf = with_random_norm_weights(hf, seed=5)
    kw = dict(plugins=["paged"], max_seq_len=48, max_batch_size=2, dtype="float16",
              device="cpu" if not torch.cuda.is_available() else "cuda")
    ref, engine = core.build(hf, kernels="torch", **kw), core.build(hf, kernels="triton", **kw)
    assert engine.model.norms_folded and not ref.model.norms_folded
    calls = _count(engine, ("normed_linear", "normed_qkv_rope"))
    prompt = random_prompt(5, hf.config.vocab_size, 3)
    got = engine.generate(prompt, max_new_tokens=6)[0].token_ids
    assert got == ref.generate(prompt, max_new_tokens=6)[0].token_ids
    assert "normed_linear" in calls and "normed_qkv_rope" not in calls, set(calls)
    err = relative_error(engine.logits(prompt).float(), ref.logits(prompt).float())
    assert err < 1e-2, err
