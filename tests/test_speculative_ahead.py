"""Verify steps launched ahead (core/speculative/ahead.py, in core/runner/async_steps.py's
loop): step N+1 launched before verify step N is read, each request drafted at N taken to
keep its whole draft, its rows of N+1 dropped (K/V rolled back) where it did not.

On the CPU, through the eager path and the graph runners' static buffers
(``use_graphs=False``): every greedy request gets the tokens the engine gives it without
speculation, on prompts that quote themselves and prompts that do not, arriving over time,
through chunked prefill, preemption in a small cache, prefix hits, stop strings, EOS,
max_new_tokens and aborts inside a kept run, beside requests that do not speculate and
sampled ones (whose steps stay synchronous); the cache's blocks are where they should be
after a dropped step; ``speculative={"ahead": false}`` turns it off."""
import pytest
import torch

from infergraft import core
from infergraft.core.errors import PlanError
from infergraft.core.request import SamplingParams
from infergraft.core.speculative.ahead import WHOLE_UNTIMED, AheadCost
from infergraft.core.speculative.config import draft_rows
from infergraft.core.testing.models import (byte_tokenizer, random_model, random_prompt,
                                            tiny_llama_config)
from graph_support import drive, eager_graph_runners

NGRAM = {"method": "ngram", "k": 4}
SETUPS = {  # name -> (build options, graph runners on their static buffers)
    "paged-graph-runners": (dict(block_size=4), True),
    "paged-eager": (dict(block_size=4), False),
    "paged-tight": (dict(block_size=4, num_blocks=20), True),
    "paged-chunked": (dict(block_size=4, max_num_batched_tokens=8), False),
}


@pytest.fixture(scope="module")
def hf():
    return random_model(tiny_llama_config(), seed=5, scale=5.0)


def engine_for(hf, setup, speculative=NGRAM, batch=4, gambles=None, **kw):
    """An engine launching steps ahead (as on one CUDA device), speculating or not. The
    machine's timing decides nothing: no cost rule (every greedy request proposes, as
    ``AdaptiveK`` says), and a request drafted at a step is launched ahead where
    ``gambles(its whole-draft rate)`` (default: always)."""
    options, graphs = SETUPS[setup]
    options = {"max_num_batched_tokens": 16, **options, **kw}
    engine = core.build(hf, plugins=["paged"], max_seq_len=64, max_batch_size=batch,
                        async_steps=speculative is not None, speculative=speculative,
                        **options)
    engine.schedule_ahead = True  # (the CPU's default: off)
    if engine.speculation is not None:
        engine.speculation.cost.share = lambda *args, **kw: 0.0
        if engine.speculation.ahead is not None:
            engine.speculation.ahead.cost.gambles = gambles or (lambda whole: True)
    if graphs:
        budget = options["max_num_batched_tokens"]
        extra = draft_rows(engine.speculation and engine.speculation.config, batch)
        eager_graph_runners(engine, budget, batch, extra_rows=extra)
    return engine


def quoting(n, times, seed):
    return random_prompt(n, 256, seed) * times


ARRIVALS = [  # (step, prompt, new tokens): quoting prompts and ones that do not quote
    (0, quoting(5, 3, 1), 28), (0, random_prompt(9, 256, 3), 12), (1, quoting(7, 2, 2), 24),
    (3, quoting(3, 4, 4), 30), (4, random_prompt(6, 256, 5), 9), (8, quoting(4, 3, 6), 20),
    (11, random_prompt(13, 256, 7), 14)]


def launches(engine) -> list:
    """(drafts in it, rows fed from the device) of every forward, in order."""
    seen, forward = [], engine.runner.forward
    engine.runner.forward = lambda step, tokens, replay, feed=None: \
        seen.append((step.drafts is not None, feed is not None)) or \
        forward(step, tokens, replay, feed)
    return seen


def run_workload(engine, arrivals=ARRIVALS, params=None, abort_at=None, each=None):
    """The requests of ``arrivals`` added at their steps (``params``: by arrival index;
    default greedy, ignoring EOS unless given), the first aborted at step ``abort_at``,
    ``each()`` after every step; returns them in arrival order."""
    return drive(engine, [
        (step, prompt, (params or {}).get(i, SamplingParams(max_new_tokens=new,
                                                            ignore_eos=True)))
        for i, (step, prompt, new) in enumerate(arrivals)],
        None if abort_at is None else (abort_at, 0), each)


