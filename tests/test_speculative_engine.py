"""Speculative decoding in the engine (core/speculative/): n-gram drafts verified in one
mixed step give every greedy request exactly the tokens the engine gives it without
speculation, on LLaMA, Mistral (a sliding window) and GPT-2, through chunked prefill,
preemption (recompute and swap), prefix-cache hits and batches mixed with requests that
do not speculate; rejected tokens leave nothing behind in the cache; stop strings, EOS and
max_new_tokens end a request inside an accepted run. The prompts repeat a random phrase,
so that the lookup finds what the tiny models' greedy loops say again."""
import pytest
from speculative_support import assert_a_nan_fails_its_drafted_request_alone

from infergraft import core
from infergraft.core.errors import PlanError
from infergraft.core.request import SamplingParams
from infergraft.core.runner.step_graph import StepGraphRunner
from infergraft.core.speculative.config import draft_rows
from infergraft.core.testing.models import (random_model, random_prompt, tiny_gpt2_config,
                                            tiny_llama_config, tiny_mistral_config)

NGRAM = {"method": "ngram", "k": 4}
KW = dict(max_seq_len=64, max_batch_size=4)


def repeating(n: int, times: int, seed: int) -> list[int]:
    return random_prompt(n, 256, seed) * times


PROMPTS = [repeating(5, 3, 1), repeating(7, 2, 2), random_prompt(9, 256, 3),
           repeating(3, 4, 4)]
CASES = {  # name -> (config, build options)
    "llama-paged": (tiny_llama_config, dict(plugins=["paged"], block_size=4)),
    "llama-contiguous": (tiny_llama_config, {}),
    "mistral-window8-paged": (lambda: tiny_mistral_config(sliding_window=8),
                              dict(plugins=["paged"], block_size=4)),
    "gpt2-paged": (tiny_gpt2_config, dict(plugins=["paged"], block_size=4)),
    "llama-chunked": (tiny_llama_config, dict(plugins=["paged"], block_size=4,
                                              max_num_batched_tokens=8)),
    "llama-preempt-recompute": (tiny_llama_config, dict(plugins=["paged"], block_size=4,
                                                        num_blocks=24, preemption="recompute")),
    "llama-preempt-swap": (tiny_llama_config, dict(plugins=["paged"], block_size=4,
                                                   num_blocks=24, preemption="swap")),
}


@pytest.fixture(scope="module")
def models():
    return {name: random_model(config(), seed=5, scale=5.0)
            for name, (config, _) in CASES.items()}


def tokens(engine, prompts, **kw):
    kw = dict(dict(max_new_tokens=28, ignore_eos=True), **kw)
    return engine.generate(prompts, **kw)


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_tokens_are_the_plain_engines(case, models):
    _, options = CASES[case]
    plain = core.build(models[case], **KW, **options)
    spec = core.build(models[case], **KW, **options, speculative=NGRAM)
    want = [c.token_ids for c in tokens(plain, PROMPTS)]
    done = tokens(spec, PROMPTS)
    assert [c.token_ids for c in done] == want
    stats = spec.stats()
    assert stats["spec_decode_num_accepted_tokens"] > 0, stats
    assert sum(c.metrics.num_accepted_tokens for c in done) == \
        stats["spec_decode_num_accepted_tokens"]
    if "preempt" in case:  # the tiny pool preempted someone, as it does without drafts
        assert stats["num_preemptions"] > 0, stats
    spec.cache.check_invariants()
    assert spec.cache.stats()["sequences"] == 0


def test_an_accepted_run_takes_fewer_steps_than_tokens(models):
    engine = core.build(models["llama-paged"], **KW, plugins=["paged"], block_size=4,
                        speculative=NGRAM)
    seq = engine.add_request(repeating(3, 4, 4), SamplingParams(max_new_tokens=40,
                                                                ignore_eos=True))
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    m = seq.metrics
    assert len(seq.output_ids) == 40 and steps < 40, steps
    assert m.num_accepted_tokens > 0 and m.mean_accepted_length > 1, m
    assert m.acceptance_rate == m.num_accepted_tokens / m.num_draft_tokens


