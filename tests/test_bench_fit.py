"""`infergraft bench` on a device that holds only one copy of the model (HF's or our
engine's): the order is chosen from the device's memory budget (monkeypatched here) and the
model's shapes. Where both fit, each batch on every system in turn (as ever); where only
one does, our engine at every batch, freed, then HF's model; where neither, a refusal that
says so before anything is loaded. The CPU and the tiny random shape stand in for the GPU:
the table and the JSON are the same in either order."""
import argparse
import json
import weakref

import pytest

from infergraft.core import budget
from infergraft.core.cli import main as cli_main
from infergraft.core.memory import plan_memory
from infergraft.core.tools import bench
from infergraft.core.tools.bench_cli import main
from infergraft.core.tools.plan_cli import model_spec

ARGS = ["--model", "tiny", "--device", "cpu", "--batches", "1,2", "--prompt-len", "8",
        "--new-tokens", "4", "--systems", "infergraft,hf-eager"]


def one_copy_budget() -> int:
    """A budget whose 0.9 holds either copy of tiny (float32, 2 x 12-token sequences) but
    not both: our engine's weights, K/V and activations, and HF's weights half again."""
    import torch

    _, spec, _ = model_spec("tiny")
    ours = plan_memory(spec, dtype=torch.float32, max_seq_len=12, max_batch_size=2).total_bytes
    hf_weights = spec.param_count * 4
    assert hf_weights < ours  # the engine's 2048-token activations: ours is the larger copy
    return int((ours + hf_weights / 2) / 0.9)


def record_calls(monkeypatch) -> list:
    """(system, batch, whether our engine is still alive) of each measurement, in order."""
    calls, engines = [], []
    ours, theirs = bench.bench_ours, bench.bench_hf

    def timed_ours(engine, prompts, new_tokens, **kw):
        engines.append(weakref.ref(engine))
        calls.append(("infergraft", len(prompts), True))
        return ours(engine, prompts, new_tokens, **kw)

    def timed_hf(model, prompts, new_tokens, **kw):
        calls.append(("hf-eager", len(prompts), any(e() is not None for e in engines)))
        return theirs(model, prompts, new_tokens, **kw)
    monkeypatch.setattr(bench, "bench_ours", timed_ours)
    monkeypatch.setattr(bench, "bench_hf", timed_hf)
    return calls


def run(tmp_path, capsys, name):
    assert main(ARGS + ["--out", str(tmp_path / name)]) == 0
    out, err = capsys.readouterr()
    return out, err, json.loads((tmp_path / name / "results.json").read_text())


def test_the_order_follows_the_budget_and_the_results_keep_their_shape(tmp_path, capsys,
                                                                       monkeypatch):
    calls = record_calls(monkeypatch)
    both_out, both_err, both = run(tmp_path, capsys, "both")  # the host's memory: both fit
    assert [c[:2] for c in calls] == [("infergraft", 1), ("hf-eager", 1), ("infergraft", 2),
                                      ("hf-eager", 2)]
    assert "order: interleaved" in both_err and "interleaved order" in both_out

    calls.clear()
    monkeypatch.setattr(budget, "device_budget", lambda *a, **k: (one_copy_budget(), "a test"))
    out, err, data = run(tmp_path, capsys, "one")
    # every batch of ours first, the engine gone before HF's first step
    assert calls == [("infergraft", 1, True), ("infergraft", 2, True), ("hf-eager", 1, False),
                     ("hf-eager", 2, False)]
    assert "order: sequential" in err and "sequential order" in out
    assert "K/V pool cannot hold" not in err
    # the same table and JSON, each HF row against the freed engine's roofline
    lines = [line for line in out.splitlines() if line.startswith("|")]
    assert lines[0] == next(line for line in both_out.splitlines() if line.startswith("|"))
    assert [line.split(" | ")[0] for line in lines[2:]] == ["| 1", "| 2"]
    assert data.keys() == both.keys()
    assert [(r["system"], r["batch"]) for r in data["results"]] == \
        [(r["system"], r["batch"]) for r in both["results"]]
    assert all(r.keys() == s.keys() for r, s in zip(data["results"], both["results"]))
    floors = {(r["system"], r["batch"]): r["roofline_ms"] for r in data["results"]}
    assert floors[("hf-eager", 1)] == floors[("infergraft", 1)] < floors[("infergraft", 2)]
    assert floors[("hf-eager", 2)] == floors[("infergraft", 2)]


