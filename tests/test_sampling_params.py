"""Sampling parameters end to end: validation of the penalties, min_p and logprobs; the
engine's logprobs against the log-softmax of its own logits (greedy, sampled, forked
samples, a step interrupted after sampling); penalised greedy decoding against HF's
``generate`` and an OpenAI-formula reference, on the contiguous and paged caches and
through the decode-graph runner (which must not take the greedy look-ahead for them)."""
import math

import attrs
import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from infergraft import core
from infergraft.core.errors import InvalidRequestError
from infergraft.core.request import Sequence, TokenLogprob
from infergraft.core.runner.cuda_graph import CudaGraphRunner
from infergraft.core.testing.models import random_model, random_prompt, tiny_llama_config

SP = core.SamplingParams
V = 256


@pytest.fixture(scope="module")
def hf():
    return random_model(tiny_llama_config(), seed=11, scale=5.0)


@pytest.fixture(scope="module", params=["contiguous", "paged"])
def engine(request, hf):
    return core.build(hf, plugins=[request.param], max_seq_len=64, max_batch_size=4)


@pytest.mark.parametrize("field, bad, accepted", [
    ("logprobs", -1, "[0, 20]"), ("logprobs", 21, "[0, 20]"), ("logprobs", True, "[0, 20]"),
    ("logprobs", 2.0, "[0, 20]"),
    ("presence_penalty", 2.5, "[-2, 2]"), ("presence_penalty", float("nan"), "[-2, 2]"),
    ("presence_penalty", True, "[-2, 2]"), ("presence_penalty", "0.1", "[-2, 2]"),
    ("frequency_penalty", -2.01, "[-2, 2]"), ("frequency_penalty", float("-inf"), "[-2, 2]"),
    ("frequency_penalty", None, "[-2, 2]"),
    ("repetition_penalty", 0, "> 0"), ("repetition_penalty", -1.2, "> 0"),
    ("repetition_penalty", float("inf"), "> 0"), ("repetition_penalty", False, "> 0"),
    pytest.param("repetition_penalty", 10 ** 400, "> 0", id="an int past float's range"),
    ("min_p", -0.1, "[0, 1]"), ("min_p", 1.5, "[0, 1]"), ("min_p", float("nan"), "[0, 1]"),
    ("min_p", True, "[0, 1]"),
    pytest.param("temperature", -10 ** 400, ">= 0", id="a negative int past float's range"),
])
def test_bad_values_name_the_field_the_value_and_what_is_accepted(field, bad, accepted):
    with pytest.raises(InvalidRequestError) as e:
        SP(**{field: bad})
    msg = str(e.value)
    assert msg.startswith(field) and repr(bad) in msg and accepted in msg


@pytest.mark.parametrize("kw", [dict(logprobs=0), dict(logprobs=20), dict(presence_penalty=-2),
                                dict(frequency_penalty=2.0), dict(repetition_penalty=0.01),
                                dict(repetition_penalty=3), dict(min_p=1), dict(min_p=0.05)])
def test_edges_are_accepted_and_need_processing(kw):
    p = SP(**kw)
    assert p.needs_logits_processing and not p.plain_greedy


def test_defaults_and_flags():
    p = SP()
    assert (p.logprobs, p.presence_penalty, p.frequency_penalty, p.repetition_penalty,
            p.min_p) == (None, 0.0, 0.0, 1.0, 0.0)
    assert not p.needs_logits_processing and p.plain_greedy
    assert SP(repetition_penalty=1, min_p=0, presence_penalty=0).plain_greedy  # ints: defaults
    assert not SP(temperature=0.5).plain_greedy and not SP(temperature=0.5).needs_logits_processing
    assert not attrs.evolve(p, logprobs=2).plain_greedy  # recomputed by evolve
    back = attrs.evolve(SP(min_p=0.1), min_p=0.0)
    assert back == p and back.plain_greedy
    assert "plain_greedy" not in repr(p) and hash(p) == hash(SP())
    with pytest.raises(TypeError):
        SP(plain_greedy=True)
    assert Sequence([1], p).logprobs is None and Sequence([1], SP(logprobs=0)).logprobs == []