def test_requests_that_do_not_speculate_are_unaffected(models):
    """A batch of speculating requests beside sampled ones and opted-out greedy ones: every
    request's tokens are the plain engine's (the sampled ones' too: their draws untouched)."""
    hf = models["llama-paged"]
    opts = dict(KW, plugins=["paged"], block_size=4)
    params = [SamplingParams(max_new_tokens=24, ignore_eos=True),
              SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=0.8, seed=7,
                             speculative=False),
              SamplingParams(max_new_tokens=24, ignore_eos=True, speculative=False),
              SamplingParams(max_new_tokens=24, ignore_eos=True, top_k=5, temperature=1.0,
                             seed=9, speculative=False)]
    runs = []
    for speculative in (None, NGRAM):
        engine = core.build(hf, **opts, speculative=speculative)
        seqs = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, params)]
        while engine.has_unfinished():
            engine.step()
        runs.append([s.output_ids for s in seqs])
        if speculative:
            assert seqs[0].metrics.num_drafts > 0
            assert all(s.metrics.num_drafts == 0 for s in seqs[1:])
    assert runs[0] == runs[1]


def test_nan_logits_fail_their_drafted_request_alone(models):
    """NaN in one drafted request's rows of a verify step (an overflowing model): that
    request finishes with an error saying so, the other drafted one keeps its tokens."""
    hf = models["llama-paged"]
    opts = dict(KW, plugins=["paged"], block_size=4)
    prompts, params = [PROMPTS[0], PROMPTS[3]], SamplingParams(max_new_tokens=28,
                                                               ignore_eos=True)
    want = [c.token_ids for c in tokens(core.build(hf, **opts), prompts)]
    engine = core.build(hf, **opts, speculative=NGRAM)
    assert_a_nan_fails_its_drafted_request_alone(engine, prompts, params, want)
    assert engine.cache.stats()["sequences"] == 0


def test_prefix_hits_and_a_second_turn_give_the_same_tokens(models):
    """A prompt served from the prefix cache, then a turn whose prompt repeats the first
    answer (keyed at its finish): the blocks keyed never hold a rejected token's K/V."""
    hf = models["llama-paged"]
    opts = dict(KW, plugins=["paged"], block_size=4)
    outs = []
    for speculative in (None, NGRAM):
        engine = core.build(hf, **opts, speculative=speculative)
        first = tokens(engine, PROMPTS[0])[0]
        again = tokens(engine, PROMPTS[0])[0]
        turn = tokens(engine, PROMPTS[0] + first.token_ids[:20] + PROMPTS[3][:4],
                      max_new_tokens=8)[0]
        assert again.num_cached_tokens > 0 and turn.num_cached_tokens >= 32, \
            (again.num_cached_tokens, turn.num_cached_tokens)
        engine.cache.check_invariants()
        outs.append((first.token_ids, again.token_ids, turn.token_ids))
    assert outs[0] == outs[1]


def _inside_runs(completion) -> list[int]:
    """Positions of tokens a verify step appended with more after them (same time)."""
    t = completion.metrics.token_times
    return [i for i in range(1, len(t) - 1) if t[i] == t[i + 1]]


@pytest.mark.parametrize("how", ["stop", "eos", "length"])
def test_a_request_ends_inside_an_accepted_run(how, models):
    """The token that ends a request (its stop string, EOS, its max_new_tokens) ends it
    where it ends it one token at a time, though its step kept tokens after it."""
    from infergraft.core.testing.models import byte_tokenizer

    opts = dict(KW, plugins=["paged"], block_size=4, tokenizer=byte_tokenizer())
    plain = core.build(models["llama-paged"], **opts)
    spec = core.build(models["llama-paged"], **opts, speculative=NGRAM)
    found = None
    # prompts that end in the model's own greedy loop: the drafts come from the prompt, so
    # a token the output has not had yet can sit inside a run (EOS needs one)
    prompts = [p + tokens(plain, p, max_new_tokens=16)[0].token_ids for p in PROMPTS]
    for prompt in prompts:  # the first position whose token can end the request right there
        free = tokens(spec, prompt, max_new_tokens=24)[0]
        ids = free.token_ids
        for i, n in ((i, n) for i in _inside_runs(free) for n in (1, 2, 3, 4)):
            if how == "length":
                kw = dict(max_new_tokens=i + 1)
            elif how == "eos":
                if ids[i] in ids[:i]:
                    continue
                plain.eos_token_ids = spec.eos_token_ids = frozenset({ids[i]})
                kw = dict(max_new_tokens=24, ignore_eos=False)
            else:  # the text of its last n tokens, first seen there
                kw = dict(max_new_tokens=24,
                          stop=plain.tokenizer.decode(ids[max(0, i + 1 - n):i + 1]))
            want = tokens(plain, prompt, **kw)[0]
            if len(want.token_ids) == i + 1:
                found = prompt
                break
        if found:
            break
    assert found, f"no prompt's verify steps end a request by {how} inside a run"
    got = tokens(spec, prompt, **kw)[0]
    assert (got.token_ids, got.finish_reason, got.text) == \
        (want.token_ids, want.finish_reason, want.text)
    assert got.finish_reason == ("length" if how == "length" else "stop")
    assert len(got.token_ids) < 24
    spec.cache.check_invariants()


