"""Requests that share an engine: interleaved streams, a request that fails mid-step, and
request values that used to slip past validation."""
import pytest

from infergraft import core
from infergraft.core.runner import sampler as sampler_module
from infergraft.core.errors import InvalidRequestError, RequestFailedError
from infergraft.core.testing.models import random_model, random_prompt, tiny_llama_config


@pytest.fixture(scope="module")
def tiny():
    hf = random_model(tiny_llama_config(), seed=7, scale=5.0)
    return core.build(hf, plugins=["paged"], max_seq_len=64, max_batch_size=4)


def _alone(engine, prompt, n=10):
    return engine.generate(prompt, max_new_tokens=n)[0].token_ids


def test_interleaved_streams_each_get_every_token(tiny):
    a, b = random_prompt(4, 256, 1), random_prompt(3, 256, 2)
    want_a, want_b = _alone(tiny, a), _alone(tiny, b)
    s1, s2 = tiny.stream(a, max_new_tokens=10), tiny.stream(b, max_new_tokens=10)
    got_a, got_b = [], []
    for _ in range(12):  # each next() steps the engine for both requests
        got_a += next(s1, [])
        got_b += next(s2, [])
    assert got_a == want_a and got_b == want_b


def test_a_stream_finished_by_another_call_still_sends_everything(tiny):
    a, b = random_prompt(4, 256, 3), random_prompt(5, 256, 4)
    want = _alone(tiny, a)
    stream = tiny.stream(a, max_new_tokens=10)
    first = next(stream)
    tiny.generate(b, max_new_tokens=12)  # runs the stream's request to its end too
    assert first + [t for d in stream for t in d] == want


def test_a_request_whose_sampling_fails_costs_the_others_nothing(tiny,
                                                                 sampling_fails_at_seed_666):
    good = random_prompt(7, 256, 5)
    want = _alone(tiny, good)
    seq = tiny.add_request(good, core.SamplingParams(max_new_tokens=10))
    tiny.step()
    tiny.step()
    with pytest.raises(RequestFailedError, match="sampling failed.*nan.*the others finished"):
        tiny.generate(random_prompt(3, 256, 6), max_new_tokens=4, temperature=1.0, seed=666)
    while tiny.has_unfinished():
        tiny.step()
    assert seq.output_ids == want  # no token lost, none repeated
    assert tiny.cache.stats()["sequences"] == 0


def test_a_failed_request_keeps_its_batch_completions(tiny, monkeypatch):
    real = sampler_module.sample

    def failing(logits, seqs):  # sample 0 (seed 666) fails; sample 1 (seed 667) does not
        if any(s.params.seed == 666 for s in seqs):
            raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
        return real(logits, seqs)

    monkeypatch.setattr(sampler_module, "sample", failing)
    prompt = random_prompt(5, 256, 9)
    with pytest.raises(RequestFailedError, match="1 of 2 request") as info:
        tiny.generate(prompt, max_new_tokens=6, temperature=1.0, seed=666, n=2)
    failed, kept = info.value.completions
    assert failed.finish_reason == "error" and failed.token_ids == []
    assert kept.finish_reason == "length" and len(kept.token_ids) == 6
    monkeypatch.setattr(sampler_module, "sample", real)
    alone = tiny.generate(prompt, max_new_tokens=6, temperature=1.0, seed=667)[0]
    assert kept.token_ids == alone.token_ids  # what it gets alone, seed for seed


def test_a_vanishing_temperature_is_greedy(tiny):
    p = random_prompt(6, 256, 7)
    got = tiny.generate(p, max_new_tokens=10, temperature=1e-45, seed=0)[0].token_ids
    assert got == _alone(tiny, p)


