"""Constrained greedy rows in asynchronous steps (core/runner/constrained_steps.py): step
N+1 launched before step N's tokens are read, its masks filled once they are accepted.

On the CPU (the same logic, without the overlap), through the eager path and the graph
runners' static buffers: every request gets the tokens, finish reason and error the
synchronous engine gives it, whatever the mix (JSON schemas with and without
jump-forward, regexes, choices, grammars, unconstrained requests, prompts arriving over
time through chunked prefill, grammars completing mid-batch, a constraint failing
mid-generation, aborts); and step N+1's forward is launched before N is read, its mask
filled after.
"""
import json

import pytest
import torch
from hypothesis import HealthCheck, assume, given
from hypothesis import strategies as st

from infergraft import core
from infergraft.core import hookimpl
from infergraft.core.logits_processor import ConstraintState, LogitsProcessor
from infergraft.core.runner import async_steps, constrained_steps
from infergraft.core.testing.models import random_model, tiny_llama_config
from infergraft.core.testing.strategies import kit_settings
from graph_support import drive, eager_graph_runners
from structured_support import (EOS, VOCAB, ascii_tokenizer, check_json, check_regex,
                                max_chars, regexes, schemas)

SCHEMA = {"type": "object", "required": ["id", "tag"], "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 99999},
    "tag": {"enum": ["alpha", "beta", "gamma delta"]}}}
LIST = {"type": "object", "required": ["notes"], "properties": {"notes": {
    "type": "array", "minItems": 2, "maxItems": 4,
    "items": {"type": "string", "minLength": 1, "maxLength": 6}}}}
REGEX = r"[a-c]{2,5}-[0-9]{1,3}"
GRAMMAR = 'root ::= "(" [0-9]+ ("+" [0-9]+)* ")"'


class FailsAfter(LogitsProcessor):
    """Anything for ``arg`` tokens, then a mask that allows no token."""
    name = "fails-after"

    def start(self, arg, vocab):
        return Countdown(arg)


class Countdown(ConstraintState):
    def __init__(self, left):
        self.left = left

    def fill_bitmask(self, bitmask, row):
        if self.left <= 0:
            bitmask[row].zero_()

    def accept(self, token):
        self.left -= 1
        return True


class Plugin:
    @hookimpl
    def infergraft_register_logits_processors(self, register):
        register(FailsAfter())


def params(new=40, **kw):
    return core.SamplingParams(max_new_tokens=new, **kw)


# (arrival step, prompt, params): prompts longer than the budget of 16 are chunked
ARRIVALS = [
    (0, "Give me a record as JSON: ", params(json_schema=SCHEMA)),
    (0, "free text", params(new=20)),
    (0, "A record, jumped: ", params(json_schema=SCHEMA, jump_forward=True)),
    (1, "a code that matches the pattern, please: ", params(regex=REGEX)),
    (2, "pick", params(choice=["red", "green", "blue sky"])),
    (3, "notes, jumped, over a long prompt of many words: ", params(
        new=60, json_schema=LIST, jump_forward=True)),
    (4, "a sum: ", params(grammar=GRAMMAR, new=12)),  # may end with "length"
    (5, "fails", params(new=20, logits_processors={"fails-after": 3})),
    (7, "another free one, longer than a chunk", params(new=14)),
    (9, "late record: ", params(json_schema=SCHEMA, jump_forward=True)),
]
SETUPS = {"paged-graph-runners": True, "paged-eager": False}


@pytest.fixture(scope="module")
def hf():
    return random_model(tiny_llama_config(vocab_size=VOCAB, eos_token_id=EOS), seed=3,
                        scale=5.0)


def engine_for(hf, on, graphs=True, budget=16, batch=6):
    engine = core.build(hf, tokenizer=ascii_tokenizer(), plugins=["paged", Plugin()],
                        block_size=4, max_seq_len=160, max_batch_size=batch,
                        max_num_batched_tokens=budget, async_steps=on)
    engine.schedule_ahead = True  # both engines schedule the same way (the CPU's default: off)
    if graphs:
        eager_graph_runners(engine, budget, batch, step_buckets=(8, 16),
                            decode_buckets=(2, 4, 6))
    return engine


