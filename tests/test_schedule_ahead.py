"""Scheduling the next step while the current one runs (``Engine.schedule_ahead``, on by
default on one CUDA device): forced on here on the CPU, where the same code runs without
the overlap. The step scheduled ahead loses the sequences that finished meanwhile (length,
stop, abort), is dropped when the cache no longer takes it (a fork took a block), and is
not taken at all where the cache is short (pauses and preemptions see the step's outcome);
every request still gets HF's greedy tokens."""
import pytest

from infergraft import core
from infergraft.core.request import SamplingParams
from infergraft.core.testing.models import random_model, random_prompt, tiny_llama_config
from infergraft.core.testing.parity import hf_greedy
from test_scheduler import apply, make, seq

_HF = {}


def _engine(budget, **options):
    hf = _HF.setdefault("m", random_model(tiny_llama_config(), seed=5, scale=5.0))
    engine = core.build(hf, plugins=["paged"], max_seq_len=64, max_batch_size=4,
                        max_num_batched_tokens=budget, block_size=4, **options)
    assert not engine.schedule_ahead  # off on the CPU by default
    engine.schedule_ahead = True
    return hf, engine


@pytest.mark.parametrize("budget, options", [(5, {}), (16, {}), (16, dict(num_blocks=16))])
def test_arrivals_aborts_and_forks_get_hf_greedy_tokens(budget, options):
    hf, engine = _engine(budget, **options)
    taken, resume = [], engine.scheduler.resume
    engine.scheduler.resume = lambda step: taken.append(step) or resume(step)
    prompts = {n: random_prompt(n, 256, 40 + n) for n in (19, 4, 27, 9, 13)}
    seqs, gone = {}, None
    for step in range(400):
        if step < 5:  # one arrival a step
            n = list(prompts)[step]
            seqs[n] = engine.add_request(prompts[n], SamplingParams(max_new_tokens=14 + n % 7))
        if step == 6:
            gone = seqs.pop(27)
            engine.abort(gone)  # while a step scheduled ahead holds it
        if not engine.has_unfinished():
            break
        engine.step()
    assert taken, "no step was scheduled ahead"
    assert gone.finish_reason == "abort" and engine.cache.stats()["sequences"] == 0
    for n, s in seqs.items():
        assert s.output_ids == hf_greedy(hf, prompts[n], s.params.max_new_tokens), n
    if "num_blocks" in options:  # the tight pool paused or preempted, then resumed
        assert engine.scheduler.num_paused + engine.scheduler.num_preemptions > 0
    p = random_prompt(11, 256, 3)  # forks take a block after the step ahead was scheduled
    outs = engine.generate([p, p[:5]], max_new_tokens=7, n=2)
    want = [hf_greedy(hf, p, 7), hf_greedy(hf, p[:5], 7)]
    assert [c.token_ids for c in outs] == [want[0], want[0], want[1], want[1]]
    engine.cache.check_invariants()


def test_the_scheduler_ahead_and_resumed():
    sched, cache = make(num_blocks=64, max_num_batched_tokens=8)
    a, b, c = seq(3, max_new_tokens=2), seq(3), seq(10)
    for s in (a, b):
        sched.add(s)
    apply(sched, cache, sched.schedule())  # a and b prefilled: each has its first token
    sched.add(c)
    ahead = sched.schedule_ahead()  # a, b decode; c's first chunk of 6
    assert [(s, n) for s, n in zip(ahead.seqs, ahead.counts)] == [(a, 1), (b, 1), (c, 6)]
    sched.finish(a, "stop")  # a stopped at the step that was running
    step = sched.resume(ahead)
    assert (step.kind, step.seqs, step.counts) == ("prefill", [b, c], [1, 6])
    assert sched.last_kind == "prefill"
    apply(sched, cache, step)
    ahead = sched.schedule_ahead()
    sched.finish(b, "stop")
    sched.abort([c])
    assert sched.resume(ahead) is None  # nothing of it is left: schedule() again
    assert sched.schedule() is None and not sched.has_work()


def test_nothing_is_scheduled_ahead_where_the_cache_is_short():
    sched, cache = make(num_blocks=3, block_size=4)
    a, b = seq(4), seq(4)  # a block each; one left for the two tokens after them
    for s in (a, b):
        sched.add(s)
    apply(sched, cache, sched.schedule())
    before = (list(sched.running), dict(cache.blocks), sched.num_paused)
    assert sched.schedule_ahead() is None  # one must pause: that waits for the outcome
    assert (list(sched.running), dict(cache.blocks), sched.num_paused) == before
    step = sched.schedule()  # the ordinary schedule pauses b
    assert step.seqs == [a] and sched.num_paused == 1


def test_a_step_ahead_the_cache_no_longer_takes_is_dropped():
    sched, cache = make(num_blocks=4, block_size=4)
    a, b = seq(4), seq(3)
    for s in (a, b):
        sched.add(s)
    apply(sched, cache, sched.schedule())  # a: 1 block, full; b: 1 block
    ahead = sched.schedule_ahead()  # a needs its 2nd block: 2 free
    assert ahead.seqs == [a, b]
    cache.allocate("fork", 8)  # a fork took the two free blocks meanwhile
    assert sched.resume(ahead) is None


def test_decode_graph_steps_schedule_the_next_step_ahead_with_eos_and_arrivals():
    """The decode graphs' path (run eagerly through their static buffers): with requests
    waiting, no step is launched ahead from device tokens, so the next step is scheduled
    while the current one runs; an EOS met mid-run drops its sequence from that step."""
    from infergraft.core.runner.cuda_graph import CudaGraphRunner

    hf, engine = _engine(64)
    runner = CudaGraphRunner(engine.model, engine.cache, 4, buckets=(2, 4), use_graphs=False)
    runner.capture()
    engine.decode_graphs = runner
    prompts = [random_prompt(n, 256, 60 + n) for n in (5, 12, 8, 10, 7, 6)]
    alone = core.build(hf, max_seq_len=64, max_batch_size=1)
    eos = alone.generate(prompts[0], max_new_tokens=20)[0].token_ids[5]
    engine.eos_token_ids = alone.eos_token_ids = frozenset({eos})
    taken, resume = [], engine.scheduler.resume

    def record(step):
        step = resume(step)
        taken.append(step and step.kind)
        return step
    engine.scheduler.resume = record
    seqs = [engine.add_request(p, SamplingParams(max_new_tokens=20)) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    assert "decode" in taken and runner.replays > 0
    for p, s in zip(prompts, seqs):
        assert s.output_ids == alone.generate(p, max_new_tokens=20)[0].token_ids
    assert seqs[0].finish_reason == "stop" and engine.cache.stats()["sequences"] == 0
