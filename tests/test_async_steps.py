"""Asynchronous steps (core/runner/async_steps.py): step N+1 launched before step N's
tokens are read, its decode rows fed N's tokens on the device.

Run on the CPU, where the same logic runs without the overlap: through the eager path
and through the graph runners' static buffers (``use_graphs=False``), every request must
get the tokens the synchronous engine gives it, whatever the mix (prompts of different
lengths arriving over time, chunked prefill, EOS, stop strings, token limits and aborts
mid-batch, preemption in a small cache, forks of ``n``, seeded sampling beside greedy
requests), the cache must end empty, and step N+1 must be launched before N is read.
"""
import pytest
import torch

from infergraft import core
from infergraft.core.errors import ConfigError, PlanError
from infergraft.core.request import SamplingParams
from infergraft.core.runner import async_steps
from infergraft.core.testing.models import (byte_tokenizer, random_model, random_prompt,
                                            tiny_llama_config)
from graph_support import drive, eager_graph_runners

CFG = tiny_llama_config()
SETUPS = {  # name -> (plugins, build options, graph runners on their static buffers)
    "paged-graph-runners": (["paged"], dict(block_size=4), True),
    "paged-eager": (["paged"], dict(block_size=4), False),
    "paged-tight": (["paged"], dict(block_size=4, num_blocks=16), True),
    "contiguous": ([], {}, False),
}


@pytest.fixture(scope="module")
def hf():
    return random_model(CFG, seed=5, scale=5.0)


def engine_for(hf, setup, on, budget=8, batch=4, **kw):
    plugins, options, graphs = SETUPS[setup]
    engine = core.build(hf, plugins=plugins, max_seq_len=64, max_batch_size=batch,
                        max_num_batched_tokens=budget, async_steps=on, **options, **kw)
    engine.schedule_ahead = True  # both engines schedule the same way (the CPU's default: off)
    if graphs:
        eager_graph_runners(engine, budget, batch)
    return engine


def fed_steps(engine) -> list:
    """(step kind, whether rows were fed from the device) of every forward, in order."""
    seen, forward = [], engine.runner.forward
    engine.runner.forward = lambda step, tokens, replay, feed=None: \
        seen.append((step.kind, feed is not None)) or forward(step, tokens, replay, feed)
    return seen


def run_workload(engine, arrivals, abort_at=None, params=None):
    """``arrivals``: (step, prompt length, new tokens), ``params`` by prompt length where
    given; the first sequence is aborted at step ``abort_at``. Returns the sequences, in
    arrival order (by step, then prompt length)."""
    return drive(engine, [
        (step, random_prompt(n, CFG.vocab_size, 3 * n + new),
         (params or {}).get(n, SamplingParams(max_new_tokens=new)))
        for step, n, new in sorted(arrivals)], None if abort_at is None else (abort_at, 0))


ARRIVALS = [(0, 19, 12), (0, 4, 9), (1, 27, 14), (2, 9, 3), (4, 13, 16), (5, 6, 1),
            (9, 30, 8), (10, 5, 11), (16, 11, 7)]


@pytest.mark.parametrize("setup", list(SETUPS))
def test_async_steps_give_the_synchronous_tokens(hf, setup):
    eos = run_workload(engine_for(hf, setup, False), ARRIVALS)[2].output_ids[5]
    engine = engine_for(hf, setup, True)  # the third request meets EOS mid-generation
    seen = fed_steps(engine)
    engine.eos_token_ids = frozenset({eos})
    got = run_workload(engine, ARRIVALS)
    plain = engine_for(hf, setup, False)
    plain.eos_token_ids = frozenset({eos})
    want = run_workload(plain, ARRIVALS)
    assert [s.output_ids for s in got] == [s.output_ids for s in want]
    assert [s.finish_reason for s in got] == [s.finish_reason for s in want]
    assert got[2].finish_reason == "stop" and len(got[2].output_ids) == 6
    # mixed steps launched with rows fed from the device (and decode steps, where no
    # decode graphs' look-ahead takes them: test_decode_graph_steps_fed_from_the_device)
    assert ("prefill", True) in seen, seen
    assert SETUPS[setup][2] or ("decode", True) in seen, seen
    if setup == "paged-tight":  # the small pool paused or preempted, then resumed
        stats = engine.scheduler
        assert stats.num_paused + stats.num_preemptions > 0


def test_decode_graph_steps_fed_from_the_device(hf):
    """A full batch with a prompt waiting: its decode steps are no look-ahead's (the next
    batch may differ), so they run here, through the decode graphs' static buffers, the
    padding row of a bucket repeating the last live row's token from the device."""
    arrivals = [(0, 5, 6), (0, 6, 3), (0, 7, 5), (1, 4, 4)]

    def run(on):
        engine = engine_for(hf, "paged-graph-runners", on, batch=2)
        seen = fed_steps(engine)
        return run_workload(engine, arrivals), seen

    (got, seen), (want, _) = run(True), run(False)
    assert [s.output_ids for s in got] == [s.output_ids for s in want]
    assert ("decode", True) in seen, seen


def test_an_abort_between_steps_drops_the_row_launched_ahead(hf):
    engine = engine_for(hf, "paged-graph-runners", True)
    got = run_workload(engine, ARRIVALS, abort_at=6)
    want = run_workload(engine_for(hf, "paged-graph-runners", False), ARRIVALS)
    aborted = got[0]
    assert aborted.finish_reason == "abort"
    assert 0 < len(aborted.output_ids) < len(want[0].output_ids)
    assert aborted.output_ids == want[0].output_ids[:len(aborted.output_ids)]
    assert [s.output_ids for s in got[1:]] == [s.output_ids for s in want[1:]]