def test_verify_steps_replay_the_step_graphs(models):
    """Drafted steps through the mixed-step graphs' static buffers (run eagerly on the
    CPU), with the logits rows build gives them for drafts: every verify step replays,
    the logits of every drafted row come back, the tokens are the plain engine's."""
    hf = models["llama-paged"]
    opts = dict(KW, plugins=["paged"], block_size=4, max_num_batched_tokens=32,
                cuda_graphs=False)
    want = [c.token_ids for c in tokens(core.build(hf, **opts), PROMPTS)]
    engine = core.build(hf, **opts, speculative=NGRAM)
    extra = draft_rows(engine.speculation.config, KW["max_batch_size"])
    assert extra == 4 * KW["max_batch_size"]
    runner = StepGraphRunner(engine.model, engine.cache, 32, KW["max_batch_size"],
                             buckets=(8, 16, 32), use_graphs=False, extra_rows=extra)
    runner.capture()
    engine.runner.step_graphs = runner
    verified, split = [], engine.speculation.split
    run = runner.run
    runner.run = lambda ids, counts, toks, rows=None, feed=None: (
        verified.append(rows is not None), run(ids, counts, toks, rows, feed))[1]
    engine.speculation.split = lambda step, logits: (verified.append("split"),
                                                     split(step, logits))[1]
    assert [c.token_ids for c in tokens(engine, PROMPTS)] == want
    # each verify step's split came right after a replay with its rows
    splits = [i for i, v in enumerate(verified) if v == "split"]
    assert splits and all(verified[i - 1] is True for i in splits), verified


def test_a_rolling_window_cache_is_refused():
    hf = random_model(tiny_mistral_config(sliding_window=8), seed=5)
    with pytest.raises(PlanError, match="roll back.*paged"):
        core.build(hf, **KW, speculative=NGRAM)


def test_rejected_tokens_free_their_blocks(models):
    """A draft that is refused whole leaves the request holding the blocks of the tokens
    it keeps, no more (every step's invariants checked)."""
    engine = core.build(models["llama-paged"], **KW, plugins=["paged"], block_size=2,
                        speculative={"method": "ngram", "k": 4, "min_n": 1, "max_n": 1})
    seq = engine.add_request(random_prompt(11, 256, 8), SamplingParams(max_new_tokens=30,
                                                                       ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
        engine.cache.check_invariants()
        if not seq.finished:
            assert engine.cache.length(seq.id) == seq.num_computed_tokens == seq.num_tokens - 1
    assert seq.metrics.num_draft_tokens > seq.metrics.num_accepted_tokens  # some refused


def test_a_batch_larger_than_disable_by_batch_size_proposes_nothing(models):
    """Two requests decoding, speculation allowed for one at a time: none proposes until
    the short one has finished, then the long one does."""
    engine = core.build(models["llama-paged"], **KW, plugins=["paged"], block_size=4,
                        speculative={"method": "ngram", "k": 4, "disable_by_batch_size": 1})
    short = engine.add_request(PROMPTS[3], SamplingParams(max_new_tokens=10, ignore_eos=True))
    long = engine.add_request(PROMPTS[3], SamplingParams(max_new_tokens=40, ignore_eos=True))
    drafts_while_both = 0
    while engine.has_unfinished():
        engine.step()
        if not short.finished:
            drafts_while_both = engine.stats()["spec_decode_num_drafts"]
    assert drafts_while_both == 0 and short.metrics.num_drafts == 0
    assert long.metrics.num_drafts > 0 and long.output_ids[:10] == short.output_ids
