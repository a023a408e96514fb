"""AsyncEngine: concurrent asyncio callers of one engine stepped on its own thread; each
request gets what ``Engine.generate`` gives it alone, cancellation frees its cache within
a step or two, and admission, shutdown and failures end requests the way they say."""
import asyncio
import time

import pytest
import torch

from infergraft import core
from infergraft.core.errors import InvalidRequestError
from infergraft.core.serving.async_engine import AsyncEngine, QueueFullError, RequestOutput
from infergraft.core.testing.models import random_model, random_prompt, tiny_llama_config

KINDS = [dict(), dict(temperature=1.0, top_k=40, seed=11), dict(temperature=0.8, seed=5)]
LONG = core.SamplingParams(max_new_tokens=100, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(1)
    hf = random_model(tiny_llama_config(), seed=7, scale=5.0)
    return core.build(hf, plugins=["paged"], max_seq_len=128, max_batch_size=8)


@pytest.fixture(scope="module")
def text_engine():
    """SmolLM2's tokenizer over a tiny random Llama (row-per-sequence cache)."""
    from transformers import AutoTokenizer

    from infergraft.core.loading.demo import ensure_demo_model

    tok = AutoTokenizer.from_pretrained(ensure_demo_model("smollm2-135m", quiet=True))
    hf = random_model(tiny_llama_config(vocab_size=49152, tie_word_embeddings=True), seed=0,
                      scale=5.0)
    return core.build(hf, tokenizer=tok, max_seq_len=128, max_batch_size=4)


async def _collect(aengine, prompt, params=None, **kw) -> list[RequestOutput]:
    return [out async for out in aengine.generate(prompt, params, **kw)]


def _assert_same_logprobs(got, want) -> None:
    assert [(g.token_id, [t for t, _ in g.top]) for g in got] == \
        [(w.token_id, [t for t, _ in w.top]) for w in want]
    values = lambda lps: [v for lp in lps for v in (lp.logprob, *(x for _, x in lp.top))]
    assert values(got) == pytest.approx(values(want), abs=1e-5)


def _tokens(outs) -> list[int]:
    return [t for o in outs for t in o.token_ids]


async def _until(done, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < end, "timed out"
        await asyncio.sleep(0.001)


def test_concurrent_requests_each_get_their_solo_output_and_are_counted(engine):
    calls = [(random_prompt(3 + i, 256, 10 + i),
              core.SamplingParams(max_new_tokens=20, **KINDS[i % 3])) for i in range(8)]
    alone = [engine.generate(p, max_new_tokens=20, **KINDS[i % 3])[0] for i, (p, _) in
             enumerate(calls)]
    logged = (random_prompt(5, 256, 9), core.SamplingParams(max_new_tokens=6, logprobs=2))
    solo = engine.add_request(*logged)
    while not solo.finished:
        engine.step()

    async def main():
        async with AsyncEngine(engine) as aengine:
            got = await asyncio.gather(*(_collect(aengine, p, sp, request_id=f"r{i}")
                                         for i, (p, sp) in enumerate(calls + [logged])))
            return got, aengine.stats(), aengine.num_steps

    before = engine.stats()
    got, stats, steps = asyncio.run(main())
    logged_outs = got.pop()
    for outs, want, i in zip(got, alone, range(8)):
        assert _tokens(outs) == want.token_ids
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        last = outs[-1]
        assert (last.request_id, last.finish_reason) == (f"r{i}", want.finish_reason)
        assert last.completion_tokens == len(want.token_ids) and last.metrics.ttft > 0
        assert last.prompt_tokens == len(calls[i][0]) and last.logprobs is None
    # the same tokens and ranks; the values to float32 rounding (a batch of other rows
    # sums in another order than the request alone)
    _assert_same_logprobs([lp for o in logged_outs for lp in o.logprobs], solo.logprobs)
    assert all(len(o.logprobs) == len(o.token_ids) for o in logged_outs)  # each with its ids
    total = sum(len(c.token_ids) for c in alone) + len(solo.output_ids)
    assert steps < total  # they shared steps
    kv = {k: v for k, v in engine.stats().items() if k not in ("num_running", "num_waiting")}
    prompts = sum(len(p) for p, _ in calls + [logged])
    assert stats == {"requests_running": 0, "requests_waiting": 0, "kv_cache_usage_ratio": 0.0,
                     "prompt_tokens_total": prompts, "generation_tokens_total": total,
                     "num_steps": steps, "num_prefill_steps": stats["num_prefill_steps"],
                     "step_seconds_total": stats["step_seconds_total"], **kv}
    assert 1 <= stats["num_prefill_steps"] < steps and stats["step_seconds_total"] > 0
    # engine.stats()'s K/V memory: every prompt looked up, every block free again
    assert stats["prefix_cache_queries"] - before["prefix_cache_queries"] >= prompts
    assert stats["kv_blocks_total"] == stats["kv_blocks_free"] > 0


def test_text_deltas_add_up_to_the_final_text_and_stop_strings_trim_it(text_engine):
    prompt = "The capital of France is"
    want = text_engine.generate(prompt, max_new_tokens=30)[0]
    stop = want.text[len(want.text) // 2:][:6]  # a string from its second half
    cut = text_engine.generate(prompt, max_new_tokens=30, stop=stop)[0]
    assert cut.finish_reason == "stop" and stop not in cut.text

    async def main():
        async with AsyncEngine(text_engine) as aengine:
            return await asyncio.gather(
                _collect(aengine, prompt, core.SamplingParams(max_new_tokens=30)),
                _collect(aengine, prompt, core.SamplingParams(max_new_tokens=30, stop=stop)))

    plain, stopped = asyncio.run(main())
    assert "".join(o.text for o in plain) == want.text
    assert _tokens(plain) == want.token_ids
    assert "".join(o.text for o in stopped) == cut.text
    assert all(stop not in o.text for o in stopped) and stopped[-1].finish_reason == "stop"
    assert len(plain) > 5  # streamed, not in one piece


def test_cancelling_frees_the_cache_within_a_step_or_two(engine, monkeypatch):
    asked, applied, real_abort = [], [], engine.abort

    async def main():
        async with AsyncEngine(engine) as aengine:
            real_ask = aengine._abort

            def ask(request_id):  # the consumer gave up: the request goes to the loop
                asked.append(aengine.num_steps)
                real_ask(request_id)

            def apply(seqs, reason="abort"):  # the loop thread aborts it in the engine
                applied.append(aengine.num_steps)
                return real_abort(seqs, reason)

            monkeypatch.setattr(aengine, "_abort", ask)
            monkeypatch.setattr(engine, "abort", apply)
            keep = asyncio.create_task(_collect(aengine, random_prompt(4, 256, 1), LONG))
            # 1) break out of the loop, 2) cancel the consuming task, 3) abort by id
            async for out in aengine.generate(random_prompt(4, 256, 2), LONG):
                if out.completion_tokens >= 3:
                    break
            await _until(lambda: len(applied) == 1)
            reading = asyncio.Event()

            async def reader():
                async for out in aengine.generate(random_prompt(5, 256, 3), LONG):
                    if out.completion_tokens >= 3:
                        reading.set()
                        await asyncio.sleep(30)  # cancelled here

            task = asyncio.create_task(reader())
            await reading.wait()
            task.cancel()
            await _until(lambda: len(applied) == 2)
            outs = []
            async for out in aengine.generate(random_prompt(6, 256, 4), LONG, request_id="d"):
                outs.append(out)
                if out.completion_tokens == 3 and not out.finished:
                    await aengine.abort("d")
            await _until(lambda: len(applied) == 3)
            mid = engine.cache.stats()["sequences"]
            return await keep, outs, mid

    kept, outs, mid = asyncio.run(main())
    assert mid == 1  # the one left running
    assert len(_tokens(kept)) == 100 and kept[-1].finish_reason == "length"
    assert outs[-1].finish_reason == "abort" and outs[-1].completion_tokens < 100
    assert len(asked) == 3 and all(0 <= a - m <= 2 for m, a in zip(asked, applied)), \
        (asked, applied)
    assert engine.cache.stats()["sequences"] == 0


def test_queue_full_at_max_waiting_and_the_rest_run_on():
    engine = core.build(random_model(tiny_llama_config(), seed=7, scale=5.0), max_seq_len=128,
                        max_batch_size=1)
    b, c = random_prompt(5, 256, 6), random_prompt(5, 256, 7)
    want = [engine.generate(p, max_new_tokens=6)[0].token_ids for p in (b, c)]

    async def main():
        async with AsyncEngine(engine, max_waiting=2) as aengine:
            first = aengine.generate(random_prompt(4, 256, 5), LONG)
            await first.__anext__()  # running: the batch of one is full
            waiting = [asyncio.create_task(_collect(aengine, p, core.SamplingParams(
                max_new_tokens=6))) for p in (b, c)]
            await asyncio.sleep(0)  # both submitted
            with pytest.raises(QueueFullError, match=r"2 requests are waiting already "
                                                     r"\(max_waiting=2\)"):
                await _collect(aengine, random_prompt(3, 256, 8))
            stats = aengine.stats()
            await first.aclose()
            return [_tokens(o) for o in await asyncio.gather(*waiting)], stats

    got, stats = asyncio.run(main())
    assert got == want
    assert (stats["requests_running"], stats["requests_waiting"]) == (1, 2)
    assert stats["kv_cache_usage_ratio"] == 1.0  # one row of one


def test_shutdown_with_drain_finishes_what_runs_then_refuses(engine):
    prompts = [random_prompt(4, 256, 20 + i) for i in range(3)]
    want = [engine.generate(p, max_new_tokens=25)[0].token_ids for p in prompts]

    async def main():
        aengine = AsyncEngine(engine)
        await aengine.start()
        gens = [aengine.generate(p, core.SamplingParams(max_new_tokens=25)) for p in prompts]
        heads = [await g.__anext__() for g in gens]
        closing = asyncio.create_task(aengine.shutdown(drain=True, timeout=30))
        await asyncio.sleep(0)
        with pytest.raises(QueueFullError, match="shutting down"):
            await _collect(aengine, prompts[0])
        rest = [[o async for o in g] for g in gens]
        await closing
        return [[h, *r] for h, r in zip(heads, rest)]

    got = asyncio.run(main())
    assert [_tokens(o) for o in got] == want
    assert all(o[-1].finish_reason in ("stop", "length") for o in got)


@pytest.mark.parametrize("how", ["no drain", "drain timed out"])
def test_shutdown_without_drain_aborts_what_runs(engine, how):
    async def main():
        aengine = AsyncEngine(engine)
        gens = [aengine.generate(random_prompt(4, 256, 30 + i), LONG) for i in range(2)]
        for g in gens:
            await g.__anext__()
        if how == "no drain":
            await aengine.shutdown(drain=False)
        else:
            await aengine.shutdown(drain=True, timeout=0)
        return [[o async for o in g] for g in gens], aengine._thread.is_alive()

    got, alive = asyncio.run(main())
    assert not alive
    assert all(o[-1].finish_reason == "abort" and o[-1].completion_tokens < 100 for o in got)
    assert engine.cache.stats()["sequences"] == 0 and not engine.has_unfinished()


def test_a_request_whose_sampling_fails_ends_with_error_and_the_others_finish(
        engine, sampling_fails_at_seed_666):
    good = [random_prompt(5, 256, 40 + i) for i in range(2)]
    want = [engine.generate(p, max_new_tokens=12)[0].token_ids for p in good]

    async def main():
        async with AsyncEngine(engine) as aengine:
            return await asyncio.gather(
                _collect(aengine, random_prompt(4, 256, 42),
                         core.SamplingParams(max_new_tokens=12, temperature=1.0, seed=666)),
                *(_collect(aengine, p, core.SamplingParams(max_new_tokens=12)) for p in good))

    bad, *ok = asyncio.run(main())
    assert bad[-1].finish_reason == "error" and "nan" in bad[-1].error
    assert [_tokens(o) for o in ok] == want


def test_a_step_that_raises_fails_its_requests_and_the_loop_serves_on(engine, monkeypatch):
    p = random_prompt(6, 256, 50)
    want = engine.generate(p, max_new_tokens=8)[0].token_ids
    real, calls = engine.runner.forward, []

    def failing(*args, **kwargs):  # the first step dies in the model (an OOM, say)
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("CUDA out of memory (simulated)")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "forward", failing)  # (eager or a graph replay)

    async def main():
        async with AsyncEngine(engine) as aengine:
            failed = await _collect(aengine, p, core.SamplingParams(max_new_tokens=8))
            after = await _collect(aengine, p, core.SamplingParams(max_new_tokens=8))
            return failed, after

    failed, after = asyncio.run(main())
    assert failed[-1].finish_reason == "error" and "simulated" in failed[-1].error
    assert _tokens(after) == want and engine.cache.stats()["sequences"] == 0


def test_bad_requests_raise_before_any_output_and_idle_costs_nothing(engine):
    async def main():
        async with AsyncEngine(engine) as aengine:
            with pytest.raises(InvalidRequestError, match="empty"):
                await _collect(aengine, [])
            with pytest.raises(InvalidRequestError, match="max_seq_len=128"):
                await _collect(aengine, [5] * 100, core.SamplingParams(max_new_tokens=40))
            with pytest.raises(InvalidRequestError, match="SamplingParams"):
                await _collect(aengine, [5, 6], {"max_new_tokens": 3})
            running = aengine.generate([5, 6, 7], LONG, request_id="same")
            await running.__anext__()
            with pytest.raises(InvalidRequestError, match="'same' is running already"):
                await _collect(aengine, [5, 6], request_id="same")
            await running.aclose()
            await asyncio.sleep(0.05)
            steps, cpu = aengine.num_steps, time.process_time()
            await asyncio.sleep(0.3)  # idle: the loop sleeps on its condition
            return aengine.num_steps - steps, time.process_time() - cpu

    idle_steps, idle_cpu = asyncio.run(main())
    assert idle_steps == 0 and idle_cpu < 0.1
    with pytest.raises(InvalidRequestError, match="max_waiting"):
        AsyncEngine(engine, max_waiting=0)