def _run(engine, prompt, **kw):
    seq = engine.add_request(prompt, SP(**kw))
    while not seq.finished:
        engine.step()
    return seq


def _reference(engine, seq, rep=1.0, freq=0.0, pres=0.0, temperature=1.0):
    """Per output position: log_softmax of the engine's own logits at that position,
    penalised by HF's processor and the OpenAI formula, then scaled."""
    out = []
    for i in range(len(seq.output_ids)):
        ids = seq.prompt_ids + seq.output_ids[:i]
        row = engine.logits(ids)[-1:].clone()  # [1, V]
        if rep != 1:
            row = RepetitionPenaltyLogitsProcessor(rep)(torch.tensor([ids]), row)
        for j in set(seq.output_ids[:i]):
            c = seq.output_ids[:i].count(j)
            row[0, j] -= c * freq + pres
        out.append((row[0] / temperature).log_softmax(-1))
    return out


def _check_logprobs(seq, refs, k):
    assert len(seq.logprobs) == len(seq.output_ids) == len(refs)
    for tok, rec, ref in zip(seq.output_ids, seq.logprobs, refs):
        assert isinstance(rec, TokenLogprob) and rec.token_id == tok
        assert math.isclose(rec.logprob, float(ref[tok]), abs_tol=2e-4), (rec, float(ref[tok]))
        ids, values = [t for t, _ in rec.top], [v for _, v in rec.top]
        assert len(ids) == k and values == sorted(values, reverse=True)
        if k:
            assert ids[0] == int(ref.argmax())
        assert values == pytest.approx(ref[ids].tolist(), abs=2e-4)


def test_greedy_logprobs_equal_log_softmax_of_the_engine_logits(engine):
    prompt = random_prompt(7, V, 1)
    plain = _run(engine, prompt, max_new_tokens=10)
    seq = _run(engine, prompt, max_new_tokens=10, logprobs=5)
    assert seq.output_ids == plain.output_ids and plain.logprobs is None
    _check_logprobs(seq, _reference(engine, seq), 5)
    done = engine._completion(seq)
    assert done.logprobs == seq.logprobs and engine._completion(plain).logprobs is None


def test_sampled_penalised_logprobs_are_of_the_distribution_drawn_from(engine):
    kw = dict(temperature=0.7, top_k=20, repetition_penalty=1.2, frequency_penalty=0.5,
              presence_penalty=-0.3, seed=5)
    seq = _run(engine, random_prompt(5, V, 2), max_new_tokens=12, logprobs=3, **kw)
    refs = _reference(engine, seq, 1.2, 0.5, -0.3, 0.7)
    _check_logprobs(seq, refs, 3)
    for tok, ref in zip(seq.output_ids, refs):  # drawn within the top 20 (truncation applied)
        assert tok in torch.topk(ref, 20).indices.tolist()
    again = _run(engine, random_prompt(5, V, 2), max_new_tokens=12, **kw)
    assert again.output_ids == seq.output_ids  # asking for logprobs draws nothing extra


def test_forked_samples_record_logprobs_from_the_prefill_logits(engine):
    prompt = random_prompt(6, V, 3)
    p = SP(max_new_tokens=6, temperature=1.0, seed=10, logprobs=2)
    parent = engine.add_request(prompt, p)
    # as generate(n=3) forks: samples 2..n take their first token from the parent's logits
    kids = [Sequence(list(prompt), attrs.evolve(p, seed=10 + i)) for i in (1, 2)]
    engine._forks[parent.id] = kids
    while not all(s.finished for s in [parent, *kids]):
        engine.step()
    assert engine.cache.stats()["sequences"] == 0
    for s in (parent, *kids):
        _check_logprobs(s, _reference(engine, s), 2)
    assert len({tuple(s.output_ids) for s in (parent, *kids)}) > 1


