"""core/tools/step_census.py: every step of a run classed (prefill-only, mixed,
decode-only) by the rows and tokens it fed, timed, set against its floor; the classes'
and the outside's shares of the run's wall add up to it. On the CPU with the tiny shape,
through ``bench throughput --step-census`` and through a look-ahead engine."""
import json

import pytest
import torch

from infergraft import core
from infergraft.core.cli import main as cli_main
from infergraft.core.request import SamplingParams
from infergraft.core.runner.cuda_graph import CudaGraphRunner
from infergraft.core.testing.models import random_model, random_prompt, tiny_llama_config
from infergraft.core.tools.step_census import CLASSES, StepCensus
from infergraft.core.tools.step_floors import StepFloors

# 6 prompts of 12 tokens, 5 out each, 30-token steps: (1) p1, p2 and 6 of p3 (2) p1, p2
# decode, the rest of p3, p4, 10 of p5 (3) four decode, the rest of p5, p6 (4-7) decode
# only: all six, then p1 and p2 done after step 5, p3 and p4 after step 6
KINDS = ["prefill-only", "mixed", "mixed"] + ["decode-only"] * 4
ROWS = [3, 5, 6, 6, 6, 4, 2]
PROMPT_TOKENS = [30, 6 + 12 + 10, 2 + 12, 0, 0, 0, 0]
TOKENS = [30, 2 + 28, 4 + 14, 6, 6, 4, 2]