def run_workload(engine, arrivals=ARRIVALS, abort=None):
    """Adds each request at its step; ``abort``: (step, index) aborted then. Returns the
    sequences in arrival order."""
    return drive(engine, arrivals, abort)


def outcome(seqs):
    return [(s.output_ids, s.finish_reason, s.error) for s in seqs]


def chunks(engine):
    """{sequence id: {first position: tokens}} of what each forward fed (a position fed
    again, after a row was dropped, keeps its last chunk): what its K/V were written by."""
    fed, forward = {}, engine.runner.forward

    def watched(step, tokens, replay, feed=None):
        for s, n in zip(step.seqs, step.counts):
            fed.setdefault(s.id, {})[s.num_computed_tokens] = n
        return forward(step, tokens, replay, feed)

    engine.runner.forward = watched
    return fed


def watch(engine, monkeypatch):
    """Counts: constrained steps launched with rows fed from the device, and rows of a
    step launched ahead dropped because their grammar forced tokens."""
    seen, forward = {"fed": 0, "dropped": 0}, engine.runner.forward

    def watched(step, tokens, replay, feed=None):
        if feed is not None and any(s.params.constrained for s in step.seqs):
            seen["fed"] += 1
        return forward(step, tokens, replay, feed)

    engine.runner.forward = watched
    drop = constrained_steps.drop_forced

    def dropping(e, launched):
        before = len(launched.rows)
        drop(e, launched)
        seen["dropped"] += before - len(launched.rows)

    monkeypatch.setattr(constrained_steps, "drop_forced", dropping)
    return seen


@pytest.mark.parametrize("setup", list(SETUPS))
def test_constrained_rows_get_the_synchronous_tokens(hf, setup, monkeypatch):
    plain = engine_for(hf, False, SETUPS[setup])
    fed_plain = chunks(plain)
    want = run_workload(plain)
    engine = engine_for(hf, True, SETUPS[setup])
    fed = chunks(engine)
    seen = watch(engine, monkeypatch)
    got = run_workload(engine)
    assert outcome(got) == outcome(want)
    # each output's K/V written by the same chunks: a token and the tokens its grammar
    # forced after it fed together, as the synchronous engine feeds them (the rows a
    # sequence wastes past its end aside; prompts may be chunked otherwise, as the
    # budget a forced chunk takes moves to the step after: constrained_steps.py)
    for a, b in zip(got, want):
        outputs = {at: n for at, n in fed_plain[b.id].items() if at >= len(b.prompt_ids)}
        assert {at: fed[a.id].get(at) for at in outputs} == outputs
    # constrained steps ran ahead, and rows that forced tokens were dropped from them
    assert seen["fed"] > 10 and seen["dropped"] > 0, seen
    # what the workload covers: every constraint obeyed, grammars complete mid-batch,
    # the failing constraint fails its own request only
    by = {s.params: s for s in got}
    for _, _, p in ARRIVALS:
        s = by[p]
        if p.json_schema is not None:
            assert s.finish_reason == "stop", s.text
            check_json(s.text, LIST if p.max_new_tokens == 60 else SCHEMA)
        elif p.regex is not None:
            assert s.finish_reason == "stop"
            check_regex(s.text, REGEX, finished=True)
        elif p.choice is not None:
            assert s.text in p.choice and s.finish_reason == "stop"
        elif p.logits_processors:
            assert s.finish_reason == "error" and len(s.output_ids) == 3
            assert "allows no token" in s.error
        elif p.grammar is None:
            assert s.finish_reason == "length" and s.error is None


def constraints():
    """A request's structured-output fields: a random schema (jump-forward or not), a
    random regex, or none."""
    return st.one_of(
        st.tuples(schemas(), st.booleans()).filter(lambda a: max_chars(a[0]) <= 60).map(
            lambda a: dict(json_schema=a[0], jump_forward=a[1])),
        regexes().map(lambda r: dict(regex=r)), st.just({}))


