"""The paged pool sized to the memory budget (core/budget.py, plugins/block_allocator.py):
on CUDA what ``gpu_memory_utilization`` of the budget leaves beside the weights and the
activations, at most what max_batch_size sequences hold; on the CPU that most unless it
does not fit the budget; ``num_blocks`` over both; PlanError below one sequence."""
import json
from types import SimpleNamespace

import attrs
import pytest

from infergraft import core
from infergraft.core.budget import default_blocks, pool_blocks
from infergraft.core.cli import main
from infergraft.core.errors import PlanError
from infergraft.core.testing.models import random_model, tiny_llama_config
from infergraft.core.units import fmt_bytes
from infergraft.plugins.block_allocator import cache_sizes
from infergraft.plugins.paged import PagedBackend

KVBPT = 2 * 2 * 2 * 16 * 4  # tiny LLaMA: K and V, 2 layers, 2 kv heads, 16 dims, float32
KW = dict(plugins=["paged"], max_seq_len=256, max_batch_size=4, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def hf():
    return random_model(tiny_llama_config(max_position_embeddings=8192), seed=0)


def _blocks(engine) -> int:
    return engine.cache.stats()["blocks_total"]


def _held(plan) -> int:
    return plan.weight_bytes + plan.activation_bytes


def test_the_default_cpu_pool_is_unchanged_where_it_fits(hf):
    engine = core.build(hf, **KW)
    assert _blocks(engine) == 4 * 256 // 16 and engine.plan.memory_budget is not None
    # a budget the default pool just fits (above 0.9 of it): still the default on the CPU
    exact = _held(engine.plan) + 64 * 16 * KVBPT
    assert _blocks(core.build(hf, device_memory=exact, **KW)) == 64


def test_a_small_cpu_budget_shrinks_the_pool_instead_of_refusing(hf):
    plan = core.build(hf, **KW).plan
    budget = _held(plan) + 40 * 16 * KVBPT  # 40 blocks: less than the default 64
    engine = core.build(hf, device_memory=budget, **KW)
    assert _blocks(engine) == (int(budget * 0.9) - _held(plan)) // (16 * KVBPT) < 40
    assert engine.plan.memory_budget == budget and "memory budget" in str(engine.plan)
    done = engine.generate([list(range(3, 40))] * 6, max_new_tokens=4)  # 6 > 4 slots
    assert all(len(c.token_ids) == 4 for c in done)
    # a larger utilisation keeps more of it
    assert _blocks(core.build(hf, device_memory=budget, gpu_memory_utilization=1.0, **KW)) == 40


def test_a_budget_below_one_sequence_is_refused_with_the_numbers(hf):
    plan = core.build(hf, **KW).plan
    budget = _held(plan) + 10 * 16 * KVBPT  # one 256-token sequence is 16 blocks
    with pytest.raises(PlanError) as e:
        core.build(hf, device_memory=budget, **KW)
    msg = str(e.value)
    assert "paged: the K/V pool cannot hold one max_seq_len=256 sequence (16 blocks of 16" in msg
    assert f"gpu_memory_utilization 0.9 x the budget {fmt_bytes(budget)}" in msg
    assert f"weights on the device {fmt_bytes(plan.weight_bytes)}" in msg
    assert f"activations {fmt_bytes(plan.activation_bytes)} (64-token steps)" in msg
    assert "Lower max_seq_len" in msg and "raise gpu_memory_utilization or device_memory" in msg
    with pytest.raises(PlanError, match="leaves nothing"):  # the weights alone fill it
        core.build(hf, device_memory=plan.weight_bytes, **KW)


@pytest.mark.parametrize("value", [0, -0.1, 1.5, float("nan"), True, "0.9", None])
def test_utilisation_out_of_range_is_refused(hf, value):
    with pytest.raises(PlanError, match=r"paged: gpu_memory_utilization must be a number in "
                                        r"\(0, 1\] .*got " + repr(value).replace("(", r"\(")):
        core.build(hf, gpu_memory_utilization=value, **KW)


def test_num_blocks_overrides_the_budget(hf):
    plan = core.build(hf, **KW).plan
    budget = _held(plan) + 40 * 16 * KVBPT
    assert _blocks(core.build(hf, device_memory=budget, num_blocks=40, **KW)) == 40
    assert _blocks(core.build(hf, num_blocks=100, **KW)) == 100  # more than the default
    with pytest.raises(PlanError, match="does not fit"):  # and the memory check still counts it
        core.build(hf, device_memory=budget, num_blocks=41, **KW)


def _fake_plan(device="cuda:0", **kw):
    GiB = 2**30
    fields = dict(device=device, max_seq_len=8192, max_batch_size=192, sliding_window=None,
                  kv_bytes_per_token=128 * 1024, device_weight_bytes=15 * GiB,
                  activation_bytes=GiB // 2, memory_budget=139 * GiB, pool_tokens=None,
                  max_num_batched_tokens=2048)
    return SimpleNamespace(**{**fields, **kw})


def test_the_cuda_pool_is_what_the_budget_leaves_at_most_the_default():
    GiB = 2**30
    plan = _fake_plan()
    room = (int(139 * GiB * 0.9) - 15 * GiB - GiB // 2) // (16 * 128 * 1024)
    assert default_blocks(plan, 16) == 192 * 512 > room
    assert cache_sizes(plan, 16, None, "paged", 0.9) == (16, room)
    assert pool_blocks(plan, plan.memory_budget, 16, 0.9, cuda=True) == room
    assert PagedBackend().device_bytes(plan) == room * 16 * 128 * 1024
    # a short max_seq_len: the default pool, 192 x 2048 tokens, is what the room allows
    short = _fake_plan(max_seq_len=2048)
    assert cache_sizes(short, 16, None, "paged", 0.9) == (16, 192 * 128)
    # the CUDA rule keeps the 10% headroom where the CPU keeps a default that fits
    snug = 15 * GiB + GiB // 2 + 192 * 128 * 16 * 128 * 1024
    cuda = _fake_plan(max_seq_len=2048, memory_budget=snug)
    assert cache_sizes(cuda, 16, None, "paged", 0.9)[1] < 192 * 128
    cpu = _fake_plan(device="cpu", max_seq_len=2048, memory_budget=snug)
    assert cache_sizes(cpu, 16, None, "paged", 0.9) == (16, 192 * 128)
    # another rank's smaller pool caps this one's; no budget or no utilisation: the default
    assert cache_sizes(_fake_plan(pool_tokens=16 * 1000 + 5), 16, None, "paged", 0.9)[1] == 1000
    assert cache_sizes(_fake_plan(memory_budget=None), 16, None, "paged", 0.9)[1] == 192 * 512
    assert cache_sizes(plan, 16, None, "offload")[1] == 192 * 512


def test_every_rank_makes_the_pool_of_the_smallest(hf, monkeypatch):
    import torch

    from infergraft.core.build import _same_pool
    from infergraft.core.plan import ParallelPlan

    gathered = [16 * 40, 16 * 64]  # rank 0's pool is smaller than this one's
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)
    monkeypatch.setattr(torch.distributed, "all_gather_object",
                        lambda out, obj: out.__setitem__(slice(None), gathered))
    two = ParallelPlan(world_size=2, tensor_parallel=2)
    plan = attrs.evolve(core.build(hf, **KW).plan, memory_budget=10**9)
    capped = _same_pool(plan, 16 * 64 * KVBPT, two)
    assert capped.pool_tokens == 16 * 40 and "at most 640 tokens" in str(capped)
    assert cache_sizes(plan, 16, None, "paged", 0.9) == (16, 64)
    assert cache_sizes(capped, 16, None, "paged", 0.9) == (16, 40)
    gathered[:] = [16 * 64, 16 * 64]  # all the same: nothing to cut
    assert _same_pool(plan, 0, two) is plan
    assert _same_pool(plan, 0, ParallelPlan()) is plan  # one process: no collective


def test_a_long_max_seq_len_builds_in_a_small_budget_and_decodes_the_same(hf):
    prompts = [list(range(3, 3 + n)) for n in (5, 40, 90)]
    want = core.build(hf, plugins=["paged"]).generate(prompts, max_new_tokens=8)
    kw = dict(plugins=["paged"], max_seq_len=8192, max_batch_size=64, max_num_batched_tokens=64)
    plan = core.build(hf, num_blocks=512, **kw).plan
    # room for 3 sequences of 8192 tokens, where 64 would take 256 MiB
    budget = int((_held(plan) + 3 * 8192 * KVBPT) / 0.9) + 1
    engine = core.build(hf, device_memory=budget, **kw)
    assert 3 * 512 <= _blocks(engine) < 4 * 512 and plan.kv_bytes_total > budget
    got = engine.generate(prompts, max_new_tokens=8)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]


