"""`infergraft bench throughput` on the CPU with the tiny random shape: one run measures our
engine and HF's continuous batching on the same requests beside the compute floor, and
writes the table and JSON; each dataset draws its lengths; the floor's FLOPs against
torch's own counter; bad flags refused before any model is built."""
import importlib.util
import json
import re

import pytest
import torch
from cli_support import assert_flag_refused

from infergraft.core.cli import main as cli_main
from infergraft.core.tools import bench_throughput
from infergraft.core.tools.bench_cli import SHAPES
from infergraft.core.tools.serve_workload import FIRST_ID, make_requests
from infergraft.core.tools.throughput_report import workload_flops

HAS_MPL = importlib.util.find_spec("matplotlib") is not None
TINY_VOCAB = SHAPES["tiny"]["vocab_size"]
PERCENTILED = ("ttft_ms", "tpot_ms", "itl_ms")


def _ordered(summary: dict) -> None:
    for key in PERCENTILED:
        s = summary[key]
        assert 0 < s["p50"] <= s["p90"] <= s["p99"], (key, s)


# 1) Whole runs
def test_a_run_measures_ours_and_hf_on_the_same_requests_beside_the_floor(tmp_path, capsys):
    rc = cli_main(["bench", "throughput", "--model", "tiny", "--device", "cpu",
                   "--dataset", "uniform", "--num-prompts", "6", "--prompt-len", "12",
                   "--output-len", "6", "--seed", "3", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    for row in ("Throughput Benchmark Result", "infergraft", "HF CB", "compute floor",
                "Output token throughput (tok/s)", "Total token throughput (tok/s)",
                "Request throughput (req/s)", "P90 TTFT (ms)", "P99 TPOT (ms)",
                "P50 ITL (ms)", "Output tok/s / compute floor", "engine steps:"):
        assert row in out, row
    data = json.loads((tmp_path / "throughput.json").read_text())
    requests = make_requests("uniform", 6, 12, 6, TINY_VOCAB, seed=3)
    lens = [r.output_len for r in requests]
    assert len(set(lens)) > 1  # mixed output lengths: HF runs each to its own
    prompt_tokens = sum(len(r.prompt) for r in requests)
    for name in ("infergraft", "hf"):
        s = data[name]
        assert (s["completed"], s["failed"]) == (6, 0), (name, s["first_error"])
        assert s["total_output_tokens"] == sum(lens) and s["total_input_tokens"] == prompt_tokens
        assert s["output_throughput"] == pytest.approx(sum(lens) / s["duration_s"])
        assert s["total_token_throughput"] == pytest.approx(
            (sum(lens) + prompt_tokens) / s["duration_s"])
        _ordered(s)
    floor = data["floor"]
    assert floor["matmul_flops_per_s"] > 0 and floor["output_throughput"] > 0
    spec_flops = floor["flops"]
    assert spec_flops["total"] == sum(v for k, v in spec_flops.items() if k != "total") > 0
    assert floor["duration_s"] == pytest.approx(spec_flops["total"] / floor["matmul_flops_per_s"])
    assert floor["output_throughput"] == pytest.approx(sum(lens) / floor["duration_s"])
    for name in ("infergraft", "hf"):
        assert data[name]["over_floor"] == pytest.approx(
            data[name]["output_throughput"] / floor["output_throughput"])
    # ours: one step with every prompt, then decode steps to the longest output
    steps = data["infergraft"]["engine"]
    assert steps["num_prefill_steps"] == 1 and steps["num_steps"] == max(lens)
    assert "step_census" not in data["infergraft"]  # off unless asked (--step-census)
    assert data["engine_config"]["max_batch_size"] == 6  # every request in one batch
    assert data["engine_config"]["max_seq_len"] == max(len(r.prompt) + r.output_len
                                                       for r in requests)
    assert data["args"]["dataset"] == "uniform" and data["args"]["dtype"] == "torch.float32"
    assert data["commit"] and len(data["switches"]) >= 10
    assert (tmp_path / "throughput.png").exists() == HAS_MPL
    assert ("no throughput.png" in out) != HAS_MPL


def test_ours_stands_when_hf_fails_and_no_hf_leaves_it_out(tmp_path, capsys, monkeypatch):
    def broken(model, requests):
        raise RuntimeError("paged attention is not supported")
    monkeypatch.setattr(bench_throughput, "hf_summary", broken)
    args = ["--model", "tiny", "--device", "cpu", "--num-prompts", "4", "--prompt-len", "8",
            "--output-len", "5"]
    assert bench_throughput.main(args + ["--out", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert "HF continuous batching failed: RuntimeError: paged attention" in out
    assert "HF CB" not in out
    data = json.loads((tmp_path / "a" / "throughput.json").read_text())
    assert data["hf"] == {"error": "RuntimeError: paged attention is not supported"}
    ours = data["infergraft"]
    assert ours["completed"] == 4 and ours["total_output_tokens"] == 4 * 5
    _ordered(ours)
    assert ours["engine"]["num_steps"] == 5  # fixed: one prefill, four decode steps

    monkeypatch.setattr(bench_throughput, "hf_summary", lambda *a: pytest.fail("HF ran"))
    assert bench_throughput.main(args + ["--no-hf", "--out", str(tmp_path / "b")]) == 0
    assert "HF CB" not in capsys.readouterr().out
    data = json.loads((tmp_path / "b" / "throughput.json").read_text())
    assert data["hf"] is None and data["infergraft"]["total_output_tokens"] == 20


def test_a_budget_sweep_runs_ours_once_per_budget_and_hf_on_the_first_requests(tmp_path,
                                                                              capsys):
    rc = cli_main(["bench", "throughput", "--model", "tiny", "--device", "cpu",
                   "--num-prompts", "4", "--prompt-len", "10", "--output-len", "3",
                   "--max-num-batched-tokens", "8,64", "--hf-num-prompts", "2",
                   "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "infergraft (8 tok)" in out and "infergraft (64 tok)" in out
    assert "HF CB (first 2)" in out
    runs = json.loads((tmp_path / "throughput.json").read_text())["runs"]
    small, large = runs["infergraft (8 tok)"], runs["infergraft (64 tok)"]
    assert small["engine_config"]["max_num_batched_tokens"] == 8
    assert large["engine_config"]["max_num_batched_tokens"] == 64
    for s in (small, large):
        assert s["completed"] == 4 and s["total_output_tokens"] == 12
    # 40 prompt tokens: 8 a step (decode tokens included) take more steps than one of 64
    assert large["engine"]["num_prefill_steps"] == 1
    assert small["engine"]["num_prefill_steps"] >= 5 > large["engine"]["num_steps"] - 2
    hf = runs["HF CB (first 2)"]
    assert hf["completed"] == 2 and hf["num_prompts"] == 2 and hf["total_output_tokens"] == 6


def test_compare_plugins_runs_each_set_on_the_same_requests(tmp_path, capsys):
    """--compare-plugins: after the base run, our engine again with each set added to
    --plugins, on the same requests; each set's summary under "variants", the keys of a
    run without it unchanged."""
    rc = cli_main(["bench", "throughput", "--model", "tiny", "--device", "cpu",
                   "--num-prompts", "3", "--prompt-len", "8", "--output-len", "3",
                   "--plugins", "kv-int8", "--compare-plugins", "int8,int4", "--no-hf",
                   "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert rc == 0, captured.out
    for name in ("infergraft+int8", "infergraft+int4", "Output tok/s / infergraft"):
        assert name in captured.out, name
    for added in ("int8", "int4"):  # each build's own plan, logged before its run
        plan = captured.err.split(f"infergraft+{added}:\n")[1]
        assert re.search(r"quantizers +(.*)\n", plan)[1] == f"kv-int8, {added}"
    data = json.loads((tmp_path / "throughput.json").read_text())
    base = data["infergraft"]
    assert list(data["runs"]) == ["infergraft"] and data["hf"] is None
    assert data["args"]["compare_plugins"] == [["int8"], ["int4"]]
    variants = data["variants"]
    assert [(v["name"], v["plugins"], v["build_plugins"]) for v in variants] == [
        ("infergraft+int8", ["int8"], ["kv-int8", "int8"]),
        ("infergraft+int4", ["int4"], ["kv-int8", "int4"])]
    for v in variants:
        assert (v["completed"], v["failed"]) == (base["completed"], 0) == (3, 0)
        for key in ("total_input_tokens", "total_output_tokens"):
            assert v[key] == base[key]
        assert v["output_throughput"] > 0 and v["engine"]["num_steps"] == 3
        assert v["output_throughput_vs_base"] == pytest.approx(
            v["output_throughput"] / base["output_throughput"])
        assert v["over_floor"] == pytest.approx(
            v["output_throughput"] / data["floor"]["output_throughput"])
        _ordered(v)


# 2) The workload and the floor, without a run
def _resolved(*flags):
    p = bench_throughput.argparse.ArgumentParser()
    bench_throughput.add_arguments(p)
    return bench_throughput.resolve(p.parse_args(["--model", "tiny", "--device", "cpu",
                                                  *flags]))


def test_each_dataset_draws_its_lengths_below_the_models_vocabulary():
    fixed = _resolved("--num-prompts", "5", "--prompt-len", "9", "--output-len", "4")
    assert [(len(r.prompt), r.output_len) for r in fixed.requests] == [(9, 4)] * 5
    assert (fixed.max_seq_len, fixed.max_batch_size) == (13, 5)
    uniform = _resolved("--dataset", "uniform", "--num-prompts", "300", "--prompt-len", "40",
                        "--output-len", "20").requests
    prompts, outputs = [len(r.prompt) for r in uniform], [r.output_len for r in uniform]
    assert (min(prompts), max(prompts)) == (10, 70) and (min(outputs), max(outputs)) == (5, 35)
    share = _resolved("--dataset", "sharegpt-like", "--num-prompts", "300")
    assert share.prompt_len == 161 and share.output_len == 338  # the dataset's defaults
    assert share.max_batch_size == 256  # the default batch's cap
    for lens, mean in (([len(r.prompt) for r in share.requests], 161),
                       ([r.output_len for r in share.requests], 338)):
        assert min(lens) >= 4 and max(lens) <= 4 * mean and max(lens) > 2 * mean
    prefix = _resolved("--dataset", "prefix", "--num-prompts", "20", "--output-len", "3")
    shared = prefix.requests[0].prompt[:1024]
    assert all(r.prompt[:1024] == shared and 64 <= len(r.prompt) - 1024 <= 256
               and r.output_len == 3 for r in prefix.requests)
    ids = [t for a in (fixed, prefix) for r in a.requests for t in r.prompt]
    assert FIRST_ID <= min(ids) and max(ids) < TINY_VOCAB  # tiny's vocabulary, not 32000
    assert _resolved("--seed", "1").requests != _resolved("--seed", "2").requests


def test_floor_flops_match_torchs_counter_on_the_hf_model():
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(**SHAPES["tiny"], rms_norm_eps=1e-5, tie_word_embeddings=False)
    hf = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    # one request of T prompt tokens and one output token: T rows through the layers, one
    # through the LM head; HF's eager attention computes the whole T x T square
    t = 20
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        hf(torch.arange(FIRST_ID, FIRST_ID + t)[None], logits_to_keep=1)
    counted = counter.get_flop_counts()["Global"]
    spec = _spec(hf)
    f = workload_flops(spec, make_requests("fixed", 1, t, 1, TINY_VOCAB))
    # mm: the projections and the LM head (and RoPE's 2 x 16 x T angle product)
    assert counted[torch.ops.aten.mm] == pytest.approx(f["matmul"] + f["lm_head"], rel=1e-4)
    square = counted[torch.ops.aten.bmm]
    assert square == 4 * spec.num_layers * spec.q_size * t * t
    assert f["attention"] == square * (t + 1) // (2 * t)  # the causal triangle of it
    windowed = workload_flops(_spec(hf, sliding_window=8),
                              make_requests("fixed", 1, t, 1, TINY_VOCAB))
    keys = sum(min(i + 1, 8) for i in range(t))
    assert windowed["attention"] == 4 * spec.num_layers * spec.q_size * keys


def _spec(hf, **changes):
    import attrs

    from infergraft.core.build import build

    return attrs.evolve(build(hf, device="cpu", max_seq_len=32, max_batch_size=1).spec,
                        **changes)


# 3) Bad flags
BAD_FLAGS = [  # (flags over a good tiny run, what the message must say)
    (["--num-prompts", "0"], "positive integer"),
    (["--dataset", "alpaca"], "sharegpt-like"),
    (["--prompt-len", "0"], "positive integer"),
    (["--output-len", "x"], "positive integer"),
    (["--max-batch-size", "0"], "positive integer"),
    (["--max-num-batched-tokens", "-1"], "positive integer"),
    (["--max-seq-len", "20"], "at least 24"),  # 16 + 8
    (["--dtype", "foo"], "float32, bfloat16 or float16"),
    (["--device", "bogus"], "not a device name"),
    (["--model", "nonexist"], "tiny"),
    (["--plugins", "foo"], "unknown plugin"),
    (["--seed", "a"], "invalid int"),
    (["--out", "/dev/null/x"], "not a writable directory"),
    (["--max-num-batched-tokens", "64,64"], "distinct positive integers"),
    (["--hf-num-prompts", "0"], "positive integer"),
    (["--step-gaps"], "needs --device cuda"),
    (["--compare-plugins", "int8,+"], "distinct plugin sets"),
    (["--compare-plugins", "int8,int8"], "distinct plugin sets"),
    (["--compare-plugins", "nope"], "unknown plugin"),
    # a second weight quantiser: over --plugins, or within one set
    (["--compare-plugins", "kv-int8,int4", "--plugins", "int8"],
     "two weights quantizers, 'int8' and 'int4'"),
    (["--compare-plugins", "int8+fp8"], "two weights quantizers, 'int8' and 'fp8'"),
    (["--compare-plugins", "int8", "--max-num-batched-tokens", "8,64"],
     "with the --max-num-batched-tokens sweep 8,64"),
]


@pytest.mark.parametrize("entry", ["bench_throughput", "infergraft"])
@pytest.mark.parametrize("flags, says", BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_a_bad_flag_is_refused_before_any_model_is_built(flags, says, entry, tmp_path, capsys,
                                                         monkeypatch):
    def never(*args, **kw):
        pytest.fail("a model was built or timed for a bad flag")
    monkeypatch.setattr(bench_throughput, "load_models", never)
    monkeypatch.setattr(bench_throughput, "matmul_rate", never)
    argv = ["--model", "tiny", "--device", "cpu", "--num-prompts", "2", "--prompt-len", "16",
            "--output-len", "8", "--out", str(tmp_path / "o")] + flags
    call = bench_throughput.main if entry == "bench_throughput" else \
        lambda a: cli_main(["bench", "throughput"] + a)
    assert_flag_refused(call, argv, flags[0], says, capsys, tmp_path / "o")


def test_help_lists_every_flag(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["bench", "throughput", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--model", "--num-prompts", "--dataset", "--prompt-len", "--output-len",
                 "--out", "--max-batch-size", "--max-num-batched-tokens", "--max-seq-len",
                 "--dtype", "--device", "--plugins", "--no-hf", "--seed", "--hf-num-prompts",
                 "--step-gaps", "--step-census", "--compare-plugins", "--compare-options", "--num-blocks",
                 "--block-size", "--gpu-memory-utilization", "--preemption", "--check-alone"):
        assert flag in out, flag


def test_the_gpu_busy_row_is_the_timed_steps_share_of_the_runs_wall_time():
    from infergraft.core.tools.throughput_report import gpu_busy_share, table
    timed = {"duration_s": 2.0, "output_throughput": 10.0,
             "step_gaps": {"busy_ms_total": 1900.0, "steps": 40}}
    untimed = {"duration_s": 2.0, "output_throughput": 10.0}
    assert gpu_busy_share(timed) == pytest.approx(0.95)
    assert gpu_busy_share(untimed) is None
    floor = {"duration_s": 1.0, "request_throughput": 1.0, "output_throughput": 20.0,
             "total_token_throughput": 30.0, "flops": {"total": 1, "matmul": 1, "lm_head": 0,
                                                         "attention": 0},
             "matmul_flops_per_s": 1.0, "rate_measured": "test"}
    row = next(line for line in table({"ours": timed, "HF CB": untimed}, floor).splitlines()
               if line.startswith("GPU busy / duration"))
    assert row.split()[-3:] == ["95.0%", "-", "-"]