def test_a_step_interrupted_after_sampling_keeps_one_record_per_token(engine, monkeypatch):
    prompt = random_prompt(8, V, 4)
    want = _run(engine, prompt, max_new_tokens=8, logprobs=4, repetition_penalty=1.5)
    seq = engine.add_request(prompt, SP(max_new_tokens=8, logprobs=4, repetition_penalty=1.5))
    for _ in range(3):
        engine.step()
    real, calls = engine._append, []

    def interrupted(s, tok, now):  # Ctrl-C after the sampler recorded this step's logprob
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real(s, tok, now)
    monkeypatch.setattr(engine, "_append", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    assert len(seq.logprobs) == len(seq.output_ids) + 1  # recorded, token not appended
    while not seq.finished:  # preempted: recomputed from its tokens so far
        engine.step()
    assert seq.output_ids == want.output_ids
    assert [r.token_id for r in seq.logprobs] == seq.output_ids
    _check_logprobs(seq, _reference(engine, seq, rep=1.5), 4)


def _hf_greedy(hf, prompt, n, rep):
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                      do_sample=False, repetition_penalty=rep, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_repetition_penalised_greedy_equals_hf_generate(engine, hf):
    prompts = [random_prompt(n, V, 20 + n) for n in (4, 11, 7)]
    reps = [1.3, 2.0, 1.0]  # a plain greedy request in the same batch
    seqs = [engine.add_request(p, SP(max_new_tokens=14, repetition_penalty=r))
            for p, r in zip(prompts, reps)]
    while engine.has_unfinished():
        engine.step()
    for s, p, r in zip(seqs, prompts, reps):
        assert s.output_ids == _hf_greedy(hf, p, 14, r)
    assert seqs[0].output_ids != _run(engine, prompts[0], max_new_tokens=14).output_ids


def test_presence_and_frequency_penalised_greedy_equal_the_openai_formula(engine, hf):
    prompt = random_prompt(5, V, 30)
    seq = _run(engine, prompt, max_new_tokens=14, presence_penalty=0.8, frequency_penalty=1.1,
               min_p=0.3)  # min_p never changes the argmax
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(len(seq.output_ids)):
            row = hf(torch.tensor([ids])).logits[0, -1]
            out = ids[len(prompt):]
            for j in set(out):
                row[j] -= out.count(j) * 1.1 + 0.8
            ids.append(int(row.argmax()))
    assert seq.output_ids == ids[len(prompt):]
    assert len(set(seq.output_ids)) > len(set(_run(engine, prompt, max_new_tokens=14).output_ids))


@pytest.mark.parametrize("backend", ["contiguous", "paged"])
def test_decode_graphs_sample_penalised_requests_without_the_look_ahead(hf, backend):
    engine = core.build(hf, plugins=[backend], max_seq_len=64, max_batch_size=2)
    engine.cache.device_decode = True  # contiguous: tensor-only decode metadata
    runner = CudaGraphRunner(engine.model, engine.cache, 2, buckets=(2,), use_graphs=False)
    runner.capture()
    engine.decode_graphs = runner
    launches = []
    launch = runner.launch
    runner.launch = lambda ids, tokens: launches.append(tokens) or launch(ids, tokens)
    prompts = [random_prompt(n, V, 40 + n) for n in (6, 9)]
    seqs = [engine.add_request(p, SP(max_new_tokens=12, repetition_penalty=1.6, logprobs=1))
            for p in prompts]
    while engine.has_unfinished():
        engine.step()
    assert launches == [] and runner.replays > 0  # replayed, sampled on the host
    for s, p in zip(seqs, prompts):
        assert s.output_ids == _hf_greedy(hf, p, 12, 1.6)
        assert len(s.logprobs) == len(s.output_ids)
    plain = engine.add_request(prompts[0], SP(max_new_tokens=12))
    other = engine.add_request(prompts[1], SP(max_new_tokens=12))
    while engine.has_unfinished():
        engine.step()
    assert any(t is None for t in launches)  # plain greedy batches still look ahead
    assert plain.output_ids == _hf_greedy(hf, prompts[0], 12, 1.0)
    assert other.output_ids == _hf_greedy(hf, prompts[1], 12, 1.0)
