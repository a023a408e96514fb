"""EngineProcess: the engine in a process of its own behind AsyncEngine's interface (what
``infergraft serve`` runs). A real spawned process on a saved tiny model: its outputs are
the in-process engine's; a full queue, a failed build and a dead process each say so."""
import asyncio
import os
import signal

import pytest
import safetensors.torch
import torch

from infergraft import core
from infergraft.core.errors import InfergraftError
from infergraft.core.serving.async_engine import QueueFullError
from infergraft.core.serving.engine_process import EngineProcess
from infergraft.core.testing.models import random_model, random_prompt, tiny_llama_config

GREEDY = core.SamplingParams(max_new_tokens=10, ignore_eos=True)
LONG = core.SamplingParams(max_new_tokens=80, ignore_eos=True)
OPTIONS = dict(max_seq_len=128, max_batch_size=2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    hf = random_model(tiny_llama_config(), seed=9, scale=5.0)
    hf.config.save_pretrained(path)
    safetensors.torch.save_model(hf, str(path / "model.safetensors"))
    return path


def _alone(engine, prompt, params=GREEDY) -> list[int]:
    seq = engine.add_request(prompt, params)
    while not seq.finished:
        engine.step()
    return seq.output_ids


async def _ids(aengine, prompt, params=GREEDY) -> tuple[list[int], str]:
    ids, reason = [], None
    async for out in aengine.generate(prompt, params):
        ids += out.token_ids
        reason = out.finish_reason
    return ids, reason


def test_outputs_equal_the_in_process_engine_and_it_exits_cleanly(model_dir):
    torch.set_num_threads(1)
    prompts = [random_prompt(n, 256, seed=n) for n in (4, 11, 29)]

    async def serve():
        aengine = EngineProcess.launch(str(model_dir), **OPTIONS)
        try:
            outs = await asyncio.gather(*[_ids(aengine, p) for p in prompts])
            stats = aengine.stats()
            return outs, stats, aengine.num_steps, aengine
        finally:
            await aengine.shutdown()

    outs, stats, steps, aengine = asyncio.run(serve())
    plain = core.build(str(model_dir), **OPTIONS)
    assert outs == [(_alone(plain, p), "length") for p in prompts]
    assert stats["generation_tokens_total"] == 30 and stats["requests_running"] == 0
    assert steps >= 10 and aengine.process.exitcode == 0


def test_a_full_queue_refuses_before_any_output_and_the_others_finish(model_dir):
    async def serve():
        aengine = EngineProcess.launch(str(model_dir), max_waiting=1, **OPTIONS)
        try:
            # two run (max_batch_size 2), then one waits; the fourth finds the queue full
            tasks = []
            for k, (key, count) in enumerate([("requests_running", 1), ("requests_running", 2),
                                              ("requests_waiting", 1)]):
                tasks.append(asyncio.create_task(
                    _ids(aengine, random_prompt(5, 256, seed=k), LONG)))
                while aengine.stats()[key] < count:
                    await asyncio.sleep(0.005)
            with pytest.raises(QueueFullError, match="max_waiting=1"):
                await _ids(aengine, random_prompt(5, 256, seed=7))
            return await asyncio.gather(*tasks)
        finally:
            await aengine.shutdown()

    assert [(len(ids), why) for ids, why in asyncio.run(serve())] == [(80, "length")] * 3


def test_what_the_build_raises_is_raised_in_the_server_process(tmp_path):
    with pytest.raises(InfergraftError) as err:
        EngineProcess.launch(str(tmp_path / "no-such-model"), **OPTIONS)
    assert "no-such-model" in str(err.value)


def test_a_dead_engine_process_ends_its_requests_with_error_and_refuses_new_ones(model_dir):
    async def serve():
        aengine = EngineProcess.launch(str(model_dir), **OPTIONS)
        gen = aengine.generate(random_prompt(5, 256, seed=1),
                               core.SamplingParams(max_new_tokens=120, ignore_eos=True))
        first = await gen.__anext__()
        os.kill(aengine.process.pid, signal.SIGKILL)
        rest = [out async for out in gen]
        with pytest.raises(QueueFullError, match="engine process exited"):
            await _ids(aengine, random_prompt(5, 256, seed=2))
        await aengine.shutdown()
        return first, rest

    first, rest = asyncio.run(serve())
    assert not first.finished and rest[-1].finished
    assert rest[-1].finish_reason == "error" and "exited" in rest[-1].error


def test_the_prompt_tokens_served_from_the_prefix_cache_cross_the_pipe(model_dir):
    prompt = random_prompt(40, 256, seed=40)  # 2 full blocks of 16, then 8 tokens

    async def serve():
        aengine = EngineProcess.launch(str(model_dir), plugins=["paged"], num_blocks=32,
                                       **OPTIONS)
        try:
            runs = []
            for _ in range(2):  # one after the other: the second finds the first's blocks
                runs.append([(out.num_cached_tokens, out.prompt_tokens)
                             async for out in aengine.generate(prompt, GREEDY)])
            return runs
        finally:
            await aengine.shutdown()

    first, second = asyncio.run(serve())
    assert set(first) == {(0, 40)} and set(second) == {(32, 40)}