@pytest.mark.parametrize("setup", list(SETUPS))
def test_tokens_are_the_plain_engines(hf, setup):
    want = run_workload(engine_for(hf, setup, None))
    engine = engine_for(hf, setup)
    seen = launches(engine)
    got = run_workload(engine)
    assert [s.output_ids for s in got] == [s.output_ids for s in want]
    stats = engine.stats()
    assert stats["spec_decode_num_accepted_tokens"] > 0, stats
    # verify steps launched with rows fed from the device (a bonus, its draft after it),
    # and some dropped: a request that did not keep its whole draft
    assert (True, True) in seen, seen
    assert engine.speculation.ahead.dropped > 0
    if setup == "paged-tight":  # the small pool paused or preempted, then resumed
        assert engine.scheduler.num_paused + engine.scheduler.num_preemptions > 0


def test_requests_whose_drafts_miss_sit_the_step_ahead_out(hf):
    """Where a request's drafts are seldom kept whole it is not launched ahead: it sits the
    next step out (alone: that step waits for its tokens, as without ``ahead``)."""
    engine = engine_for(hf, "paged-graph-runners", gambles=lambda whole: whole >= 0.6)
    seen = launches(engine)
    got = run_workload(engine)
    want = run_workload(engine_for(hf, "paged-graph-runners", None))
    assert [s.output_ids for s in got] == [s.output_ids for s in want]
    assert (True, True) in seen and (True, False) in seen
    assert any(s.speculation is not None and s.speculation.whole < 0.6 for s in got)


