"""The ``draft`` proposer (core/speculative/draft.py): a smaller model, built by
core.build with its own paged cache, proposes greedily. The target's tokens come out
whatever it proposes: with the target itself as the draft nearly every proposed token is
kept; with another random model few are, and the tokens are still the plain engine's. A
draft of another vocabulary, or a draft setting build would take from the target, is
refused before anything is served."""
import pytest

from infergraft import core
from infergraft.core.errors import PlanError
from infergraft.core.request import SamplingParams
from infergraft.core.testing.models import random_model, random_prompt, tiny_llama_config

KW = dict(plugins=["paged"], max_seq_len=64, max_batch_size=4, block_size=4)
PROMPTS = [random_prompt(n, 256, 30 + n) for n in (5, 11, 17)]


@pytest.fixture(scope="module")
def hf():
    return random_model(tiny_llama_config(), seed=5, scale=5.0)


@pytest.fixture(scope="module")
def plain_tokens(hf):
    engine = core.build(hf, **KW)
    return [c.token_ids for c in engine.generate(PROMPTS, max_new_tokens=24, ignore_eos=True)]


def draft(model, k=3, **more):
    return {"method": "draft", "model": model, "k": k, **more}


def test_the_target_as_its_own_draft_is_accepted(hf, plain_tokens):
    engine = core.build(hf, **KW, speculative=draft(hf))
    done = engine.generate(PROMPTS, max_new_tokens=24, ignore_eos=True)
    assert [c.token_ids for c in done] == plain_tokens
    stats = engine.stats()
    assert stats["spec_decode_num_draft_tokens"] > 0
    assert stats["spec_decode_draft_acceptance_rate"] > 0.95, stats
    assert all(c.metrics.mean_accepted_length > 3 for c in done)  # k = 3: up to 4 a step


def test_another_model_as_the_draft_changes_no_token(hf, plain_tokens):
    other = random_model(tiny_llama_config(num_hidden_layers=1), seed=8, scale=5.0)
    engine = core.build(hf, **KW, speculative=draft(other, k=2))
    done = engine.generate(PROMPTS, max_new_tokens=24, ignore_eos=True)
    assert [c.token_ids for c in done] == plain_tokens
    stats = engine.stats()
    assert 0 < stats["spec_decode_num_draft_tokens"]
    assert stats["spec_decode_draft_acceptance_rate"] < 0.95, stats
    engine.cache.check_invariants()
    drafter = engine.speculation.drafter
    drafter.engine.cache.check_invariants()


def test_the_draft_follows_preemption_and_chunks(hf):
    """A pool too small for the batch and chunked prompts: requests preempted and
    prefilled again keep their tokens; the draft's cache forgets what they no longer hold."""
    opts = dict(KW, num_blocks=16, max_num_batched_tokens=8, preemption="recompute")
    want = [c.token_ids for c in core.build(hf, **opts).generate(
        PROMPTS, max_new_tokens=24, ignore_eos=True)]
    engine = core.build(hf, **opts, speculative=draft(hf))
    done = engine.generate(PROMPTS, max_new_tokens=24, ignore_eos=True)
    assert [c.token_ids for c in done] == want
    assert engine.stats()["num_preemptions"] > 0
    assert engine.stats()["spec_decode_num_accepted_tokens"] > 0


def test_a_sampled_request_with_a_draft_reproduces(hf):
    runs = []
    for _ in range(2):
        engine = core.build(hf, **KW, speculative=draft(hf))
        seq = engine.add_request(PROMPTS[0], SamplingParams(max_new_tokens=20, temperature=0.3,
                                                            seed=11, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        runs.append(seq.output_ids)
        assert seq.metrics.num_accepted_tokens > 0
    assert runs[0] == runs[1]


def test_a_draft_of_another_vocabulary_is_refused(hf):
    other = random_model(tiny_llama_config(vocab_size=300), seed=8)
    with pytest.raises(PlanError, match="vocabulary of 300 tokens, the target 256"):
        core.build(hf, **KW, speculative=draft(other))


@pytest.mark.parametrize("value, match", [
    ({"method": "draft"}, "give the draft model"),
    ({"method": "draft", "model": "x", "build": {"max_seq_len": 8}}, r"may not set \['max_seq_len'\]"),
    ({"method": "draft", "model": "x", "build": ["paged"]}, "build must be an object"),
])
def test_bad_draft_settings_are_refused(hf, value, match):
    with pytest.raises(PlanError, match=match):
        core.build(hf, **KW, speculative=value)