def test_plan_prints_the_pool_and_the_sequences_it_holds(tmp_path, capsys):
    tiny_llama_config().save_pretrained(tmp_path)
    args = ["plan", str(tmp_path), "--max-seq-len", "512", "--max-batch-size", "8",
            "--max-num-batched-tokens", "64"]
    assert main(args + ["--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    held = got["weight_bytes"] + got["activation_bytes"]
    budget = held + 70 * 16 * KVBPT
    # exit 1: 8 x 512 tokens do not fit (the contiguous plan); the pool sized to it does
    assert main(args + ["--device-memory", str(budget), "--seq-len", "100", "--seq-len", "512",
                        "--json"]) == 1
    pool = json.loads(capsys.readouterr().out)["pool"]
    blocks = (int(budget * 0.9) - held) // (16 * KVBPT)
    assert pool["blocks"] == blocks and pool["tokens"] == 16 * blocks
    assert pool["sequences"] == {"100": blocks // 7, "512": blocks // 32}
    assert pool["block_size"] == 16 and pool["gpu_memory_utilization"] == 0.9
    assert main(args + ["--device-memory", str(budget), "--gpu-memory-utilization", "1"]) == 1
    rows = dict(line.split("  ", 1) for line in capsys.readouterr().out.splitlines())
    assert rows["K/V pool (paged)"].strip().startswith("70 blocks of 16 tokens = 1120 tokens")
    assert rows["512-token sequences in the pool"].strip() == "2"
    assert rows["fits"].strip() == "NO"
    # a roomy budget: the pool stops at max_batch_size sequences
    assert main(args + ["--device-memory", "1GiB", "--seq-len", "16"]) == 0
    rows = dict(line.split("  ", 1) for line in capsys.readouterr().out.splitlines())
    assert rows["16-token sequences in the pool"].strip() == "256 (8 at once: max_batch_size)"
    for bad, why in ((["--seq-len", "513"], "--seq-len 513 is longer than max_seq_len=512"),
                     (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization must be a "
                                                         "number in (0, 1]")):
        assert main(args + bad) == 2
        assert why in capsys.readouterr().err