@pytest.mark.parametrize("kwargs, match", [
    (dict(top_k=True), "top_k"),
    (dict(max_new_tokens=True), "max_new_tokens"),
    (dict(temperature=True), "temperature"),
    (dict(seed=2 ** 64 - 1), r"seed must be None or an integer in \[0, 2\*\*63\)"),
    (dict(seed=-1), "seed"),
    (dict(stop=5), "stop"),
    (dict(seed=2 ** 63 - 1, n=2, temperature=1.0), r"seed \+ n - 1"),
])
def test_values_that_used_to_slip_through(tiny, kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        tiny.generate(random_prompt(3, 256, 8), **kwargs)
    assert not tiny.has_unfinished()  # nothing of it was queued


def test_stream_refuses_bad_input_at_the_call_and_logits_take_a_tensor(tiny):
    import torch

    with pytest.raises(InvalidRequestError, match="empty"):
        tiny.stream([], max_new_tokens=3)  # before any next()
    p = random_prompt(5, 256, 9)
    assert torch.equal(tiny.logits(torch.tensor(p)), tiny.logits(p))


def test_build_and_request_arguments_of_the_wrong_kind(tiny):
    from infergraft.core.errors import PlanError, UnknownPluginError
    from infergraft.core.loading.source import ModelSourceError
    from infergraft.core.units import parse_bytes
    from infergraft.plugins.paged import PagedBackend

    hf = random_model(tiny_llama_config(), seed=1)
    for plugins in ([None], [PagedBackend()], 5):  # nothing registered by them: said so
        with pytest.raises(UnknownPluginError, match="plugin"):
            core.build(hf, plugins=plugins)
    for device in ("bogus", "mps", "cuda:7"):
        with pytest.raises(PlanError, match="cpu"):  # what this machine has
            core.build(hf, device=device)
    with pytest.raises(PlanError, match="cuda_graphs must be True, False or None"):
        core.build(hf, cuda_graphs="no")
    with pytest.raises(ModelSourceError, match="tokenizer must be"):
        core.build(hf, tokenizer="gpt2")
    with pytest.raises(InvalidRequestError, match=r"SamplingParams\(\*\*"):
        tiny.add_request([5, 6], {"max_new_tokens": 3})
    assert parse_bytes("1e9") == 10 ** 9  # the form the error message suggests
    assert not tiny.has_unfinished()


def test_logits_beside_a_full_batch_says_what_to_do():
    from infergraft.core.cache import CacheFullError

    engine = core.build(random_model(tiny_llama_config(), seed=2), max_seq_len=64,
                        max_batch_size=2)  # contiguous: one row per sequence
    for seed in (1, 2):
        engine.add_request(random_prompt(3, 256, seed), core.SamplingParams(max_new_tokens=4))
    engine.step()
    with pytest.raises(CacheFullError, match="engine.logits needs room for 3 tokens.*fewer run"):
        engine.logits([1, 2, 3])
    while engine.has_unfinished():
        engine.step()
    assert engine.logits([1, 2, 3]).shape == (3, 256)


def test_a_step_that_fails_in_the_model_is_recomputed_for_the_others(tiny, monkeypatch):
    good = random_prompt(6, 256, 10)
    want = _alone(tiny, good)
    seq = tiny.add_request(good, core.SamplingParams(max_new_tokens=10))
    tiny.step()
    tiny.step()  # two tokens in, K/V of 8 positions written
    real, calls = tiny.model.forward, []

    def failing(*args, **kwargs):  # one step dies mid-forward (an OOM, a Ctrl-C)
        calls.append(1)
        if len(calls) == 1:
            real(*args, **kwargs)  # its K/V writes land, then it fails
            raise RuntimeError("CUDA out of memory (simulated)")
        return real(*args, **kwargs)

    monkeypatch.setattr(tiny.model, "forward", failing)
    with pytest.raises(RuntimeError, match="simulated"):
        tiny.generate(random_prompt(4, 256, 11), max_new_tokens=5)
    while tiny.has_unfinished():
        tiny.step()
    assert seq.output_ids == want  # recomputed from its tokens so far: nothing lost or repeated
    assert tiny.cache.stats()["sequences"] == 0


def test_a_nan_row_fails_alone_and_seeded_neighbours_draw_as_if_alone():
    import torch

    from infergraft.core.request import Sequence
    from infergraft.core.runner.sampler import sample, sample_each

    def seqs():
        return [Sequence([1], core.SamplingParams(temperature=1.0, seed=1)),
                Sequence([1], core.SamplingParams()),  # greedy: argmax would pick the NaN
                Sequence([1], core.SamplingParams(temperature=1.0, seed=2))]

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    sick = logits.clone()
    sick[1, 7] = float("nan")
    alone, mixed = seqs(), seqs()
    want = [sample(logits[[0, 2]], [alone[0], alone[2]]) for _ in range(4)]
    got = [sample_each(sick, mixed) for _ in range(4)]
    assert [g[1] for g in got] == [-1] * 4 and "NaN logits" in mixed[1].error
    assert [[g[0], g[2]] for g in got] == want  # no draw lost to the failing row


def test_an_interrupt_while_sampling_is_recomputed_for_the_others(tiny, monkeypatch):
    from infergraft.core import engine as engine_module

    good = random_prompt(6, 256, 12)
    want = _alone(tiny, good)
    seq = tiny.add_request(good, core.SamplingParams(max_new_tokens=10))
    tiny.step()
    tiny.step()
    real, calls = engine_module.sample_each, []

    def interrupted(logits, seqs):  # Ctrl-C lands after the step's K/V are written
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real(logits, seqs)

    monkeypatch.setattr(engine_module, "sample_each", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tiny.generate(random_prompt(4, 256, 13), max_new_tokens=5)
    while tiny.has_unfinished():
        tiny.step()
    assert seq.output_ids == want
