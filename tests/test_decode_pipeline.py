"""Greedy decode look-ahead (core/runner/lookahead.py): step N+1 is launched before step N
is read. (The file keeps its old name: GPU runs and docs name it.)

Run eagerly on the CPU through the CUDA-graph runner's static buffers
(``use_graphs=False``): tokens must equal the plain engine's whatever stops a sequence
(EOS, token limit, abort, a new request arriving), and no cache memory may leak.
"""
import pytest
import torch

from infergraft import core
from infergraft.core.runner.cuda_graph import CudaGraphRunner
from infergraft.core.request import SamplingParams
from infergraft.core.testing.models import random_model, random_prompt, tiny_llama_config

CFG = tiny_llama_config()


@pytest.fixture(scope="module")
def hf():
    return random_model(CFG, seed=5, scale=5.0)


def looking_ahead(hf, backend, batch=4):
    engine = core.build(hf, plugins=[backend], max_seq_len=96, max_batch_size=batch)
    engine.cache.device_decode = True  # contiguous: tensor-only decode metadata
    runner = CudaGraphRunner(engine.model, engine.cache, batch, buckets=(2,), use_graphs=False)
    runner.capture()
    engine.decode_graphs = runner
    launches = []
    launch = runner.launch
    runner.launch = lambda ids, tokens: launches.append(tokens is None) or launch(ids, tokens)
    return engine, launches


def alone(hf, prompt, new, eos=()):
    engine = core.build(hf, max_seq_len=96, max_batch_size=1)
    engine.eos_token_ids = frozenset(eos)
    return engine.generate(prompt, max_new_tokens=new)[0].token_ids


@pytest.mark.parametrize("backend", ["paged", "contiguous"])
def test_look_ahead_greedy_equals_plain_with_eos_and_limits(hf, backend):
    prompts = [random_prompt(n, CFG.vocab_size, n) for n in (5, 13, 9)]
    news = [20, 7, 14]
    eos = alone(hf, prompts[0], 20)[6]  # the first prompt meets it mid-generation
    engine, launches = looking_ahead(hf, backend)
    engine.eos_token_ids = frozenset({eos})
    seqs = [engine.add_request(p, SamplingParams(max_new_tokens=n)) for p, n in zip(prompts, news)]
    while engine.has_unfinished():
        engine.step()
    for seq, p, n in zip(seqs, prompts, news):
        assert seq.output_ids == alone(hf, p, n, eos={eos})
    assert seqs[0].finish_reason == "stop" and seqs[1].finish_reason == "length"
    assert any(launches), "no step was launched ahead from device tokens"
    assert engine.lookahead.inflight is None
    assert engine.cache.stats()["tokens"] == 0
    engine.cache.check_invariants()


def test_request_arriving_and_abort_while_a_step_is_in_flight(hf):
    engine, launches = looking_ahead(hf, "paged")
    a, b, c = (random_prompt(n, CFG.vocab_size, 40 + n) for n in (6, 11, 8))
    sa = engine.add_request(a, SamplingParams(max_new_tokens=24))
    sb = engine.add_request(b, SamplingParams(max_new_tokens=24))
    for _ in range(5):
        engine.step()
    assert engine.lookahead.inflight is not None  # steady state: one step ahead
    sc = engine.add_request(c, SamplingParams(max_new_tokens=10))  # joins the running batch
    for _ in range(4):
        engine.step()
    engine.scheduler.abort([sb])
    n_b = len(sb.output_ids)
    while engine.has_unfinished():
        engine.step()
    assert len(sb.output_ids) == n_b and sb.finish_reason == "abort"
    assert sa.output_ids == alone(hf, a, 24)
    assert sc.output_ids == alone(hf, c, 10)
    assert sb.output_ids == alone(hf, b, 24)[:n_b]
    assert engine.cache.stats()["blocks_used"] == 0
    engine.cache.check_invariants()


def test_sampled_requests_take_the_path_without_look_ahead(hf):
    engine, launches = looking_ahead(hf, "paged")
    plain = core.build(hf, plugins=["paged"], max_seq_len=96, max_batch_size=4)
    prompts = [random_prompt(n, CFG.vocab_size, n) for n in (7, 10)]
    kw = dict(max_new_tokens=12, temperature=0.8, top_k=20, seed=3)
    want = [c.token_ids for c in plain.generate(prompts, **kw)]
    assert [c.token_ids for c in engine.generate(prompts, **kw)] == want
    assert launches == []


@pytest.mark.parametrize("backend", ["paged", "contiguous"])
def test_decode_metadata_staging_keeps_the_step_in_flight(hf, backend):
    # with the look-ahead the host fills step N+1's metadata while step N's host-to-device
    # copy may still be queued: the fill must not touch the buffer step N's copy reads
    engine = core.build(hf, plugins=[backend], max_seq_len=96, max_batch_size=2)
    cache = engine.cache
    meta = cache.static_decode_meta(2)
    for s in ("a", "b"):
        cache.allocate(s, 4)
        cache.prepare([s], [3])  # 3 tokens cached
    staging = cache._graph_buffers[2][0] if backend == "paged" else meta.host
    cache.prepare_decode_into(meta, ["a", "b"])  # step N: positions 3, 3
    step_n = staging._buffers[staging._turn].clone()
    cache.prepare_decode_into(meta, ["a", "b"])  # step N+1: positions 4, 4
    assert torch.equal(staging._buffers[staging._turn ^ 1], step_n), "step N's staging changed"
    # paged: one flat buffer, positions first; contiguous: rows [4, B], positions first
    positions = (lambda buf: buf[:2]) if backend == "paged" else (lambda buf: buf[0])
    assert positions(staging._buffers[staging._turn]).tolist() == [4, 4]
    assert positions(step_n).tolist() == [3, 3]


def test_no_gc_during_capture_restores_the_collector():
    import gc

    from infergraft.core.runner.cuda_graph import no_gc

    assert gc.isenabled()
    with pytest.raises(RuntimeError):
        with no_gc():
            assert not gc.isenabled()
            raise RuntimeError("capture failed")
    assert gc.isenabled()  # re-enabled even when the capture raised


def test_an_interrupt_while_reading_a_step_in_flight_loses_nothing(hf):
    engine, _ = looking_ahead(hf, "paged")
    prompt = random_prompt(5, CFG.vocab_size, 21)
    want = alone(hf, prompt, 12)
    seq = engine.add_request(prompt, SamplingParams(max_new_tokens=12))
    for _ in range(3):
        engine.step()  # prefill, then decode steps looking ahead (one in flight)
    assert engine.lookahead.inflight is not None
    runner, launch, calls = engine.decode_graphs, engine.decode_graphs.launch, []

    def launch_then_interrupt(ids, tokens):  # the next read of a step dies (Ctrl-C)
        pending = launch(ids, tokens)
        if not calls:
            calls.append(1)

            def get():
                raise KeyboardInterrupt
            pending.get = get
        return pending

    runner.launch = launch_then_interrupt
    for _ in range(3):  # the step in flight is read fine; the one launched next is not
        try:
            engine.step()
        except KeyboardInterrupt:
            break
    else:
        raise AssertionError("the interrupt never came")
    assert engine.lookahead.inflight is None and seq.status.value == "waiting"
    while engine.has_unfinished():
        engine.step()
    assert seq.output_ids == want
    assert engine.cache.stats()["sequences"] == 0
