"""The int4 micro-benchmark (core/tools/kernel_bench/int4.py) runs end to end (``--smoke``: tiny
shapes, the CPU interpreter without a GPU): every path timed, a layer's totals, the
JSON written, and a sweep that skips a config failing to launch; its copy of the
replaced kernel still computes the product."""
import json

import pytest
import torch

from infergraft.kernels._triton import interpreting
from infergraft.core.tools.kernel_bench import int4 as B
from infergraft.kernels.int4_linear import int4_linear_torch, quantize_int4

from .tolerances import TOLERANCES

_runs = pytest.mark.skipif(not (torch.cuda.is_available() or interpreting()),
                           reason="needs CUDA or TRITON_INTERPRET=1")


@_runs
def test_smoke_run_times_every_shape_and_row_count(tmp_path, capsys):
    out = tmp_path / "int4.json"
    assert B.main(["--smoke", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "copy bandwidth" in text and "layer M=   1" in text and "x32" in text
    data = json.loads(out.read_text())
    assert {(r["shape"], r["m"]) for r in data["results"]} == \
        {(s, m) for s in B.SMOKE_SHAPES for m in (1, 2, 17)}
    for r in data["results"]:
        assert r["default_s"] > 0 and r["bf16_s"] > 0 and r["old_s"] > 0
        assert r["roofline_s"] > 0 and all(t > 0 for t in r["paths"].values())
        assert set(r["paths"]) == ({"gemv", "tiles"} if r["m"] <= 8 else {"tiles"})
    assert "commit" in data["provenance"]


@_runs
def test_smoke_sweep_skips_a_config_that_fails(monkeypatch, capsys):
    bad = dict(PATH="tiles", BLOCK_M=16, BLOCK_N=16, BLOCK_K=48, SPLIT=1, num_warps=4,
               num_stages=2)  # BLOCK_K must divide the group: the launcher refuses it
    grid = B.tile_grid
    monkeypatch.setattr(B, "tile_grid", lambda *a, **kw: grid(*a, **kw) + [bad])
    assert B.main(["--smoke", "--sweep", "--shapes", "o", "--rows", "1,3"]) == 0
    text = capsys.readouterr().out
    assert "sweep o        M=   1" in text and "sweep's best" in text
    assert "skipped, e.g. tiles 16x16x48" in text and "must divide" in text


def test_old_kernel_copy_computes_the_product(device, randn):
    dt = torch.float16
    p = quantize_int4(randn(40, 192) / 14, 64)
    x = randn(3, 192, dtype=dt)
    out = B.old_int4_linear(x, p.qweight, p.scales, p.zeros, 64, 192)
    torch.testing.assert_close(out, int4_linear_torch(x, p.qweight, p.scales, p.zeros, 64, 192),
                               **TOLERANCES[dt])
