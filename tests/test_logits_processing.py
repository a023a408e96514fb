"""The sampler's logits processing (core/runner/sampler.py) against its references, on
random logits and random token histories: HF's RepetitionPenaltyLogitsProcessor,
MinPLogitsWarper (and the whole chain with TopK / TopP / Temperature), OpenAI's formula
for the presence and frequency penalties; logprobs records; the plain-greedy fast path."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import (MinPLogitsWarper,
                                                    RepetitionPenaltyLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

from infergraft.core.request import SamplingParams, Sequence
from infergraft.core.runner import sampler
from infergraft.core.runner.sampler import penalise, sample, sample_each, truncate

penalties = st.floats(-2, 2, allow_nan=False)


@st.composite
def cases(draw):
    """Random logits [V] and a random history: prompt and output ids that repeat."""
    vocab = draw(st.integers(2, 300))
    seed = draw(st.integers(0, 2 ** 31))
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab, generator=g) * draw(st.floats(0.1, 8))
    prompt = torch.randint(0, vocab, (draw(st.integers(1, 40)),), generator=g).tolist()
    output = torch.randint(0, vocab, (draw(st.integers(0, 40)),), generator=g).tolist()
    return logits, prompt, output


def _penalised(logits, prompt, output, **kw):
    p = SamplingParams(**kw)
    seq = Sequence(prompt, p)
    seq.output_ids = output
    return penalise(logits, p, seq.prompt_id_set(), output)


@settings(max_examples=60, deadline=None)
@given(cases(), st.floats(0.05, 5))
def test_repetition_penalty_equals_hf(case, penalty):
    logits, prompt, output = case
    want = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([prompt + output]),
                                                     logits[None].clone())[0]
    got = _penalised(logits, prompt, output, repetition_penalty=penalty)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@settings(max_examples=60, deadline=None)
@given(cases(), penalties, penalties)
def test_presence_and_frequency_penalties_equal_openai_formula(case, presence, frequency):
    logits, prompt, output = case
    # OpenAI: mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence, with c[j]
    # the times token j was generated so far (the prompt does not count)
    want = logits.clone()
    for j in set(output):
        c = output.count(j)
        want[j] = logits[j] - c * frequency - (1.0 if c > 0 else 0.0) * presence
    got = _penalised(logits, prompt, output, presence_penalty=presence,
                     frequency_penalty=frequency)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)


@settings(max_examples=40, deadline=None)
@given(cases(), st.floats(0.05, 5), penalties, penalties)
def test_penalties_compose_repetition_first(case, rep, presence, frequency):
    logits, prompt, output = case
    hf = RepetitionPenaltyLogitsProcessor(rep)(torch.tensor([prompt + output]),
                                               logits[None].clone())[0]
    want = _penalised(hf, prompt, output, presence_penalty=presence,
                      frequency_penalty=frequency)
    got = _penalised(logits, prompt, output, repetition_penalty=rep,
                     presence_penalty=presence, frequency_penalty=frequency)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@settings(max_examples=60, deadline=None)
@given(cases(), st.floats(0, 1))
def test_min_p_equals_hf(case, min_p):
    logits = case[0]
    want = MinPLogitsWarper(min_p)(None, logits[None].clone())[0] if min_p > 0 else logits
    got = truncate(logits, None, None, min_p)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not torch.isinf(got[logits.argmax()])  # the most likely token always stays


@settings(max_examples=60, deadline=None)
@given(cases(), st.floats(0.1, 3), st.integers(1, 400), st.floats(0.05, 1), st.floats(0, 1))
def test_temperature_top_k_top_p_min_p_chain_equals_hf(case, temperature, k, top_p, min_p):
    logits = case[0]
    want = logits[None].clone()
    chain = [TemperatureLogitsWarper(temperature), TopKLogitsWarper(k), TopPLogitsWarper(top_p)]
    for w in chain + ([MinPLogitsWarper(min_p)] if min_p > 0 else []):
        want = w(None, want)
    got = sampler.filter_logits(logits, temperature, k, top_p, min_p)
    # the distributions drawn from (HF's top-p also drops tokens whose probability
    # underflows to 0, where ours keeps them at probability 0)
    torch.testing.assert_close(got.softmax(-1), want[0].softmax(-1), rtol=1e-5, atol=1e-6)


def _seq(prompt=(5, 6, 7), **kw):
    return Sequence(list(prompt), SamplingParams(**kw))


@pytest.mark.parametrize("kw", [dict(), dict(temperature=0.8, seed=3),
                                dict(repetition_penalty=1.7, presence_penalty=0.5,
                                     frequency_penalty=-0.3),
                                dict(temperature=1.3, seed=4, frequency_penalty=1.5, top_k=9)])
def test_logprobs_are_log_softmax_of_the_penalised_scaled_logits(kw):
    logits = torch.randn(2, 64, generator=torch.Generator().manual_seed(1)) * 3
    seq = _seq(logprobs=5, **kw)
    seq.output_ids = [5, 9, 9, 40]
    tok = sample(logits[1:], [seq])[0]
    p = seq.params
    dist = penalise(logits[1], p, seq.prompt_id_set(), seq.output_ids)
    ref = (dist / (1 if p.greedy else p.temperature)).log_softmax(-1)
    if p.greedy:
        assert tok == int(dist.argmax())
    [rec] = seq.logprobs
    assert rec.token_id == tok and math.isclose(rec.logprob, float(ref[tok]), abs_tol=1e-6)
    ids = [t for t, _ in rec.top]
    values = [v for _, v in rec.top]
    assert len(ids) == 5 and values == sorted(values, reverse=True)
    assert ids[0] == int(ref.argmax())
    assert values == pytest.approx(ref[ids].tolist(), abs=1e-6)
    assert values == pytest.approx(torch.topk(ref, 5).values.tolist(), abs=1e-6)


def test_zero_top_logprobs_records_only_the_sampled_token():
    seq = _seq(logprobs=0, temperature=1.0, seed=1)
    tok = sample(torch.randn(1, 32), [seq])[0]
    assert [(r.token_id, r.top) for r in seq.logprobs] == [(tok, ())]


def test_penalised_greedy_row_avoids_the_raw_argmax():
    logits = torch.zeros(1, 16)
    logits[0, 3], logits[0, 4] = 2.0, 1.5  # token 3 leads, but the prompt holds it
    assert sample(logits, [_seq(prompt=[3])])[0] == 3
    assert sample(logits, [_seq(prompt=[3], repetition_penalty=2.0)])[0] == 4
    assert sample(logits, [_seq(prompt=[3], presence_penalty=1.0)])[0] == 3  # output only
    seq = _seq(prompt=[3], presence_penalty=1.0)
    seq.output_ids = [3]
    assert sample(logits, [seq])[0] == 4


def test_plain_greedy_rows_are_not_processed(monkeypatch):
    drawn = []
    real = sampler._draw
    monkeypatch.setattr(sampler, "_draw",
                        lambda row, seq, a: drawn.append(seq) or real(row, seq, a))
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(2))
    plain = [_seq(), _seq(top_k=3), _seq(), _seq()]  # top_k means nothing when greedy
    assert sample(logits, plain) == logits.argmax(-1).tolist() and drawn == []
    mixed = [_seq(), _seq(min_p=0.2), _seq(temperature=1.0, seed=1), _seq(logprobs=1)]
    got = sample(logits, mixed)
    assert drawn == mixed[1:]
    assert [got[0], got[1], got[3]] == logits[[0, 1, 3]].argmax(-1).tolist()


def test_processed_rows_draw_as_if_alone():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(3)) * 2

    def seqs():
        kw = dict(temperature=0.9, min_p=0.05, frequency_penalty=0.7, logprobs=2)
        return [_seq(seed=1, **kw), _seq(), _seq(seed=2, repetition_penalty=1.4, **kw)]
    alone, batch = seqs(), seqs()
    for _ in range(5):
        want = [sample(logits[r:r + 1], [alone[r]])[0] for r in (0, 2)]
        got = sample(logits, batch)
        assert [got[0], got[2]] == want
        for s, tok in zip([alone[0], alone[2], *batch], want + got):
            s.output_ids.append(tok)  # the penalties see a growing history
    assert [r.logprob for r in batch[0].logprobs] == [r.logprob for r in alone[0].logprobs]


def test_a_retried_row_records_its_logprob_once():
    sick = torch.randn(2, 30, generator=torch.Generator().manual_seed(4))
    sick[1] = float("-inf")  # passes the NaN check; its draw fails after row 0's
    good, bad, alone = (_seq(temperature=1.0, seed=s, logprobs=3) for s in (7, 8, 7))
    tok = sample_each(sick, [good, bad])
    assert tok[1] == -1 and "sampling failed" in bad.error and bad.logprobs == []
    # row 0 drew twice from the same generator state; one record is kept
    assert tok[0] == sample(sick[:1], [alone])[0] and good.logprobs == alone.logprobs