def test_bench_throughput_classes_every_step_and_the_shares_add_up_to_the_wall(
        tmp_path, capsys):
    rc = cli_main(["bench", "throughput", "--model", "tiny", "--device", "cpu",
                   "--dataset", "fixed", "--num-prompts", "6", "--prompt-len", "12",
                   "--output-len", "5", "--max-num-batched-tokens", "30", "--no-hf",
                   "--step-census", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    census = json.loads((tmp_path / "throughput.json").read_text())["infergraft"]["step_census"]
    steps, classes = census["steps"], census["classes"]
    assert steps["kind"] == KINDS and steps["rows"] == ROWS
    assert steps["prompt_tokens"] == PROMPT_TOKENS and steps["tokens"] == TOKENS
    for kind, n, prompt, decode in [("prefill-only", 1, 30, 0), ("mixed", 2, 42, 6),
                                    ("decode-only", 4, 0, 18)]:
        c = classes[kind]
        assert (c["steps"], c["prompt_tokens"], c["decode_tokens"]) == (n, prompt, decode)
        mine = [i for i, k in enumerate(KINDS) if k == kind]
        assert c["wall_s"] == pytest.approx(sum(steps["wall_ms"][i] for i in mine) / 1e3)
        assert c["wall_share"] == pytest.approx(c["wall_s"] / census["wall_s"])
        assert c["floor_s"] == pytest.approx(sum(steps["floor_ms"][i] for i in mine) / 1e3)
        assert 0 < c["floor_s"] and 0 < c["device_s"] <= c["wall_s"]
    # the tail: decode-only steps of fewer rows than half the batch (3): the last one
    tail = classes["decode-only"]["tail"]
    assert (tail["below_rows"], tail["steps"], tail["decode_tokens"]) == (3, 1, 2)
    assert tail["wall_s"] == pytest.approx(steps["wall_ms"][-1] / 1e3)
    outside = classes["outside steps"]
    assert sum(c["wall_share"] for c in classes.values()) == pytest.approx(1.0)
    assert 0 <= outside["wall_s"] < 0.5 * census["wall_s"]  # the loop around the steps
    assert sum(classes[k]["sampled"] for k in CLASSES) == 6 * 5  # the first token, then 4
    for gpu, wall in zip(steps["gpu_ms"], steps["wall_ms"]):
        assert 0 < gpu <= wall  # the forward, within the step's call
    # the run's wall is the summary's duration, give or take the loop's first lines
    duration = json.loads((tmp_path / "throughput.json").read_text())["infergraft"]["duration_s"]
    assert census["wall_s"] == pytest.approx(duration, rel=0.05)
    table = out[out.index("(--step-census):"):]
    assert [line.split()[:2] for line in table.splitlines()[2:6]] == [
        ["prefill-only", "1"], ["mixed", "2"], ["decode-only", "4"], ["<", "3"]]
    assert "outside steps" in table and "\nrun " in table


def test_look_ahead_decode_steps_are_each_counted_once_with_their_own_launch():
    """Greedy decode launched a step ahead (the CUDA-graph runner's buffers, eager on the
    CPU): a step read in one call was launched in the one before; every token fed is in
    exactly one step, and every step has the timing of its own launch."""
    hf = random_model(tiny_llama_config(), seed=5, scale=5.0)
    engine = core.build(hf, max_seq_len=96, max_batch_size=4, max_num_batched_tokens=64)
    engine.cache.device_decode = True
    runner = CudaGraphRunner(engine.model, engine.cache, 4, buckets=(2,), use_graphs=False)
    runner.capture()
    engine.decode_graphs = runner
    prompts = [random_prompt(n, hf.config.vocab_size, n) for n in (5, 13, 9)]
    news = [9, 4, 7]
    census = StepCensus(engine)
    for p, n in zip(prompts, news):
        engine.add_request(p, SamplingParams(max_new_tokens=n))
    ahead = []
    while engine.has_unfinished():
        ahead.append(engine.lookahead.inflight is not None)
        engine.step()
    census.stop()
    assert any(ahead), "no step was read after being launched ahead"
    assert "step" not in vars(engine) and "launch" not in vars(runner)  # put back
    steps = census.steps
    assert [s.kind for s in steps] == ["prefill-only"] + ["decode-only"] * (max(news) - 1)
    assert sum(s.tokens for s in steps) == sum(len(p) + n - 1 for p, n in zip(prompts, news))
    assert sum(s.sampled for s in steps) == sum(news)
    # each decode step's rows: the requests still short of their tokens, at their positions
    for i, s in enumerate(steps[1:], start=1):
        live = [(len(p) + i - 1, 1) for p, n in zip(prompts, news) if n > i]
        assert s.spans == live
    assert all(isinstance(d, float) and d > 0 for d in census.device_s())
    summary = census.summary(StepFloors.of(engine, 1e11, 1e10))
    assert summary["classes"]["decode-only"]["steps"] == max(news) - 1
    assert sum(c["wall_share"] for c in summary["classes"].values()) == pytest.approx(1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_graph_steps_get_their_gpu_time_from_events(tmp_path, capsys):
    """The paged cache's graphs: mixed steps replayed, decode steps launched ahead; the
    same classes as on the CPU, every step with its GPU time below its wall."""
    rc = cli_main(["bench", "throughput", "--model", "tiny", "--device", "cuda",
                   "--dataset", "fixed", "--num-prompts", "6", "--prompt-len", "12",
                   "--output-len", "5", "--max-num-batched-tokens", "30", "--no-hf",
                   "--step-census", "--out", str(tmp_path)])
    assert rc == 0, capsys.readouterr().out
    data = json.loads((tmp_path / "throughput.json").read_text())["infergraft"]
    census = data["step_census"]
    steps = census["steps"]
    assert steps["kind"] == KINDS and steps["rows"] == ROWS and steps["tokens"] == TOKENS
    assert all(g is not None and 0 < g for g in steps["gpu_ms"])
    # the GPU runs the steps one after another within the run (a look-ahead step's time
    # may reach into the call before its own: not each step within its call's wall)
    assert sum(steps["gpu_ms"]) / 1e3 < census["wall_s"]
    assert sum(c["wall_share"] for c in census["classes"].values()) == pytest.approx(1.0)
    assert data["device"]["decode_graph_replays"] >= 3  # the look-ahead's, timed too