@kit_settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.tuples(st.integers(0, 4), constraints()), min_size=2, max_size=6))
def test_random_constraints_get_the_synchronous_tokens(hf, batch):
    assume(any(c for _, c in batch))
    arrivals = sorted(((at, f"request {i}: " * (1 + i % 3), params(new=64, **c))
                       for i, (at, c) in enumerate(batch)), key=lambda a: a[0])
    got = run_workload(engine_for(hf, True, graphs=False), arrivals)
    assert outcome(got) == outcome(run_workload(engine_for(hf, False, graphs=False), arrivals))
    for s in got:
        assert s.finish_reason == "stop" or not s.params.constrained, s.text
        if s.params.json_schema is not None:
            check_json(s.text, json.loads(s.params.json_schema))
        elif s.params.regex is not None:
            check_regex(s.text, s.params.regex, finished=True)


def test_an_abort_drops_the_constrained_row_launched_ahead(hf):
    want = run_workload(engine_for(hf, False))
    got = run_workload(engine_for(hf, True), abort=(6, 0))
    aborted = got[0]
    assert aborted.finish_reason == "abort"
    assert 0 < len(aborted.output_ids) < len(want[0].output_ids)
    assert aborted.output_ids == want[0].output_ids[:len(aborted.output_ids)]
    assert outcome(got[1:]) == outcome(want[1:])


def test_sampled_constrained_rows_stay_synchronous(hf):
    """A sampled constrained row draws on the host: its steps are not launched ahead, the
    greedy ones around it still get their tokens."""
    arrivals = ARRIVALS[:4] + [(2, "sampled: ", params(json_schema=SCHEMA, temperature=1.0,
                                                       seed=11))]

    def run(on):
        engine = engine_for(hf, on)
        launched, launch = [], engine.async_steps._launch
        engine.async_steps._launch = lambda step, *a: launched.append(step) or launch(step, *a)
        return run_workload(engine, arrivals), launched

    (got, launched), (want, _) = run(True), run(False)
    assert outcome(got) == outcome(want)
    assert launched and all(s.params.greedy for step in launched for s in step.seqs)


def test_the_next_step_is_launched_before_this_one_is_read(hf, monkeypatch):
    engine = engine_for(hf, True)
    log, forward, get = [], engine.runner.forward, async_steps.SampledTokens.get
    engine.runner.forward = lambda step, tokens, replay, feed=None: \
        log.append("launch") or forward(step, tokens, replay, feed)
    monkeypatch.setattr(async_steps.SampledTokens, "get",
                        lambda self: log.append("read") or get(self))
    mask = engine.constraints.mask
    engine.constraints.mask = lambda *a: log.append("mask") or mask(*a)
    seqs = [engine.add_request(f"record {i}: ", params(json_schema=SCHEMA)) for i in range(3)]
    engine.step()  # the prompts (masked at once), then the first decode step launched
    assert log == ["launch", "mask", "launch", "read", "mask"]
    engine.step()  # each next step launched before the one before is read, masked after
    assert log[5:] == ["launch", "read", "mask"]
    while engine.has_unfinished():
        engine.step()
    assert all(s.finish_reason == "stop" for s in seqs)
    want = [s.output_ids for s in run_workload(engine_for(hf, False), [
        (0, f"record {i}: ", params(json_schema=SCHEMA)) for i in range(3)])]
    assert [s.output_ids for s in seqs] == want


def test_without_truncate_jump_forward_rows_stay_synchronous(hf):
    engine = engine_for(hf, True, graphs=False)
    engine.cache.supports_truncate = False
    jumped = engine.add_request("x", params(json_schema=SCHEMA, jump_forward=True))
    plain = engine.add_request("y", params(json_schema=SCHEMA))
    assert not constrained_steps.on_device(jumped, engine.cache)
    assert constrained_steps.on_device(plain, engine.cache)
    engine.abort([jumped, plain])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_constrained_async_steps_on_cuda_graphs_give_the_synchronous_tokens(hf):
    """The real thing: decode and mixed-step CUDA graphs, masks filled while the next
    forward runs, tokens read behind events."""
    def run(on):
        engine = core.build(hf, tokenizer=ascii_tokenizer(), plugins=["paged", Plugin()],
                            device="cuda", block_size=4, max_seq_len=160, max_batch_size=6,
                            max_num_batched_tokens=16, async_steps=on)
        assert engine.async_steps.enabled is on and engine.runner.step_graphs is not None
        return outcome(run_workload(engine))

    assert run(True) == run(False)
