"""`infergraft bench --tensor-parallel 2` and `bench throughput --pipeline-parallel 2` under
torchrun on the CPU (gloo ranks, the tiny random shape): rank 0 times the model on one
device, then both ranks their shares in lockstep; rank 0 alone prints the table and writes
the JSON with both runs, the speed-up computed from them and each rank's share. Outside
torchrun, or with flags the ranks do not run, a clear error before anything is built."""
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from infergraft import core
from infergraft.core.cli import main as cli_main
from infergraft.core.memory import weight_bytes
from infergraft.core.tools import bench_parallel
from infergraft.core.tools.bench import Result, rank_floors, shape_config

TINY = ["--model", "tiny", "--device", "cpu"]
BENCH = TINY + ["--batches", "1,2", "--prompt-len", "8", "--new-tokens", "4"]


def torchrun(cwd, *argv, ok=True) -> subprocess.CompletedProcess:
    """``infergraft bench ARGV`` on two ranks, as a user launches it."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", "-m", "infergraft.core.cli", "bench", *argv]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=cwd,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert (done.returncode == 0) == ok, done.stderr[-3000:]
    return done


def test_tp2_beside_one_device_under_torchrun(tmp_path):
    done = torchrun(tmp_path, *BENCH, "--tensor-parallel", "2", "--out", str(tmp_path))
    # rank 0 alone prints: one table, one "wrote"
    assert done.stdout.count("| batch | 1 device TPOT ms | tp2 TPOT ms | speed-up") == 1
    assert done.stdout.count("wrote ") == 1, done.stdout
    data = json.loads((tmp_path / "results.json").read_text())
    assert (data["tensor_parallel"], data["pipeline_parallel"], data["ranks"]) == (2, 1, 2)
    rows = {(r["system"], r["batch"]): r for r in data["results"]}
    assert set(rows) == {(s, b) for s in ("infergraft", "infergraft-tp2") for b in (1, 2)}
    for r in rows.values():
        assert r["tpot_ms"] > 0 and r["ttft_ms"] > 0 and r["roofline_ms"] > 0
    for s in data["speedup"]:
        one, tp2 = rows[("infergraft", s["batch"])], rows[("infergraft-tp2", s["batch"])]
        assert s["tpot_speedup"] == pytest.approx(one["tpot_ms"] / tp2["tpot_ms"])
        assert s["ttft_speedup"] == pytest.approx(one["ttft_ms"] / tp2["ttft_ms"])
        assert s["scaling_efficiency"] == pytest.approx(s["tpot_speedup"] / 2)
    # each rank holds a share of the whole: together at least all of it, each well under
    # it; the ranks' roofline is the larger share's bytes a step, below one device's
    spec = core.get_plugin_manager().policies().get("llama").describe(shape_config("tiny"))
    whole = weight_bytes(spec, torch.float32)
    shares = data["rank_shares"]
    assert [s["rank"] for s in shares] == [0, 1]
    assert sum(s["weight_bytes"] for s in shares) >= whole
    assert max(s["weight_bytes"] for s in shares) < 0.8 * whole
    bw, context = data["copy_bandwidth_Bps"], 8 + 4 // 2
    for b in (1, 2):
        floor = max(s["weight_bytes"] + b * context * s["kv_bytes_per_token"]
                    for s in shares) / bw * 1e3
        assert rows[("infergraft-tp2", b)]["roofline_ms"] == pytest.approx(floor)
        assert floor < rows[("infergraft", b)]["roofline_ms"]


def test_throughput_on_two_stages_beside_one_device_under_torchrun(tmp_path):
    done = torchrun(tmp_path, "throughput", *TINY, "--pipeline-parallel", "2",
                    "--dataset", "uniform", "--num-prompts", "4", "--prompt-len", "8",
                    "--output-len", "4", "--out", str(tmp_path))
    assert done.stdout.count("Throughput Benchmark Result") == 1, done.stdout
    assert done.stdout.count("infergraft-pp2: ") == 1  # the speed-up line
    data = json.loads((tmp_path / "throughput.json").read_text())
    base, (pp2,) = data["runs"]["infergraft"], data["variants"]
    assert pp2["name"] == "infergraft-pp2" and pp2["build_plugins"] == ["pp"]
    for s in (base, pp2):
        assert (s["completed"], s["full_length"]) == (4, True) and s["output_throughput"] > 0
    assert pp2["output_throughput_vs_base"] == pytest.approx(
        pp2["output_throughput"] / base["output_throughput"])
    assert pp2["scaling_efficiency"] == pytest.approx(pp2["output_throughput_vs_base"] / 2)
    assert data["args"]["pipeline_parallel"] == 2
    assert "x 2 ranks" in data["floor"]["rate_measured"]


def test_a_failed_one_device_run_fails_every_rank_not_leaves_them_waiting(tmp_path):
    # four prompts of 8 tokens, one admitted a step: rank 0's one-device batch never
    # decodes whole (a PlanError there); rank 1, waiting for it, raises it too
    done = torchrun(tmp_path, *TINY, "--tensor-parallel", "2", "--batches", "4",
                    "--prompt-len", "8", "--new-tokens", "3", "--max-num-batched-tokens", "8",
                    "--out", str(tmp_path), ok=False)
    assert "infergraft: error: batch 4 never decoded whole" in done.stderr
    assert "infergraft: error: rank 0's one-device run failed: PlanError: batch 4" in done.stderr
    assert not (tmp_path / "results.json").exists()


REFUSED = [  # (flags, environment's WORLD_SIZE, what the message must say)
    (BENCH + ["--tensor-parallel", "2"], None,
     "launch it as `torchrun --nproc-per-node 2 -m infergraft.core.cli bench"),
    (BENCH + ["--tensor-parallel", "2", "--pipeline-parallel", "2"], "2",
     "runs 4 processes, one a rank: launch it as `torchrun --nproc-per-node 4"),
    (BENCH + ["--micro-batches", "4"], None, "--micro-batches is an option of the pp planner"),
    (BENCH + ["--no-single"], None, "give --tensor-parallel or --pipeline-parallel with it"),
    (BENCH + ["--tensor-parallel", "2", "--systems", "infergraft,hf-eager"], "2",
     "an HF system in --systems is not run with --tensor-parallel"),
    (BENCH + ["--tensor-parallel", "2", "--compare-plugins", "int8"], "2",
     "--compare-plugins is not run with --tensor-parallel"),
    (["throughput"] + TINY + ["--tensor-parallel", "2", "--compare-options",
                              "max_seq_len=64"], "2", "--compare-options is not run"),
    (["throughput"] + TINY + ["--tensor-parallel", "2", "--step-census"], "2",
     "--step-census is not run with --tensor-parallel"),
    (["throughput"] + TINY + ["--pipeline-parallel", "2"], None, "not under torchrun"),
]


@pytest.mark.parametrize("flags, world, message", REFUSED)
def test_flags_the_ranks_cannot_run_are_refused_before_anything_is_built(
        flags, world, message, monkeypatch, capsys):
    if world is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world)
    assert cli_main(["bench"] + flags) == 2
    assert message in capsys.readouterr().err


def _row(system, batch, tpot, roofline):
    return Result(system, batch, ttft_ms=2 * tpot, tpot_ms=tpot, roofline_ms=roofline)


def test_without_the_one_device_run_the_table_shows_the_ranks_alone(tmp_path, capsys):
    """--no-single (a model one device cannot hold): no speed-up, the ranks' own figures;
    a pipeline's stages in turn are bounded by the sum of their shares."""
    args = SimpleNamespace(model="tiny", dtype=torch.float32, device="cpu", out=str(tmp_path),
                           tensor_parallel=2, pipeline_parallel=2, micro_batches=None,
                           prompt_len=8, new_tokens=4, plugins=[], config=None,
                           no_single=True)
    shares = [{"rank": r, "stage": r // 2, "weight_bytes": w, "kv_bytes_per_token": 10}
              for r, w in enumerate((400, 500, 300, 300))]
    rows = [_row("infergraft", 1, 4.0, 0.0)]
    bench_parallel.report(args, [], rows, shares, bw=1e6)
    out = capsys.readouterr().out
    assert "| 1 | - | 4.000 | - | - | - | 8.0 | - |" in out
    data = json.loads((tmp_path / "results.json").read_text())
    (up,) = data["speedup"]
    assert up["tpot_speedup"] is None and up["scaling_efficiency"] is None
    # step bytes at batch 1, context 10: stage 0's larger rank 500 + 100, stage 1's 400
    assert data["results"][0]["roofline_ms"] == pytest.approx(600 / 1e6 * 1e3)
    assert up["stages_in_turn_roofline_ms"] == pytest.approx((600 + 400) / 1e6 * 1e3)
    assert rank_floors(shares, 1, 10, 1e6) == pytest.approx((0.6, 1.0))


def test_the_speed_up_is_warned_of_when_the_ranks_runs_disagree(tmp_path, capsys):
    args = SimpleNamespace(model="tiny", dtype=torch.float32, device="cpu", out=str(tmp_path),
                           tensor_parallel=2, pipeline_parallel=1, micro_batches=None,
                           prompt_len=8, new_tokens=4, plugins=[], config=None,
                           no_single=False)
    shares = [{"rank": r, "stage": 0, "weight_bytes": 400, "kv_bytes_per_token": 10}
              for r in (0, 1)]
    single, rows = [_row("infergraft", 1, 8.0, 0.0)], [_row("infergraft", 1, 4.0, 0.0)]
    single[0].tpot_runs_ms, rows[0].tpot_runs_ms = [8.0, 8.1, 8.0], [4.0, 5.0, 4.1]
    bench_parallel.report(args, single, rows, shares, bw=1e6)
    out = capsys.readouterr().out
    (warning,) = json.loads((tmp_path / "results.json").read_text())["warnings"]
    assert "infergraft-tp2 batch 1: 25%" in warning and warning in out


def test_the_all_reduce_latency_script_runs_under_torchrun(tmp_path):
    """docs/bench/allreduce_latency.py (the one-shot all-reduce question, for 2 x H200):
    on gloo ranks, every size timed eagerly beside its copy; no graphs off CUDA."""
    from pathlib import Path

    script = Path(__file__).parents[1] / "docs" / "bench" / "allreduce_latency.py"
    out = tmp_path / "allreduce.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", str(script), str(out), "--device", "cpu", "--repeats", "2"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["world_size"] == 2 and len(data["rows"]) == 8
    for r in data["rows"]:
        assert r["bytes"] == r["rows"] * r["hidden"] * 2 and "graph_us" not in r
        assert r["eager_us"] > 0 and r["copy_us"] > 0
    assert done.stdout.count("| 64 | 8192 | 1024 |") == 1  # rank 0 alone prints
