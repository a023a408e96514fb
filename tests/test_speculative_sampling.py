"""Sampled requests under speculative decoding stay exact: rejection sampling
(core/speculative/verify.py) draws every token from the target's distribution, whatever
was proposed (chi-square at 99.9% over thousands of draws, on random logits: the function
itself, so the test is fast); a seeded request reproduces; penalties and logprobs see the
proposed tokens before each row, so a greedy request with them gets the plain engine's
tokens and log-probabilities."""
import pytest
import torch

from infergraft import core
from infergraft.core.request import SamplingParams
from infergraft.core.speculative.verify import accept_greedy, rejection_sample
from infergraft.core.testing.models import random_model, random_prompt, tiny_llama_config

DRAWS = 4000
V = 12


def p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square test of ``counts`` [V] against ``probs`` [V]: its p-value
    (cells expecting under 5 draws pooled into one)."""
    expected = probs.double() * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = torch.tensor(float(len(obs) - 1), dtype=torch.double)
    return float(torch.special.gammaincc(df / 2, stat / 2))


def target(seed: int, rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, V, generator=g) * 1.5).softmax(-1)  # [rows, V]


@pytest.mark.parametrize("which", ["likely", "unlikely"])
def test_a_point_mass_draft_keeps_the_target_distribution(which):
    """n-gram and greedy drafts: the first token is distributed as the target's first row
    whether the proposed token is its likeliest or nearly impossible; after a kept one, the
    second as its second row."""
    probs = target(1 if which == "likely" else 2, 3)
    order = probs[0].argsort(descending=True)
    first = int(order[0] if which == "likely" else order[-1])
    second = int(probs[1].argmax())
    g = torch.Generator().manual_seed(0)
    draws = [rejection_sample(probs, (first, second), None, g) for _ in range(DRAWS)]
    heads = torch.bincount(torch.tensor([d[0] for d in draws]), minlength=V)
    assert p_value(heads, probs[0]) > 1e-3, (heads, probs[0])
    seconds = [d[1] for d in draws if d[0] == first]
    assert len(seconds) > 50 or which == "unlikely"
    if len(seconds) > 50:
        counts = torch.bincount(torch.tensor(seconds), minlength=V)
        assert p_value(counts, probs[1]) > 1e-3, (counts, probs[1])
    # the proposed token is kept about as often as the target gives it
    kept = sum(d[0] == first for d in draws) / DRAWS
    assert abs(kept - float(probs[0, first])) < 4 * (0.25 / DRAWS) ** 0.5


def test_a_sampled_draft_keeps_the_target_distribution():
    """A draft drawn from its own distribution q: tokens still come out as the target's."""
    probs, q = target(3, 2), target(4, 1)
    g = torch.Generator().manual_seed(1)
    heads = torch.zeros(V, dtype=torch.long)
    for _ in range(DRAWS):
        t = int(torch.multinomial(q[0], 1, generator=g))
        heads[rejection_sample(probs, (t,), q, g)[0]] += 1
    assert p_value(heads, probs[0]) > 1e-3, (heads, probs[0])


def test_the_chi_square_test_can_fail():
    """The test above is no vacuous pass: draws from another distribution fail it."""
    probs, other = target(1, 1)[0], target(9, 1)[0]
    g = torch.Generator().manual_seed(2)
    counts = torch.bincount(torch.multinomial(other, DRAWS, replacement=True, generator=g),
                            minlength=V)
    assert p_value(counts, probs) < 1e-3


def test_greedy_acceptance():
    assert accept_greedy([5, 6, 7], (5, 6)) == [5, 6, 7]  # all kept, then the bonus
    assert accept_greedy([5, 9, 7], (5, 6)) == [5, 9]  # the target's token replaces the first miss
    assert accept_greedy([4, 6, 7], (5, 6)) == [4]


@pytest.fixture(scope="module")
def hf():
    return random_model(tiny_llama_config(), seed=5, scale=5.0)


def build(hf, speculative=None):
    return core.build(hf, plugins=["paged"], max_seq_len=64, max_batch_size=4, block_size=4,
                      speculative=speculative)


PROMPT = random_prompt(5, 256, 1) * 3
NGRAM = {"method": "ngram", "k": 4}


def test_a_seeded_sampled_request_reproduces(hf):
    params = SamplingParams(max_new_tokens=30, temperature=0.7, top_k=20, seed=3,
                            ignore_eos=True)
    runs = []
    for _ in range(2):
        engine = build(hf, NGRAM)
        seq = engine.add_request(PROMPT, params)
        while engine.has_unfinished():
            engine.step()
        runs.append(seq.output_ids)
        assert seq.metrics.num_drafts > 0
    other = build(hf, NGRAM).generate(PROMPT, max_new_tokens=30, temperature=0.7, top_k=20,
                                      seed=4, ignore_eos=True)[0].token_ids
    assert runs[0] == runs[1] and len(runs[0]) == 30 and other != runs[0]


def test_penalties_and_logprobs_see_the_proposed_tokens(hf):
    """Greedy with a repetition penalty and logprobs: row i is penalised for the proposed
    tokens before it, so tokens and log-probabilities are the plain engine's."""
    # penalties light enough that the output still repeats (drafts are kept), strong
    # enough that a row penalised without the kept tokens before it takes another token
    kw = dict(max_new_tokens=24, ignore_eos=True, repetition_penalty=1.05,
              frequency_penalty=0.1, logprobs=2)
    want = build(hf).generate(PROMPT, **kw)[0]
    got = build(hf, NGRAM).generate(PROMPT, **kw)[0]
    assert got.token_ids == want.token_ids
    assert got.metrics.num_accepted_tokens > 0
    assert [e.token_id for e in got.logprobs] == got.token_ids
    for a, b in zip(got.logprobs, want.logprobs):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
