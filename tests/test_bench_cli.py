"""`infergraft bench` end to end on the CPU with the small random shape: one run measures
our engine, HF on the same weights and the copy-bandwidth roofline, and writes the table
and JSON (the GPU figures in docs/BENCHMARKS.md come from the same code)."""
import json

from infergraft.core.bench_cli import main


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