def test_the_next_verify_step_is_launched_before_this_one_is_read(hf):
    engine = engine_for(hf, "paged-graph-runners")
    log, forward, read = [], engine.runner.forward, engine.async_steps._read
    engine.runner.forward = lambda step, tokens, replay, feed=None: \
        log.append(("launch", id(step), step.drafts is not None, feed is not None)) or \
        forward(step, tokens, replay, feed)
    engine.async_steps._read = lambda launched: \
        log.append(("read", id(launched.step))) or read(launched)
    seq = engine.add_request(quoting(3, 5, 4), SamplingParams(max_new_tokens=40,
                                                              ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    at = {entry[:2]: i for i, entry in enumerate(log)}
    # verify step N + 1, fed N's bonus from the device, launched before verify step N is
    # read (and after N was launched)
    drafted = [entry[1] for entry in log if entry[0] == "launch" and entry[2]]
    ahead = [(a, b) for a, b in zip(drafted, drafted[1:])
             if log[at["launch", b]][3] and at["launch", b] < at.get(("read", a), -1)]
    assert len(ahead) > 3, log
    assert seq.metrics.mean_accepted_length > 1


def test_a_dropped_step_leaves_the_blocks_of_the_kept_tokens(hf):
    """Drafts refused in part (a unigram lookup): the rows launched ahead after them are
    dropped; after every step the request holds the blocks of its length, no more, and
    its length is the tokens it has (those in flight counted)."""
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    prompt = random_prompt(11, 256, 8) * 2
    want = engine_for(hf, "paged-eager", None, block_size=2).generate(
        prompt, max_new_tokens=40, ignore_eos=True)[0].token_ids
    engine = engine_for(hf, "paged-eager", {**NGRAM, "min_n": 1, "max_n": 1}, block_size=2)
    seq, total = engine.add_request(prompt, params), engine.cache.stats()["blocks_total"]
    while engine.has_unfinished():
        engine.step()
        engine.cache.check_invariants()
        if seq.finished:
            break
        length = engine.cache.length(seq.id)
        assert length == seq.num_computed_tokens
        inflight = engine.async_steps.inflight
        if inflight is None or seq.id not in inflight.rows:  # its tokens all read
            assert length == seq.num_tokens - 1
        held = -(-max(length, len(prompt)) // 2)
        assert engine.cache.stats()["blocks_free"] == total - held
    assert seq.output_ids == want
    assert engine.speculation.ahead.dropped > 0
    assert seq.metrics.num_draft_tokens > seq.metrics.num_accepted_tokens > 0
    assert engine.cache.stats()["blocks_free"] == total


def test_undrafted_and_sampled_requests_beside_drafted_ones(hf):
    """Opted-out greedy requests and seeded sampled ones in the batch: the steps holding a
    sampled one run synchronously (its draws are the host's), the others ahead; every
    greedy request's tokens are the plain engine's, the sampled ones' draws (rejection
    sampling: not the plain engine's) those of the engine without ``ahead``."""
    params = {1: SamplingParams(max_new_tokens=12, ignore_eos=True, speculative=False),
              4: SamplingParams(max_new_tokens=9, ignore_eos=True, temperature=0.8, seed=7),
              6: SamplingParams(max_new_tokens=14, ignore_eos=True, top_k=5,
                                temperature=1.0, seed=9)}
    want = run_workload(engine_for(hf, "paged-graph-runners", None), params=params)
    synchronous = run_workload(engine_for(hf, "paged-graph-runners", {**NGRAM, "ahead": False}),
                               params=params)
    engine = engine_for(hf, "paged-graph-runners")
    launched, launch = [], engine.async_steps._launch
    engine.async_steps._launch = lambda step, *a: launched.append(step) or launch(step, *a)
    got = run_workload(engine, params=params)
    assert [s.output_ids for s in got] == [s.output_ids for s in synchronous]
    greedy = [i for i in range(len(got)) if i not in (4, 6)]
    assert [got[i].output_ids for i in greedy] == [want[i].output_ids for i in greedy]
    assert got[4].metrics.num_drafts > 0
    assert got[1].metrics.num_drafts == 0 and got[0].metrics.num_drafts > 0
    assert all(s.params.plain_greedy for step in launched for s in step.seqs)
    mixed = [step for step in launched if step.drafts is not None
             and any(d is None for d in step.drafts) and len(step.seqs) > 1]
    assert mixed, "no step launched ahead verified drafts beside an undrafted request"


def test_an_abort_and_eos_inside_kept_runs(hf):
    want = run_workload(engine_for(hf, "paged-graph-runners", None))
    # EOS: a token of an answer, first seen well inside it
    eos = next(t for s in want for i, t in enumerate(s.output_ids)
               if i > 8 and t not in s.output_ids[:i])
    eos_params = {i: SamplingParams(max_new_tokens=new) for i, (_, _, new) in
                  enumerate(ARRIVALS)}
    runs = []
    for speculative in (None, NGRAM):
        engine = engine_for(hf, "paged-graph-runners", speculative)
        engine.eos_token_ids = frozenset({eos})
        runs.append(run_workload(engine, params=eos_params))
    assert [s.output_ids for s in runs[1]] == [s.output_ids for s in runs[0]]
    assert [s.finish_reason for s in runs[1]] == [s.finish_reason for s in runs[0]]
    assert "stop" in [s.finish_reason for s in runs[1]]
    got = run_workload(engine_for(hf, "paged-graph-runners"), abort_at=7)
    aborted = got[0]  # with whatever it had when aborted
    assert aborted.finish_reason == "abort" and 0 < len(aborted.output_ids) < 28
    assert aborted.output_ids == want[0].output_ids[:len(aborted.output_ids)]
    assert [s.output_ids for s in got[1:]] == [s.output_ids for s in want[1:]]


@pytest.mark.parametrize("how", ["length", "stop"])
def test_a_request_ends_where_it_ends_one_token_at_a_time(hf, how):
    """max_new_tokens and stop strings at every position of a quoting answer: the request
    ends there, whatever step (kept, launched ahead, dropped) that position falls in."""
    tok = byte_tokenizer()
    plain = engine_for(hf, "paged-eager", None, tokenizer=tok)
    spec = engine_for(hf, "paged-eager", tokenizer=tok)
    prompt = quoting(5, 4, 11)
    ids = plain.generate(prompt, max_new_tokens=24, ignore_eos=True)[0].token_ids
    for i in range(1, 24, 1 if how == "length" else 3):
        kw = dict(max_new_tokens=i) if how == "length" else \
            dict(max_new_tokens=24, stop=tok.decode(ids[max(0, i - 2):i]))
        want, got = (e.generate(prompt, ignore_eos=True, **kw)[0] for e in (plain, spec))
        assert (got.token_ids, got.finish_reason, got.text) == \
            (want.token_ids, want.finish_reason, want.text), i
    assert spec.speculation.num_accepted_tokens > 0
    spec.cache.check_invariants()


def test_prefix_hits_and_a_second_turn(hf):
    outs = []
    for speculative in (None, NGRAM):
        engine = engine_for(hf, "paged-graph-runners", speculative, prefix_caching=True)
        first = engine.generate(ARRIVALS[0][1], max_new_tokens=28, ignore_eos=True)[0]
        again = engine.generate(ARRIVALS[0][1], max_new_tokens=28, ignore_eos=True)[0]
        turn = engine.generate(ARRIVALS[0][1] + first.token_ids[:20] + ARRIVALS[3][1][:4],
                               max_new_tokens=8, ignore_eos=True)[0]
        assert again.num_cached_tokens > 0 and turn.num_cached_tokens >= 32
        engine.cache.check_invariants()
        outs.append((first.token_ids, again.token_ids, turn.token_ids))
    assert outs[0] == outs[1]


def test_ahead_false_verifies_each_step_after_the_last_is_read(hf):
    engine = engine_for(hf, "paged-graph-runners", {**NGRAM, "ahead": False})
    assert engine.speculation.ahead is None
    seen = launches(engine)
    got = run_workload(engine)
    want = run_workload(engine_for(hf, "paged-graph-runners", None))
    assert [s.output_ids for s in got] == [s.output_ids for s in want]
    assert (True, False) in seen and (True, True) not in seen
    with pytest.raises(PlanError, match="ahead must be true or false"):
        core.build(hf, max_seq_len=32, speculative={**NGRAM, "ahead": "yes"})
    config = {"max_seq_len": 32, "plugins": ["paged"], "speculative": {**NGRAM, "ahead": False}}
    assert core.build(hf, config=config).speculation.ahead is None


def test_pipelined_calls_are_points_of_the_cost_fit(hf):
    """A call that reads a verify step launched by the call before is one step of the
    pipeline: the cost fit takes it as a drafted point, ``AheadCost`` as a pipelined one."""
    engine = engine_for(hf, "paged-graph-runners")
    engine.generate(quoting(3, 5, 4), max_new_tokens=40, ignore_eos=True)
    assert engine.speculation.cost.seen[True] > 3
    assert engine.speculation.ahead.cost.pipelined is not None


def test_a_request_is_launched_ahead_where_its_whole_drafts_pay():
    cost = AheadCost()
    assert cost.gambles(0.0)  # nothing timed: try it (that times it)
    cost.observe(1.0, pipelined=True)
    assert cost.gambles(WHOLE_UNTIMED) and not cost.gambles(WHOLE_UNTIMED - 0.01)
    cost.observe(1.5, pipelined=False)  # a synchronous verify step: 1.5 pipelined ones
    assert cost.gambles(0.5) and not cost.gambles(0.49)
    for _ in range(50):  # the host's work a sliver of a step: only drafts nearly always kept
        cost.observe(1.05, pipelined=False)
    assert cost.gambles(0.96) and not cost.gambles(0.9)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_verify_steps_ahead_on_cuda_graphs(hf):
    """The real thing: mixed-step CUDA graphs, tokens read behind events, rows fed from
    the device; ahead on and off give the plain engine's tokens, and some dropped."""
    def run(speculative):
        engine = core.build(hf, plugins=["paged"], device="cuda", max_seq_len=64,
                            max_batch_size=4, max_num_batched_tokens=16, block_size=4,
                            speculative=speculative)
        assert engine.async_steps.enabled and engine.runner.step_graphs is not None
        if engine.speculation is not None:  # (no timing decides: as engine_for's)
            engine.speculation.cost.share = lambda *args, **kw: 0.0
            if engine.speculation.ahead is not None:
                engine.speculation.ahead.cost.gambles = lambda whole: True
        return [s.output_ids for s in run_workload(engine)], engine

    want, _ = run(None)
    got, engine = run(NGRAM)
    assert got == want and engine.speculation.ahead.dropped > 0
    assert engine.stats()["spec_decode_num_accepted_tokens"] > 0
    off, engine = run({**NGRAM, "ahead": False})
    assert off == want and engine.speculation.ahead is None


def test_nan_in_a_verify_step_launched_ahead_fails_its_request_alone(hf):
    """A NaN in a drafted request's rows of a verify step that was launched before the
    step ahead of it was read: where those rows are read (not dropped: the request kept
    its whole draft before), that request finishes with an error naming NaN logits and
    keeps only the tokens before that step, its rows of the step launched since dropped;
    the other requests keep the plain engine's tokens; the cache stays consistent."""
    prompts = [quoting(5, 3, 1), quoting(7, 2, 2), quoting(3, 4, 4)]
    want = [c.token_ids for c in engine_for(hf, "paged-graph-runners", None).generate(
        prompts, max_new_tokens=30, ignore_eos=True)]
    engine = engine_for(hf, "paged-graph-runners")
    steps, launch, read = engine.async_steps, engine.async_steps._launch, engine.async_steps._read
    poisoned, sick = [], []  # (launched, seq) until one is read

    def launch_poisoned(step, tokens, replay, feed):
        launched = launch(step, tokens, replay, feed)
        if not sick and not poisoned and len(launched.drafted) >= 2 and feed is not None:
            seq = next(s for s in step.seqs if s.id in launched.drafted)
            first, draft, _ = launched.drafted[seq.id]
            launched.logits[first + len(draft.tokens)] = float("nan")  # its last row
            poisoned.append((launched, seq))
        return launched

    def read_poisoned(launched):
        if poisoned and poisoned[0][0] is launched:
            (_, seq), = poisoned
            poisoned.clear()
            if seq.id in launched.rows:  # read, not dropped: its tokens so far are kept
                sick.append((seq, len(seq.output_ids)))
        return read(launched)
    steps._launch, steps._read = launch_poisoned, read_poisoned
    seqs = [engine.add_request(p, SamplingParams(max_new_tokens=30, ignore_eos=True))
            for p in prompts]
    while engine.has_unfinished():
        engine.step()
        engine.cache.check_invariants()
    assert sick, "no poisoned verify step launched ahead was read"
    (bad, held), = sick
    assert bad.finish_reason == "error" and "NaN logits" in bad.error, bad.error
    i = seqs.index(bad)
    assert bad.output_ids == want[i][:held]
    assert [s.output_ids for j, s in enumerate(seqs) if j != i] == \
        [w for j, w in enumerate(want) if j != i]