def test_the_next_step_is_launched_before_this_one_is_read(hf, monkeypatch):
    engine = engine_for(hf, "paged-graph-runners", True)
    log, forward, get = [], engine.runner.forward, async_steps.SampledTokens.get
    engine.runner.forward = lambda step, tokens, replay, feed=None: \
        log.append(("launch", step.kind)) or forward(step, tokens, replay, feed)
    monkeypatch.setattr(async_steps.SampledTokens, "get",
                        lambda self: log.append(("read",)) or get(self))
    a = engine.add_request(random_prompt(5, CFG.vocab_size, 1), SamplingParams(max_new_tokens=6))
    b = engine.add_request(random_prompt(13, CFG.vocab_size, 2), SamplingParams(max_new_tokens=6))
    # steps of 8 tokens: 1) a's prompt, b's first 3; 2) a's token (from the device), b's
    # next 7; 3) a's, b's last 3; 4) both decode, the same batch from then on: the decode
    # graphs' look-ahead's (lookahead.py)
    engine.step()  # step 2 launched before step 1 is read
    assert log == [("launch", "prefill"), ("launch", "prefill"), ("read",)]
    assert len(a.output_ids) == 1 and not b.output_ids
    assert engine.async_steps.inflight is not None
    engine.step()  # step 3 launched before step 2 is read
    assert log[3:] == [("launch", "prefill"), ("read",)] and len(a.output_ids) == 2
    engine.step()  # step 3 read; step 4 left to the look-ahead
    assert log[5:] == [("read",)] and len(b.output_ids) == 1
    assert engine.async_steps.inflight is None and engine._ahead is not None
    while engine.has_unfinished():
        engine.step()
    assert len(log) == 6 and len(a.output_ids) == len(b.output_ids) == 6


def test_sampled_and_stopped_requests_beside_greedy_ones(hf):
    """Seeded sampled requests run their steps synchronously (their draws are the host's);
    greedy ones around them asynchronously; a stop string ends one mid-batch."""
    tok = byte_tokenizer()
    seeded = {13: SamplingParams(max_new_tokens=16, temperature=0.8, top_p=0.9, seed=7),
              6: SamplingParams(max_new_tokens=10, temperature=1.0, seed=3)}
    sync = run_workload(engine_for(hf, "paged-graph-runners", False, tokenizer=tok),
                        ARRIVALS, params=seeded)
    out = sync[0].output_ids  # the first request stops at the first new ASCII letter
    texts = [tok.decode(out[:k]) for k in range(1, 9)]
    stop = next(t[-1] for t, before in zip(texts[1:], texts) if t[-1].isalpha()
                and t[-1].isascii() and t[-1] not in before)
    params = {**seeded, 4: SamplingParams(max_new_tokens=9, stop=[stop])}

    def run(on):
        engine = engine_for(hf, "paged-graph-runners", on, tokenizer=tok)
        launched, launch = [], engine.async_steps._launch
        engine.async_steps._launch = lambda step, *a: launched.append(step) or launch(step, *a)
        return run_workload(engine, ARRIVALS, params=params), launched

    (got, launched), (want, _) = run(True), run(False)
    assert [s.output_ids for s in got] == [s.output_ids for s in want]
    assert [s.text for s in got] == [s.text for s in want]
    assert got[0].finish_reason == "stop" and len(got[0].output_ids) < 9
    assert launched and all(s.params.plain_greedy for step in launched for s in step.seqs)


def test_forks_of_n_get_the_synchronous_tokens(hf):
    p = random_prompt(11, CFG.vocab_size, 3)
    got = engine_for(hf, "paged-graph-runners", True).generate([p, p[:5]], max_new_tokens=7,
                                                                n=2)
    want = engine_for(hf, "paged-graph-runners", False).generate([p, p[:5]], max_new_tokens=7,
                                                                 n=2)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]


def test_async_steps_default_and_bad_values(hf):
    assert not core.build(hf, max_seq_len=32, max_batch_size=2).async_steps.enabled  # CPU
    engine = core.build(hf, max_seq_len=32, max_batch_size=2, async_steps=True)
    assert engine.async_steps.enabled and engine.schedule_ahead
    with pytest.raises(PlanError, match="async_steps must be True, False or None"):
        core.build(hf, max_seq_len=32, max_batch_size=2, async_steps="yes")
    config = {"max_seq_len": 32, "max_batch_size": 2, "async_steps": True}
    assert core.build(hf, config=config).async_steps.enabled
    with pytest.raises(ConfigError, match="async_steps"):
        core.build(hf, config={**config, "async_steps": "on"})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_async_steps_on_cuda_graphs_give_the_synchronous_tokens(hf):
    """The real thing: decode and mixed-step CUDA graphs, tokens read behind events."""
    def run(on):
        engine = core.build(hf, plugins=["paged"], device="cuda", max_seq_len=64,
                            max_batch_size=4, max_num_batched_tokens=8, block_size=4,
                            async_steps=on)
        assert engine.async_steps.enabled is on and engine.runner.step_graphs is not None
        return [s.output_ids for s in run_workload(engine, ARRIVALS)]

    assert run(True) == run(False)
