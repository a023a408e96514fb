"""Speculation turns itself down where it does not pay (core/speculative/cost.py): the
engine fits its own step times, ``seconds ~ c0 + c1 * tokens + c2 * drafted``; a greedy
request whose proposed tokens are kept less often than their share of a step's cost stops
proposing for a pause, then probes once; past ``SHARE_OFF`` no greedy request proposes.
A sampled request is never held by cost (its draws would depend on the machine's timing,
and its seed would not reproduce)."""
import pytest

from infergraft import core
from infergraft.core.request import SamplingParams
from infergraft.core.speculative.adaptive import AdaptiveK
from infergraft.core.speculative.cost import SHARE_OFF, StepCost
from infergraft.core.testing.models import random_model, random_prompt, tiny_llama_config


def fed(cost, points, drafted=False):
    for tokens, seconds in points:
        cost.observe(tokens, seconds, drafted)


def test_the_fit_finds_the_cost_of_a_token():
    cost = StepCost()
    assert cost.share(1) == 0.0  # nothing known: proposing is free
    fed(cost, [(1, 9.0), (1, 9.0)])  # warm-up steps (a first run's allocations): left out
    fed(cost, [(1, 0.010)] * 5)
    assert cost.fit() is None and cost.share(8) == 0.0  # one token count: no slope yet
    fed(cost, [(5, 50.0), (5, 50.0)], drafted=True)  # the first steps with drafts: left out
    fed(cost, [(5, 0.018), (9, 0.026), (5, 0.018), (1, 0.010), (9, 0.026)], drafted=True)
    assert cost.fit() == pytest.approx((0.008, 0.002, 0.0), abs=1e-9)
    assert cost.share(1, 1) == pytest.approx(0.002 / 0.010)
    assert cost.share(32) == pytest.approx(0.064 / 0.072)
    fed(cost, [(5, 1.0)], drafted=True)  # a step 50 times slower than expected: ignored
    assert cost.fit() == pytest.approx((0.008, 0.002, 0.0), abs=1e-9)


def test_a_drafted_steps_own_overhead_is_counted():
    """A small model on a GPU: a plain step's host time hides behind the look-ahead, a
    verify step's does not; with every draft of one size the difference is the overhead's,
    shared by the tokens proposed together."""
    cost = StepCost()
    fed(cost, [(1, 0.0005)] * 8)
    fed(cost, [(5, 0.0012)] * 8, drafted=True)
    assert cost.fit() == pytest.approx((0.0005, 0.0, 0.0007))
    assert cost.share(1, 4) == pytest.approx(0.0007 / (4 * 0.0005))  # 0.35
    assert cost.share(1, 1) == 1.0  # one proposed token cannot pay for the overhead
    # steps of several sizes tell the two apart: c0 2 ms, c1 0.1 ms a token, c2 0.4 ms
    cost = StepCost()
    fed(cost, [(b, 0.002 + 0.0001 * b) for b in (1, 2, 4, 8, 1, 2, 4, 8)])
    fed(cost, [(t, 0.0024 + 0.0001 * t) for t in (3, 5, 9, 12, 3, 5, 9, 12)], drafted=True)
    c0, c1, c2 = cost.fit()
    assert (c0, c1, c2) == pytest.approx((0.002, 0.0001, 0.0004))
    assert cost.share(8, 16) == pytest.approx((0.0001 * 16 + 0.0004) * 8 / (16 * 0.0028))
    # drafted steps a little cheaper than their tokens say (noise): c2 goes, c1 stays
    cost = StepCost()
    fed(cost, [(b, 0.002 + 0.0001 * b) for b in (1, 2, 4, 8, 1, 2, 4, 8)])
    fed(cost, [(t, 0.00195 + 0.0001 * t) for t in (3, 5, 9, 12, 3, 5, 9, 12)], drafted=True)
    c0, c1, c2 = cost.fit()
    assert c1 == pytest.approx(0.0001, rel=0.05) and c2 == 0.0


def test_a_held_request_probes_again_after_its_pause():
    a = AdaptiveK(4)
    a.update(4, 0)
    assert a.rate == 0.0
    a.hold()
    takes = [a.take() for _ in range(a.pause)]
    assert set(takes) == {0} and a.probing  # the pause is over: the next draft probes
    a.update(3, 3)
    assert not a.probing and 0 < a.rate < 1


@pytest.fixture(scope="module")
def hf():
    return random_model(tiny_llama_config(), seed=5, scale=5.0)


def run(hf, share: float, params):
    engine = core.build(hf, plugins=["paged"], max_seq_len=64, max_batch_size=4, block_size=4,
                        speculative={"method": "ngram", "k": 4})
    engine.speculation.cost.share = lambda *args: share  # what this machine would measure
    prompts = [random_prompt(n, 256, 70 + n) for n in (6, 9, 12, 15)]
    seqs = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    return [s.output_ids for s in seqs], sum(s.metrics.num_draft_tokens for s in seqs)


def test_costly_drafts_are_held_and_the_tokens_stay(hf):
    greedy = SamplingParams(max_new_tokens=40, ignore_eos=True)
    free_tokens, free_drafts = run(hf, 0.0, greedy)
    held_tokens, held_drafts = run(hf, 0.6, greedy)
    off_tokens, off_drafts = run(hf, SHARE_OFF, greedy)
    assert free_tokens == held_tokens == off_tokens
    assert free_drafts > 0 and held_drafts < free_drafts and off_drafts == 0, \
        (free_drafts, held_drafts)


def test_a_sampled_request_is_not_held_by_cost(hf):
    sampled = SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=0.5, seed=3)
    free = run(hf, 0.0, sampled)
    assert free == run(hf, SHARE_OFF, sampled) and free[1] > 0


def test_a_request_whose_k_shrank_may_still_propose_where_a_full_draft_pays(hf):
    """A verify step's own overhead (c2) as large as a plain step: one proposed token can
    never pay, four can. A request whose refused drafts shrank its k to one stays eligible
    (its next kept draft grows k again); priced at its current k it would never draft again."""
    engine = core.build(hf, plugins=["paged"], max_seq_len=64, max_batch_size=4, block_size=4,
                        speculative={"method": "ngram", "k": 4})
    spec = engine.speculation
    fed(spec.cost, [(1, 0.0005)] * 8)
    fed(spec.cost, [(5, 0.0010)] * 8, drafted=True)
    assert spec.cost.share(1, 1) >= SHARE_OFF > spec.cost.share(1, 4)
    seq = engine.add_request(random_prompt(6, 256, 3), SamplingParams(max_new_tokens=8))
    engine.step()  # its prefill
    seq.speculation = AdaptiveK(4)
    seq.speculation.k = 1
    assert spec.wants([seq])
