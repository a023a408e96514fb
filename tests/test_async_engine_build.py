"""AsyncEngine.build: the engine is built on the thread that then steps it (on the CPU,
OpenMP's worker pool is that thread's alone), serves as AsyncEngine(engine) does, and
what the build raises reaches the caller."""
import asyncio
import importlib
import threading
import time

import pytest
import torch

from infergraft import core
from infergraft.core.errors import InfergraftError
from infergraft.core.serving.async_engine import AsyncEngine
from infergraft.core.testing.models import random_model, random_prompt, tiny_llama_config

GREEDY = core.SamplingParams(max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def hf():
    torch.set_num_threads(1)
    return random_model(tiny_llama_config(), seed=3, scale=5.0)


def test_built_and_stepped_on_one_thread_with_the_outputs_of_a_plain_engine(hf, monkeypatch):
    build_module = importlib.import_module("infergraft.core.build")
    threads = {"build": set(), "step": set()}
    real_build = build_module.build

    def recording_build(*args, **kwargs):
        threads["build"].add(threading.get_ident())
        engine = real_build(*args, **kwargs)
        real_step = engine.step

        def step():
            threads["step"].add(threading.get_ident())
            return real_step()

        engine.step = step
        return engine

    monkeypatch.setattr(build_module, "build", recording_build)
    aengine = AsyncEngine.build(hf, max_waiting=4, max_seq_len=96, max_batch_size=4)
    monkeypatch.undo()
    prompts = [random_prompt(n, 256, seed=n) for n in (5, 17, 30)]

    async def serve():
        async def one(p):
            return [t async for out in aengine.generate(p, GREEDY) for t in out.token_ids]

        outs = await asyncio.gather(*[one(p) for p in prompts])
        await aengine.shutdown()
        return outs

    outs = asyncio.run(serve())
    assert len(threads["build"]) == 1 and threads["step"] == threads["build"]
    assert threading.get_ident() not in threads["build"]
    assert aengine.num_steps > 0 and not aengine._thread.is_alive()
    plain = core.build(hf, max_seq_len=96, max_batch_size=4)
    assert outs == [_alone(plain, p) for p in prompts]


def _alone(engine, prompt, params=GREEDY) -> list[int]:
    seq = engine.add_request(prompt, params)
    while not seq.finished:
        engine.step()
    return seq.output_ids


def test_what_the_build_raises_is_raised_to_the_caller(tmp_path):
    before = threading.active_count()
    with pytest.raises(InfergraftError) as err:
        AsyncEngine.build(str(tmp_path / "no-such-model"), max_seq_len=64)
    assert "no-such-model" in str(err.value)
    with pytest.raises(InfergraftError, match="max_waiting"):
        AsyncEngine.build(str(tmp_path), max_waiting=0)
    for _ in range(500):  # the failed build's thread ends right after it hands the error over
        if threading.active_count() == before:
            break
        time.sleep(0.01)
    assert threading.active_count() == before


def test_a_lagging_consumer_gets_fewer_outputs_holding_every_token(hf):
    engine = core.build(hf, max_seq_len=96, max_batch_size=4)
    params = core.SamplingParams(max_new_tokens=24, ignore_eos=True, logprobs=1)
    prompt = random_prompt(7, 256, seed=2)

    async def slow_reader():
        async with AsyncEngine(engine) as aengine:
            outs = []
            async for out in aengine.generate(prompt, params):
                outs.append(out)
                await asyncio.sleep(0.05)  # several steps pile up meanwhile
            return outs

    outs = asyncio.run(slow_reader())
    ids = [t for o in outs for t in o.token_ids]
    assert len(outs) < 24 and ids == _alone(core.build(hf, max_seq_len=96, max_batch_size=4),
                                            prompt, params)
    assert [r.token_id for o in outs for r in o.logprobs] == ids
    assert outs[-1].finished and outs[-1].completion_tokens == 24
    assert not any(o.finished for o in outs[:-1])
