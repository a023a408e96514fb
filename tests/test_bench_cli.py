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
