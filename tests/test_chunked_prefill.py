"""Token-budget steps: each step carries the running sequences' decode tokens and prompt
chunks, ``max_num_batched_tokens`` in all; long prompts are split, short ones fused
(alternating with decode steps where the cache is short); the tokens are the same as with
whole prompts (the CPU runs the torch references; parity with HF is checked elsewhere)."""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infergraft import core
from infergraft.core.errors import PlanError
from infergraft.core.request import SamplingParams
from infergraft.core.testing.models import (random_model, random_prompt, tiny_llama_config,
                                            tiny_mistral_config)

LENGTHS = (5, 30, 17, 41, 9)
KW = dict(max_seq_len=96, max_batch_size=4)
CASES = {  # name -> (config, plugins, options)
    "llama-contiguous": (tiny_llama_config, [], {}),
    "llama-paged": (tiny_llama_config, ["paged"], dict(block_size=4)),
    "llama-paged-preempting": (tiny_llama_config, ["paged"], dict(block_size=4, num_blocks=30)),
    "mistral-window8-contiguous": (lambda: tiny_mistral_config(sliding_window=8), [], {}),
    "mistral-window8-paged": (lambda: tiny_mistral_config(sliding_window=8), ["paged"],
                              dict(block_size=4)),
    "llama-kv-int8": (tiny_llama_config, ["kv-int8"], {}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_chunks_give_the_tokens_of_whole_prompts(case):
    config, plugins, options = CASES[case]
    hf = random_model(config(), seed=5, scale=5.0)
    prompts = [random_prompt(n, 256, 200 + n) for n in LENGTHS]
    whole = core.build(hf, plugins=plugins, **options, **KW)
    chunked = core.build(hf, plugins=plugins, max_num_batched_tokens=8, **options, **KW)
    want = [c.token_ids for c in whole.generate(prompts, max_new_tokens=30)]
    steps, schedule = [], chunked.scheduler.schedule

    def record():  # (decode tokens, prompt chunks) of every step
        step = schedule()
        if step:
            steps.append(([n for s, n in zip(step.seqs, step.counts) if not s.prefilling],
                          [n for s, n in zip(step.seqs, step.counts) if s.prefilling]))
        return step
    chunked.scheduler.schedule = record
    assert [c.token_ids for c in chunked.generate(prompts, max_new_tokens=30)] == want
    assert all(sum(d) + sum(c) <= 8 for d, c in steps), steps
    assert any(d and c for d, c in steps), "no step carried decode tokens and a chunk"
    assert any(len(c) > 1 for _, c in steps), "no step fused two prompts"
    if case == "llama-paged-preempting":  # preempted sequences are prefilled again in chunks
        assert chunked.scheduler.num_preemptions > 0
    chunked.cache.check_invariants()
    assert chunked.cache.stats()["sequences"] == 0


def test_running_sequences_keep_decoding_while_a_long_prompt_chunks():
    hf = random_model(tiny_llama_config(), seed=6)
    engine = core.build(hf, max_num_batched_tokens=8, **KW)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    short = engine.add_request(random_prompt(4, 256, 1), params)
    engine.step()  # its prefill: first token
    assert len(short.output_ids) == 1
    long = engine.add_request(random_prompt(50, 256, 2), params)
    steps = []  # (chunk tokens fed, short got a token) per step
    while not long.output_ids:
        before, fed = len(short.output_ids), long.num_computed_tokens
        engine.step()
        steps.append((long.num_computed_tokens - fed, len(short.output_ids) > before))
    # 50 tokens beside short's decode token in 8-token steps: chunks of 7, never a step
    # without short's token or without a chunk
    assert steps == [(7, True)] * 7 + [(1, True)], steps
    assert long.metrics.ttft is not None and len(long.output_ids) == 1
    while engine.has_unfinished():
        engine.step()
    whole = core.build(hf, **KW)
    again = whole.add_request(long.prompt_ids, params)
    while whole.has_unfinished():
        whole.step()
    assert long.output_ids == again.output_ids and len(again.output_ids) == 40


def test_a_waiting_prompt_joins_the_last_short_chunk():
    """What a chunk leaves of the budget goes to waiting prompts that fit whole: 50
    tokens in chunks of 8 end with a 2-token chunk, and a 5-token prompt that arrived
    meanwhile is prefilled in that step (not after it)."""
    hf = random_model(tiny_llama_config(), seed=6)
    engine = core.build(hf, max_num_batched_tokens=8, **KW)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    long = engine.add_request(random_prompt(50, 256, 2), params)
    engine.step()  # admitted: its first chunk
    late = engine.add_request(random_prompt(5, 256, 3), params)
    fed = []
    while not long.output_ids:
        engine.step()
        fed.append(len(late.output_ids))
    assert fed == [0] * 5 + [1], fed  # chunks 2-6 alone, then 2 tokens + the 5 of late
    while engine.has_unfinished():
        engine.step()
    for seq in (long, late):
        alone = core.build(hf, **KW)
        ref = alone.add_request(seq.prompt_ids, params)
        while alone.has_unfinished():
            alone.step()
        assert seq.output_ids == ref.output_ids


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_bad_prefill_budget_is_refused(bad):
    hf = random_model(tiny_llama_config(), seed=6)
    with pytest.raises(PlanError, match="max_num_batched_tokens must be an integer >= 1"):
        core.build(hf, max_num_batched_tokens=bad, **KW)


def test_short_prompts_are_fused_with_the_decode_tokens_in_one_step():
    hf = random_model(tiny_llama_config(), seed=6)
    engine = core.build(hf, **KW)
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    short = engine.add_request(random_prompt(4, 256, 1), params)
    engine.step()
    a, b, c = (engine.add_request(random_prompt(n, 256, n), params) for n in (3, 5, 6))
    assert set(engine.step()) == {short, a, b, c} and len(short.output_ids) == 2
    while engine.has_unfinished():
        engine.step()
    for seq in (short, a, b, c):
        alone = core.build(hf, **KW)
        ref = alone.add_request(seq.prompt_ids, params)
        while alone.has_unfinished():
            alone.step()
        assert ref.output_ids == seq.output_ids


def test_max_prefill_tokens_is_the_budget_under_its_old_name():
    hf = random_model(tiny_llama_config(), seed=6)
    with pytest.warns(DeprecationWarning, match="max_prefill_tokens is now max_num_batched_tokens"):
        engine = core.build(hf, max_prefill_tokens=12, **KW)
    assert engine.scheduler.max_num_batched_tokens == engine.plan.max_num_batched_tokens == 12
    with pytest.raises(PlanError, match="give only max_num_batched_tokens"):
        core.build(hf, max_prefill_tokens=12, max_num_batched_tokens=16, **KW)


_MODEL: dict = {}
_ALONE: dict = {}  # (case, prompt seed, length, new tokens) -> tokens generated alone


def _run_arrivals(arrivals, budget, case):
    """Requests (arrival step, prompt length, new tokens) arriving as the engine steps;
    asserts each gets the greedy tokens it gets when run alone; returns the engine."""
    plugins, options = {"contiguous": ([], {}),
                        "paged-tight": (["paged"], dict(block_size=4, num_blocks=16))}[case]
    hf = _MODEL.setdefault("m", random_model(tiny_llama_config(), seed=5, scale=5.0))
    engine = core.build(hf, plugins=plugins, max_num_batched_tokens=budget, **options,
                        max_seq_len=64, max_batch_size=4)  # paged: 64 tokens in all
    pending = sorted(((step, i, n, new) for i, (step, n, new) in enumerate(arrivals)))
    seqs, step = {}, 0
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= step:
            _, i, n, new = pending.pop(0)
            seqs[i] = engine.add_request(random_prompt(n, 256, 300 + i),
                                         SamplingParams(max_new_tokens=new, ignore_eos=True))
        engine.step()
        step += 1
        assert step < 500, "the engine stopped making progress"
    for i, seq in seqs.items():
        key = (i, len(seq.prompt_ids), seq.params.max_new_tokens)
        if key not in _ALONE:
            alone = core.build(hf, **KW)
            ref = alone.add_request(seq.prompt_ids, seq.params)
            while alone.has_unfinished():
                alone.step()
            _ALONE[key] = ref.output_ids
        assert seq.output_ids == _ALONE[key], (i, arrivals)
    engine.cache.check_invariants()
    assert engine.cache.stats()["sequences"] == 0
    return engine


@given(arrivals=st.lists(st.tuples(st.integers(0, 6), st.integers(2, 40), st.integers(1, 12)),
                         min_size=3, max_size=7),
       budget=st.sampled_from([3, 8, 64]), case=st.sampled_from(["contiguous", "paged-tight"]))
@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
def test_random_arrivals_get_the_tokens_they_get_alone(arrivals, budget, case):
    """Requests arriving at random steps, with chunks, decode tokens beside them, pauses and
    preemptions in any mix: each gets the greedy tokens it gets when run alone."""
    _run_arrivals(arrivals, budget, case)


def test_arrivals_that_preempt_and_pause_get_the_tokens_they_get_alone():
    """One schedule of the kind the random test draws, known to make the tight pool
    both pause a sequence and preempt one: both paths keep every token."""
    arrivals = [(6, 28, 1), (2, 34, 8), (3, 21, 8), (2, 39, 4), (4, 10, 5), (1, 8, 10)]
    engine = _run_arrivals(arrivals, 8, "paged-tight")
    assert engine.scheduler.num_preemptions > 0 and engine.scheduler.num_paused > 0