def test_our_engine_alone_keeps_hfs_weights_in_host_memory(tmp_path, capsys, monkeypatch):
    """--systems infergraft: HF's model is only the source of our weights, so it stays in
    host memory (the interleaved order would load it onto the device beside our engine,
    whose cache budget it then takes: Qwen3-30B-A3B on an 80 GB H100 was refused so)."""
    import infergraft.core.tools.bench_cli as bench_cli

    calls = record_calls(monkeypatch)
    monkeypatch.setattr(bench_cli, "load_models",
                        lambda *a, **k: pytest.fail("HF's model was loaded onto the device"))
    args = ARGS[:-1] + ["infergraft", "--out", str(tmp_path / "alone")]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert "order: our engine alone" in err, err
    assert [c[:2] for c in calls] == [("infergraft", 1), ("infergraft", 2)]


@pytest.mark.parametrize("extra, room, says", [
    ([], lambda f: f.ours_least // 2, "tiny does not fit the device even alone: our engine"),
    # ours quantised and with short steps fits; HF's float32 copy does not
    (["--plugins", "int8", "--max-num-batched-tokens", "16"],
     lambda f: (f.ours_least + f.hf) // 2, "HF's model does not fit the device even alone"),
])
def test_a_model_that_does_not_fit_alone_is_refused_before_loading(extra, room, says, tmp_path,
                                                                   capsys, monkeypatch):
    import infergraft.core.tools.bench_cli as bench_cli
    from infergraft.core.tools import bench_fit

    monkeypatch.setattr(budget, "device_budget", lambda *a, **k: (1 << 40, "a test"))
    args = ARGS + extra + ["--out", str(tmp_path / "o")]
    p = argparse.ArgumentParser()
    bench_cli.add_arguments(p)
    fit = bench_fit.fit_of(bench_cli.resolve(p.parse_args(args)))
    assert fit.ours_least < fit.hf or not extra
    limit = int(room(fit) / 0.9)
    monkeypatch.setattr(budget, "device_budget", lambda *a, **k: (limit, "a test"))
    for name in ("load_models", "load_hf"):
        monkeypatch.setattr(bench_cli, name, lambda *a, **k: pytest.fail("a model was loaded"))
    assert cli_main(["bench"] + args) == 2
    err = capsys.readouterr().err
    assert says in err and "a test" in err and "K/V pool" not in err, err
    if extra:
        assert "--systems infergraft" in err  # what does run: ours alone


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_engine_is_freed_before_hf_comes_to_the_device(tmp_path, capsys,
                                                                  monkeypatch):
    """The sequential order on a GPU: between our last measurement and HF's first, the
    device gives back at least our engine's weights (its pool and CUDA graphs with them)
    while it takes HF's."""
    import torch

    import infergraft.core.tools.bench_cli as bench_cli
    from infergraft.core.tools import bench_fit

    args = ["--model", "tiny", "--device", "cuda", "--batches", "1,2", "--prompt-len", "8",
            "--new-tokens", "4", "--systems", "infergraft,hf-eager"]
    monkeypatch.setattr(budget, "device_budget", lambda *a, **k: (1 << 40, "a test"))
    p = argparse.ArgumentParser()
    bench_cli.add_arguments(p)
    fit = bench_fit.fit_of(bench_cli.resolve(p.parse_args(args)))
    one = int((max(fit.ours, fit.hf) + min(fit.ours, fit.hf) / 2) / 0.9)
    monkeypatch.setattr(budget, "device_budget", lambda *a, **k: (one, "a test"))
    allocated = {}  # system -> bytes allocated on the device as it is measured, HF's less
    ours, theirs = bench.bench_ours, bench.bench_hf

    def timed_ours(engine, prompts, new_tokens, **kw):
        allocated["infergraft"] = torch.cuda.memory_allocated()
        return ours(engine, prompts, new_tokens, **kw)

    def timed_hf(model, prompts, new_tokens, **kw):
        assert next(model.parameters()).is_cuda
        weights = sum(t.numel() * t.element_size() for t in model.parameters())
        allocated.setdefault("hf-eager", torch.cuda.memory_allocated() - weights)
        return theirs(model, prompts, new_tokens, **kw)
    monkeypatch.setattr(bench, "bench_ours", timed_ours)
    monkeypatch.setattr(bench, "bench_hf", timed_hf)
    assert main(args + ["--out", str(tmp_path)]) == 0
    assert "order: sequential" in capsys.readouterr().err
    freed = allocated["infergraft"] - allocated["hf-eager"]
    assert freed >= fit.ours_weights, (freed, fit.ours_weights)
