"""AsyncEngine under tp / pp on two gloo ranks: rank 0 serves concurrent asyncio requests
(one aborted midway) while rank 1 follows its steps; every request gets what a
single-process engine gives it, and the follower returns when rank 0 shuts down."""
import asyncio

import pytest

from infergraft.core.testing.distributed import run_ranks

PROMPTS = [[1, 5, 9, 33, 7, 80, 12], [1, 200, 3], [1, 17, 17, 4, 99], [1, 60, 61]]
KINDS = [dict(), dict(temperature=1.0, top_k=40, seed=11), dict(), dict(temperature=0.8, seed=5)]
CUT_AFTER = 4  # tokens the aborted request reads before it leaves


def serve_or_follow(cases: list) -> list:
    """On each rank, for each case (one set of ranks for all): rank 0 serves, others follow."""
    return [_serve_or_follow(**case) for case in cases]


def _serve_or_follow(plugins: list) -> dict:
    import torch.distributed as dist

    from infergraft import core
    from infergraft.core.serving.async_engine import AsyncEngine
    from infergraft.core.testing.models import random_model, tiny_llama_config

    hf = random_model(tiny_llama_config(), seed=3, scale=5.0)  # the same on every rank
    kw = dict(dtype="float32", device="cpu", max_seq_len=128, max_batch_size=8)
    engine = core.build(hf, plugins=plugins, **kw)
    if dist.get_rank() != 0:
        steps = AsyncEngine.follow(engine)
        return {"steps": steps, "sequences": engine.cache.stats()["sequences"],
                "unfinished": engine.scheduler.has_work()}
    planners = set(core.get_plugin_manager().planners().names())
    alone = core.build(hf, plugins=[p for p in plugins if p not in planners], **kw)
    want = [alone.generate(p, max_new_tokens=16, **k)[0].token_ids for p, k in zip(PROMPTS, KINDS)]
    long = core.SamplingParams(max_new_tokens=60, ignore_eos=True)
    want_long = alone.generate([1, 9, 8, 7], max_new_tokens=60)[0].token_ids

    async def collect(aengine, prompt, params):
        return [t async for out in aengine.generate(prompt, params) for t in out.token_ids]

    async def cut(aengine):
        got = []
        async for out in aengine.generate([1, 9, 8, 7], long):
            got += out.token_ids
            if len(got) >= CUT_AFTER:
                break  # the generator is closed: the request is aborted everywhere
        return got

    async def main():
        async with AsyncEngine(engine) as aengine:
            got = await asyncio.gather(cut(aengine), *(
                collect(aengine, p, core.SamplingParams(max_new_tokens=16, **k))
                for p, k in zip(PROMPTS, KINDS)))
            after = await collect(aengine, PROMPTS[0], core.SamplingParams(max_new_tokens=16))
        return got, after, aengine.num_steps

    (got_cut, *got), after, steps = asyncio.run(main())
    return {"got": got, "want": want, "after": after, "cut": got_cut, "want_long": want_long,
            "steps": steps, "sequences": engine.cache.stats()["sequences"]}


@pytest.fixture(scope="module")
def two_ranks():
    cases = [dict(plugins=["tp"]), dict(plugins=["pp", "paged"])]
    r0, r1 = run_ranks(serve_or_follow, 2, cases, timeout=300)
    return {c["plugins"][0]: (a, b) for c, a, b in zip(cases, r0, r1)}


@pytest.mark.parametrize("planner", ["tp", "pp"])
def test_rank_zero_serves_and_the_follower_keeps_step(two_ranks, planner):
    served, followed = two_ranks[planner]
    assert served["got"] == served["want"]  # as one process gives them, seeds included
    assert served["after"] == served["want"][0]
    cut = served["cut"]
    assert CUT_AFTER <= len(cut) < 60 and cut == served["want_long"][:len(cut)]
    # the same steps on both ranks (else their collectives would not have matched), and
    # both freed everything
    assert followed["steps"] == served["steps"] > 0
    assert served["sequences"] == followed["sequences"] == 0 and not followed["unfinished"]
