"""The decode MoE MLP on CUDA: ``python -m infergraft.core.tools.kernel_bench.moe``.

For Qwen3-30B-A3B's layer shape (128 experts, top-8, hidden 2048, experts of 768) and
Mixtral-8x7B's (8, top-2, 4096, 14336), bf16, a few rows: the fused layer's MoE as
``ops.moe_decode`` runs it (three kernels) and as the plain layer ran it before (norm,
router, torch routing, the grouped kernels, the residual add), each in a CUDA graph over
four copies of the layer's weights (no L2 reuse between calls). Prints the time and the
bandwidth against the bytes of the experts the step routes to (and the router), beside
the measured copy bandwidth; ``--sweep`` also times a grid of the decode op's tiles (the first shape, one row).
"""
from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b": (8, 2, 4096, 14336)}


def _layer(e, h, i, g):
    dt, dev = torch.bfloat16, "cuda"
    return ((1 + 0.1 * torch.randn(h, generator=g)).to(dev, dt),
            (torch.randn(e, h, generator=g) / h ** 0.5).to(dev, dt),
            (torch.randn(e, 2 * i, h, generator=g) / h ** 0.5).to(dev, dt),
            (torch.randn(e, h, i, generator=g) / i ** 0.5).to(dev, dt))


def _active_bytes(stream, layer, top_k):
    """Bytes of the router and of the distinct experts the rows route to."""
    from infergraft.kernels.moe_decode import _normed, route

    g, router, wgu, wd = layer
    ss = stream.float().square().sum(-1)[None]
    _, ids = route(F.linear(_normed(stream, ss, g, 1e-6), router), top_k, True)
    experts = ids.unique().numel()
    return router.numel() * 2 + experts * (wgu[0].numel() + wd[0].numel()) * 2


def main(argv=None):
    from infergraft.core.tools.bench import copy_bandwidth
    from infergraft.core.tools.kernel_bench.gemms import graph_time
    from infergraft.kernels.dispatch import get_ops
    from infergraft.kernels.moe_decode import moe_decode_triton, route

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="qwen3-30b-a3b,mixtral-8x7b")
    p.add_argument("--rows", default="1,2,4")
    p.add_argument("--sweep", action="store_true", help="a grid of moe_decode's tiles (1 row)")
    args = p.parse_args(argv)
    ops = get_ops("cuda", "triton")
    bw = copy_bandwidth("cuda")
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    g = torch.Generator().manual_seed(0)
    for name in args.shapes.split(","):
        e, k, h, i = SHAPES[name]
        layers = [_layer(e, h, i, g) for _ in range(4)]
        for t in map(int, args.rows.split(",")):
            stream = torch.randn(t, h, generator=g).to("cuda", torch.bfloat16)
            ss = stream.float().square().sum(-1)[None].contiguous()
            nbytes = _active_bytes(stream, layers[0], k)
            it = itertools.cycle(layers)

            def decode(tiles=None):
                gw, router, wgu, wd = next(it)
                return moe_decode_triton(stream, ss, gw, 1e-6, router, wgu, wd, k, True,
                                         tiles=tiles)

            def grouped():  # the plain layer's MoE before the fused layer took it
                gw, router, wgu, wd = next(it)
                x = ops.rms_norm(stream, gw, 1e-6)
                weights, ids = route(ops.linear(x, router), k, True)
                return stream + ops.fused_moe(x, wgu, wd, weights, ids)

            def line(label, sec):
                return (f"{name:14s} T={t}  {label:28s} {sec * 1e6:8.1f} us  "
                        f"{nbytes / sec / 1e12:5.2f} TB/s ({nbytes / sec / bw:4.0%} of copy)")

            print(line("moe_decode", graph_time(decode)))
            print(line("norm+router+route+grouped", graph_time(grouped)))
            if args.sweep and t == 1 and name == args.shapes.split(",")[0]:
                _sweep(decode, line, graph_time)


def _sweep(decode, line, graph_time):
    """The gate_up / down tiles (the down kernel's routing before or after its PDL wait),
    then, on the best of those, the route kernel's: experts a program and its K step."""
    best = []
    for gn, dn, dk, w, early in itertools.product((8, 16, 32), (8, 16, 32), (256, 512),
                                                  (4, 8), (False, True)):
        tiles = dict(GATE_UP_N=gn, DOWN_N=dn, DOWN_K=dk, GATE_UP_WARPS=w, DOWN_WARPS=w,
                     DOWN_EARLY=early)
        best.append((graph_time(lambda: decode(tiles), replays=5), tiles))
    best.sort(key=lambda b: b[0])
    for sec, tiles in best[:8]:
        print(line(str(tiles), sec))
    top = best[0][1]
    for route_e, route_k in ((8, 256), (4, 512), (2, 1024), (1, 2048), (1, 4096)):
        tiles = dict(top, ROUTE_E=route_e, ROUTE_K=route_k)
        try:
            print(line(f"route {route_e} x {route_k}", graph_time(lambda: decode(tiles),
                                                                  replays=5)))
        except Exception as exc:  # a tile Triton cannot compile: the others still run
            print(f"route {route_e} x {route_k}: {type(exc).__name__}: {exc}"[:200])


if __name__ == "__main__":
    main()
