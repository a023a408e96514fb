"""Engine API: generation options, streaming, metrics, and bad input."""
import pytest
import torch
from transformers import GPT2Config

from infergraft import core
from infergraft.core.errors import (InvalidRequestError, PlanError, UnknownPluginError,
                                    UnsupportedModelError)
from infergraft.core.testing.models import random_model, random_prompt, tiny_llama_config


@pytest.fixture(scope="module")
def tiny():
    hf = random_model(tiny_llama_config(), seed=7, scale=5.0)
    return hf, core.build(hf, max_seq_len=64, max_batch_size=4)


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny):
    _, engine = tiny
    p, q = random_prompt(5, 256, 1), random_prompt(11, 256, 2)
    kw = dict(max_new_tokens=20, temperature=1.3, top_k=50, top_p=0.9, seed=1234)
    a = engine.generate(p, **kw)[0].token_ids
    b = engine.generate([q, p], **kw)[1].token_ids
    assert a == b
    c = engine.generate(p, **{**kw, "seed": 99})[0].token_ids
    assert c != a  # 20 tokens from a lively distribution: equal streams would mean the seed is ignored


def test_top_k_one_is_greedy(tiny):
    _, engine = tiny
    p = random_prompt(9, 256, 3)
    greedy = engine.generate(p, max_new_tokens=12)[0].token_ids
    assert engine.generate(p, max_new_tokens=12, temperature=0.8, top_k=1, seed=5)[0].token_ids == greedy


def test_tiny_top_p_is_greedy(tiny):
    _, engine = tiny
    p = random_prompt(6, 256, 4)
    greedy = engine.generate(p, max_new_tokens=12)[0].token_ids
    assert engine.generate(p, max_new_tokens=12, temperature=1.0, top_p=1e-6, seed=3)[0].token_ids == greedy


def test_length_finish_and_metrics(tiny):
    _, engine = tiny
    seq = engine.add_request(random_prompt(4, 256, 5),
                             core.SamplingParams(max_new_tokens=7, ignore_eos=True))
    while not seq.finished:
        engine.step()
    assert seq.finish_reason == "length" and len(seq.output_ids) == 7
    m = seq.metrics
    assert m.ttft > 0 and m.tokens_per_s > 0 and len(m.itl) == 6 and m.tpot > 0
    assert m.tpot == pytest.approx(sum(m.itl) / 6)


def test_stops_at_eos(tiny):
    hf, engine = tiny
    p = random_prompt(8, 256, 6)
    first = engine.generate(p, max_new_tokens=1)[0].token_ids[0]
    cfg = tiny_llama_config(eos_token_id=first)
    hf2 = random_model(cfg, seed=7, scale=5.0)
    e2 = core.build(hf2, max_seq_len=64, max_batch_size=2)
    c = e2.generate(p, max_new_tokens=10)[0]
    assert c.token_ids == [first] and c.finish_reason == "stop"


def test_stream_yields_token_deltas_without_tokenizer(tiny):
    _, engine = tiny
    p = random_prompt(5, 256, 8)
    deltas = list(engine.stream(p, max_new_tokens=9))
    assert [t for d in deltas for t in d] == engine.generate(p, max_new_tokens=9)[0].token_ids


def test_logits_shape_and_dtype(tiny):
    _, engine = tiny
    out = engine.logits(random_prompt(13, 256, 9))
    assert out.shape == (13, 256) and out.dtype == torch.float32


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=0), "top_k"),
    (dict(max_new_tokens=0), "max_new_tokens"),
])
def test_invalid_sampling_values(tiny, kwargs, match):
    _, engine = tiny
    with pytest.raises(InvalidRequestError, match=match):
        engine.generate(random_prompt(3, 256, 0), **kwargs)


def test_empty_prompt_and_bad_tokens(tiny):
    _, engine = tiny
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.generate([[]])
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        engine.generate([[5, 256]])
    with pytest.raises(InvalidRequestError, match="no tokenizer"):
        engine.generate("hello")


def test_prompt_plus_new_tokens_over_max_seq_len(tiny):
    _, engine = tiny
    with pytest.raises(InvalidRequestError, match=r"exceeds max_seq_len=64"):
        engine.generate(random_prompt(60, 256, 1), max_new_tokens=5)


def test_bad_request_leaves_others_running(tiny):
    _, engine = tiny
    good = random_prompt(7, 256, 11)
    expected = engine.generate(good, max_new_tokens=6)[0].token_ids
    seq = engine.add_request(good, core.SamplingParams(max_new_tokens=6))
    engine.step()  # the good request is running
    with pytest.raises(InvalidRequestError):
        engine.add_request(random_prompt(63, 256, 2), core.SamplingParams(max_new_tokens=6))
    with pytest.raises(InvalidRequestError):
        engine.generate([good, []])  # one bad prompt in a batch: nothing of it is queued
    while engine.has_unfinished():
        engine.step()
    assert seq.output_ids == expected


def test_unsupported_architecture_lists_supported():
    class Config:
        architectures = ["FooForCausalLM"]
        model_type = "foo"

    from infergraft.core.build import choose_policy

    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM") as e:
        choose_policy(core.get_plugin_manager(), Config(), None)
    assert "FooForCausalLM" in str(e.value)


def test_unknown_plugin_lists_known_names(tiny):
    hf, _ = tiny
    with pytest.raises(UnknownPluginError, match="contiguous") as e:
        core.build(hf, plugins=["no-such-cache"])
    assert "no-such-cache" in str(e.value) and "llama" in str(e.value)


def test_unknown_option_and_dtype_are_refused(tiny):
    hf, _ = tiny
    with pytest.raises(PlanError, match="unknown option"):
        core.build(hf, blocksize=16)
    with pytest.raises(PlanError, match="dtype"):
        core.build(hf, dtype="int3")


def test_model_argument_errors(tmp_path):
    with pytest.raises(core.InfergraftError, match="cannot load model"):
        core.build(12345)
    with pytest.raises(core.InfergraftError, match="config.json"):
        core.build(str(tmp_path))
    GPT2Config().save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(core.InfergraftError, match="pickle"):
        core.build(str(tmp_path))


def test_abandoned_stream_frees_only_its_own_request(tiny):
    _, engine = tiny
    other_prompt = random_prompt(6, 256, 12)
    expected = engine.generate(other_prompt, max_new_tokens=8)[0].token_ids
    other = engine.add_request(other_prompt, core.SamplingParams(max_new_tokens=8))
    stream = engine.stream(random_prompt(5, 256, 13), max_new_tokens=20)
    next(stream)
    assert engine.cache.stats()["sequences"] == 2
    stream.close()  # the consumer walks away mid-generation
    assert other.status.value == "running" and other.finish_reason is None
    assert engine.cache.stats()["sequences"] == 1  # the stream's request left at once
    while engine.has_unfinished():
        engine.step()
    assert other.output_ids == expected and other.finish_reason in ("length", "stop")
    assert engine.cache.stats()["sequences"] == 0  # the abandoned stream's cache was freed
