"""`infergraft bench` end to end on the CPU with the small random shape: one run measures
our engine, HF on the same weights and the copy-bandwidth roofline, and writes the table
and JSON (the GPU figures in docs/BENCHMARKS.md come from the same code)."""
import json
import subprocess
from pathlib import Path

import pytest
import torch

from infergraft.core.tools.bench_cli import main
from infergraft.core.cli import main as cli_main
from infergraft.core.errors import PlanError


def test_bench_tiny_shape_writes_table_and_json(tmp_path, capsys):
    rc = main(["--model", "tiny", "--device", "cpu", "--batches", "1,2", "--prompt-len", "8",
               "--new-tokens", "6", "--systems", "infergraft,hf-eager", "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "| batch | infergraft TPOT ms | hf-eager TPOT ms" in out
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["model"] == "tiny" and data["copy_bandwidth_Bps"] > 0
    rows = {(r["system"], r["batch"]) for r in data["results"]}
    assert rows == {(s, b) for s in ("infergraft", "hf-eager") for b in (1, 2)}
    for r in data["results"]:
        assert r["tpot_ms"] > 0 and r["ttft_ms"] > 0
        # the floor is bytes / bandwidth: the same for both systems, larger with the batch
        assert 0 < r["roofline_ms"]
    floor = {r["batch"]: r["roofline_ms"] for r in data["results"]}
    assert floor[2] > floor[1]
    for r in data["results"]:  # the step times' spread beside their median
        assert r["tpot_p99_ms"] >= r["tpot_p90_ms"] > 0
        assert r["roofline_fraction"] == pytest.approx(r["roofline_ms"] / r["tpot_ms"])


def test_bench_json_records_the_commit_and_every_switch(tmp_path, capsys, monkeypatch):
    from infergraft.kernels import switches

    monkeypatch.setenv("INFERGRAFT_FUSE", "0")  # read at each build: the file must say so
    monkeypatch.delenv("INFERGRAFT_COMMIT", raising=False)
    assert main(["--model", "tiny", "--device", "cpu", "--batches", "1", "--prompt-len", "8",
                 "--new-tokens", "4", "--systems", "infergraft", "--out", str(tmp_path)]) == 0
    capsys.readouterr()
    data = json.loads((tmp_path / "results.json").read_text())
    described = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                               text=True, cwd=Path(__file__).parent).stdout.strip()
    assert data["commit"] == (described or f"infergraft {data['versions']['infergraft']}")
    assert set(data["switches"]) == set(switches.SWITCHES) and len(data["switches"]) >= 10
    assert data["switches"]["INFERGRAFT_FUSE"] in (0, False)
    assert data["versions"]["torch"] == torch.__version__.split("+")[0] or \
        data["versions"]["torch"] == torch.__version__


def test_bench_refuses_a_batch_that_never_decodes_whole(tmp_path, capsys):
    # 4 prompts of 8 tokens, one admitted a step: the first ends (3 tokens) before the
    # last starts; a step that takes all four prompts times it
    args = ["--model", "tiny", "--device", "cpu", "--batches", "4", "--prompt-len", "8",
            "--new-tokens", "3", "--systems", "infergraft", "--out", str(tmp_path)]
    with pytest.raises(PlanError, match="never decoded whole.*--max-num-batched-tokens"):
        main(args + ["--max-num-batched-tokens", "8"])
    assert cli_main(["bench"] + args + ["--max-num-batched-tokens", "8"]) == 2  # a message, no trace
    assert "never decoded whole" in capsys.readouterr().err
    assert main(args + ["--max-num-batched-tokens", "32"]) == 0
    capsys.readouterr()


def test_bench_with_int8_weights_counts_the_packed_bytes(tmp_path, capsys):
    args = ["--model", "tiny", "--device", "cpu", "--batches", "1", "--prompt-len", "8",
            "--new-tokens", "4", "--systems", "infergraft"]
    step_bytes = []  # the roofline's bytes per decode step: floor x measured bandwidth
    for extra, out in (([], tmp_path / "a"), (["--plugins", "int8"], tmp_path / "b")):
        assert main(args + extra + ["--out", str(out)]) == 0
        data = json.loads((out / "results.json").read_text())
        step_bytes.append(data["results"][0]["roofline_ms"] / 1e3 * data["copy_bandwidth_Bps"])
    capsys.readouterr()
    assert step_bytes[1] < 0.7 * step_bytes[0]  # int8 projections, the rest as before


BAD_FLAGS = [  # (flags over a good tiny run, what the message must say)
    (["--dtype", "foo"], "float32, bfloat16 or float16"),
    (["--batches", "a,b"], "positive integers"),
    (["--batches", "0"], "positive integers"),
    (["--batches", "8,-1"], "positive integers"),
    (["--batches", "1,1"], "distinct"),
    (["--new-tokens", "3", "--systems", "infergraft,hf-eager"], "at least 4"),
    (["--new-tokens", "2", "--systems", "hf-eager"], "at least 4"),
    (["--new-tokens", "1"], "at least 2"),  # infergraft alone
    (["--new-tokens", "-2"], "positive integer"),
    (["--prompt-len", "0"], "positive integer"),
    (["--max-num-batched-tokens", "0"], "positive integer"),
    (["--device", "bogus"], "not a device name"),
    (["--device", "cuda:99"], "not available here"),
    (["--out", "/dev/null/x"], "not a writable directory"),
    (["--model", "nonexist"], "tiny"),  # the names it accepts
    (["--systems", "infergraft,foo"], "hf-eager"),
    (["--systems", "hf-static"], "CUDA"),  # the device is the CPU
    (["--plugins", "foo"], "unknown plugin"),
]


@pytest.mark.parametrize("entry", ["bench_cli", "infergraft"])
@pytest.mark.parametrize("flags, says", BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_bench_refuses_a_bad_flag_before_building_a_model(flags, says, entry, tmp_path,
                                                          capsys, monkeypatch):
    import infergraft.core.tools.bench_cli as bench_cli

    def never(*args, **kw):
        pytest.fail("a model was built or timed for a bad flag")
    monkeypatch.setattr(bench_cli, "load_models", never)
    monkeypatch.setattr(bench_cli, "run_benchmark", never)
    argv = ["--model", "tiny", "--device", "cpu", "--batches", "1", "--prompt-len", "8",
            "--new-tokens", "6", "--systems", "infergraft", "--out", str(tmp_path / "o")] + flags
    call = main if entry == "bench_cli" else lambda a: cli_main(["bench"] + a)
    try:
        rc = call(argv)
    except SystemExit as e:  # argparse's usage error
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # one line says what and what works
    assert flags[0] in err and says in err, err
    assert not (tmp_path / "o").exists()


def test_tpot_counts_only_steps_of_the_whole_batch():
    from infergraft.core.tools.bench import full_batch_steps
    from infergraft.core.metrics import RequestMetrics

    # three sequences admitted over steps at t=1, 2, 3 (one step a second, then 10 ms
    # decode steps from t=3); the first finishes two steps before the last
    def seq(first, last):
        m = RequestMetrics(arrival=0.0)
        for t in [float(x) for x in range(first, 3)] + [3 + 0.01 * i for i in range(last + 1)]:
            m.on_token(t)
        return m
    steps = full_batch_steps([seq(1, 5), seq(2, 6), seq(3, 7)])
    assert len(steps) == 5 and all(abs(s - 0.01) < 1e-9 for s in steps)  # t = 3 .. 3.05


def test_tpot_of_a_batch_admitted_over_several_steps():
    import torch

    from infergraft import core
    from infergraft.core.tools.bench import bench_ours, full_batch_steps, random_prompts
    from infergraft.core.request import SamplingParams
    from infergraft.core.testing.models import random_model, tiny_llama_config

    hf = random_model(tiny_llama_config())
    engine = core.build(hf, max_num_batched_tokens=8, dtype=torch.float32, device="cpu")
    prompts = random_prompts(4, 8, hf.config.vocab_size)  # one prompt a step
    seqs = [engine.add_request(p, SamplingParams(max_new_tokens=6, ignore_eos=True))
            for p in prompts]
    while engine.has_unfinished():
        engine.step()
    firsts = sorted(s.metrics.first_token for s in seqs)
    assert firsts[0] < firsts[-1]  # admitted over several steps
    steps = full_batch_steps([s.metrics for s in seqs])
    # the steps where every sequence got a token: the running sequences' decode tokens
    # leave less of the 8-token budget for each next prompt, so the 4th samples its first
    # token in step 5 (chunks 8 | 7 | 1+6 | 2+4 | 4) and the 1st its 6th and last in step
    # 6: one interval between them
    assert len(steps) == 1
    assert bench_ours(engine, prompts, 6, warmup=0, repeats=1)[1] > 0
    with pytest.raises(PlanError, match="never decoded whole.*--new-tokens"):
        bench_ours(engine, prompts, 3, warmup=0, repeats=1)  # the first ends before the last starts


def test_each_timed_run_prefills_its_prompts_whole():
    """The prefix cache (on by default) finds none of a run's blocks: TTFT is a prefill."""
    from infergraft import core
    from infergraft.core.testing.models import random_model, tiny_llama_config
    from infergraft.core.tools.bench import bench_ours, random_prompts

    hf = random_model(tiny_llama_config())
    engine = core.build(hf, plugins=["paged"], block_size=4, device="cpu")
    bench_ours(engine, random_prompts(2, 16, hf.config.vocab_size), 4, warmup=1, repeats=2)
    stats = engine.stats()
    assert stats["prefix_cache_queries"] > 0 and stats["prefix_cache_hits"] == 0, stats


def test_random_shapes_read_as_their_config_says():
    from infergraft.core.tools.bench import shape_config
    from infergraft.core.tools.bench_cli import SHAPES
    from infergraft.core.rope import rope_from_config

    for name, shape in SHAPES.items():
        cfg = shape_config(name)
        assert cfg.num_attention_heads % cfg.num_key_value_heads == 0, name
        rope = rope_from_config(cfg, cfg.hidden_size // cfg.num_attention_heads)
        assert rope.theta == shape.get("rope_theta", 10000.0), name
    assert SHAPES["llama3-8b"]["num_key_value_heads"] == 8  # the GQA shape


@pytest.mark.parametrize("name, params, active", [
    ("llama3-8b", 8.03e9, None), ("mixtral-8x7b", 46.7e9, 12.9e9),
    ("qwen3-8b", 8.19e9, None), ("qwen3-30b-a3b", 30.5e9, 3.35e9)])
def test_random_shapes_have_their_models_parameter_counts(name, params, active):
    """Each shape is the model it is named after, as its policy describes it (Qwen3's
    through the contrib package), to 1%: the published totals and active counts."""
    from infergraft.core.selection import choose_policy
    from infergraft.core.tools.bench import shape_config

    cfg = shape_config(name)
    from infergraft import core

    spec = choose_policy(core.get_plugin_manager(), cfg, None).describe(cfg)
    assert spec.param_count == pytest.approx(params, rel=0.01)
    if active:
        assert spec.active_param_count == pytest.approx(active, rel=0.01)


def test_the_commit_is_what_the_sender_says_else_git_else_the_version(monkeypatch):
    from infergraft.core.tools import provenance

    def no_git(*a, **kw):
        raise FileNotFoundError("git")

    monkeypatch.setenv("INFERGRAFT_COMMIT", "abc1234-dirty")
    assert provenance.commit() == "abc1234-dirty (INFERGRAFT_COMMIT)"  # even inside git
    monkeypatch.delenv("INFERGRAFT_COMMIT")
    monkeypatch.setattr(provenance.subprocess, "run", no_git)
    assert provenance.commit().startswith("infergraft ")


def test_bench_compares_plugin_sets_in_one_run(tmp_path, capsys):
    """--compare-plugins: our engine again with int8, then int4, on the same weights; each
    row's roofline counts the bytes its decode step reads, beside the first build's: int8's
    packed rows; int4's dequantised copies, which the CPU multiplies by (Quantizer.dense_on),
    as many as the plain build's."""
    out = tmp_path / "c"
    assert main(["--model", "tiny", "--device", "cpu", "--batches", "1", "--prompt-len", "8",
                 "--new-tokens", "4", "--systems", "infergraft", "--compare-plugins",
                 "int8,int4", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    data = json.loads((out / "results.json").read_text())
    floors = {r["system"]: r["roofline_ms"] for r in data["results"]}
    assert set(floors) == {"infergraft", "infergraft+int8", "infergraft+int4"}
    assert floors["infergraft+int8"] < 0.7 * floors["infergraft"]
    assert floors["infergraft+int4"] == pytest.approx(floors["infergraft"], rel=1e-9)
    assert "| 1 | infergraft+int4 |" in text and "TPOT vs infergraft" in text


@pytest.mark.parametrize("flags, says", [
    (["--compare-plugins", "int8,+"], "distinct plugin sets"),
    (["--compare-plugins", "int8,int8"], "distinct plugin sets"),
    (["--compare-plugins", "nope"], "unknown plugin"),
    (["--plugins", "int8", "--compare-plugins", "int4"], "int4"),  # two weight quantisers
])
def test_bench_refuses_bad_plugin_sets_before_building(flags, says, tmp_path, capsys,
                                                       monkeypatch):
    import infergraft.core.tools.bench_cli as bench_cli

    monkeypatch.setattr(bench_cli, "load_models", lambda *a, **k: pytest.fail("built"))
    with pytest.raises(SystemExit) as e:
        main(["--model", "tiny", "--device", "cpu", "--out", str(tmp_path), *flags])
    assert e.value.code == 2 and says in capsys.readouterr().err


# -- a busy host: repeated runs that disagree -------------------------------------------
def test_runs_that_disagree_by_more_than_10_percent_are_named():
    from infergraft.core.tools.bench import Result
    from infergraft.core.tools.bench_report import disagreement, unsteady_warning

    assert disagreement([10.0, 12.0, 10.5]) == pytest.approx(0.2)
    assert disagreement([10.0]) == disagreement([]) == 0.0
    steady = Result("infergraft", 8, 1.0, 10.0, 5.0, tpot_runs_ms=[10.0, 10.9, 10.2])
    busy = Result("hf-eager", 8, 1.0, 20.0, 5.0, tpot_runs_ms=[20.0, 26.0, 20.2])
    assert unsteady_warning([steady]) is None  # 9% apart: within the 10%
    warning = unsteady_warning([steady, busy])
    assert "more than 10%" in warning and "host was busy" in warning
    assert "hf-eager batch 8: 30%" in warning and "infergraft" not in warning


@pytest.mark.parametrize("hf_runs, warned", [([0.02, 0.026, 0.02], True),
                                             ([0.02, 0.021, 0.02], False)])
def test_bench_warns_under_the_speed_ups_when_the_host_was_busy(tmp_path, capsys, monkeypatch,
                                                                 hf_runs, warned):
    """Fake measurement series (ours steady, HF's runs as given) through the real command:
    the warning under the table and in the JSON, or neither."""
    import statistics

    from infergraft.core.tools import bench

    def series(runs):
        return lambda *a, **k: (0.05, statistics.median(runs), {"p90": max(runs),
                                                                "p99": max(runs)}, runs)
    monkeypatch.setattr(bench, "bench_ours", series([0.01, 0.0101, 0.01]))
    monkeypatch.setattr(bench, "bench_hf", series(hf_runs))
    assert main(["--model", "tiny", "--device", "cpu", "--batches", "1", "--prompt-len", "8",
                 "--new-tokens", "6", "--systems", "infergraft,hf-eager",
                 "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    data = json.loads((tmp_path / "results.json").read_text())
    hf = next(r for r in data["results"] if r["system"] == "hf-eager")
    assert hf["tpot_runs_ms"] == pytest.approx([t * 1e3 for t in hf_runs])
    assert hf["runs_disagree"] == pytest.approx(max(hf_runs) / min(hf_runs) - 1)
    assert "| 1 | 10.00 | 20.00 |" in out  # the speed-up column is still there
    if warned:
        assert data["warnings"] == [next(line for line in out.splitlines()
                                         if line.startswith("warning: "))]
        assert "hf-eager batch 1: 30%" in data["warnings"][0]
    else:
        assert data["warnings"] == [] and "warning" not in out
