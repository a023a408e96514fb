"""``infergraft bench --tensor-parallel N --pipeline-parallel M`` (and ``bench throughput``
with them) under ``torchrun --nproc-per-node N*M -m infergraft.core.cli bench``: the model
on one device and on N*M ranks, timed the same way in one script. 1) Rank 0 alone measures
the copy bandwidth (``throughput``: the matmul rate), builds the model on its device, times
it as plain ``bench`` does and frees it (``--no-single``: skipped, for a model one device
cannot hold); the others wait in a broadcast carrying its outcome (its failure raised on
every rank). 2) Every rank builds ``plugins=["tp"]`` (M = 1) or ``["pp"]`` with
``tensor_parallel=N`` (``micro_batches=K`` when given) and runs the same timed loop in
lockstep; the times are rank 0's. 3) Rank 0 prints both with the speed-up and the scaling
efficiency (speed-up / ranks) and writes the JSON; the ranks' roofline is the largest
rank's share (``bench.rank_floors``). A random shape is made a tensor at a time on each
rank's device (``random_weights``), never whole; a directory streams from its files."""
from __future__ import annotations

import json
import os
import sys
import time
import zlib
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import attrs
import torch

from ..distributed import failure
from ..errors import PlanError
from .bench import (SHAPES, copy_bandwidth, describe_device, matmul_rate, rank_floors,
                    run_benchmark, shape_config)
from .bench_report import plot, unsteady_warning
from .bench_variants import BASE, engine_plugins, free_device
from .provenance import provenance

# ranks wait for each other this long (rank 0's one-device run is minutes on a 7B model)
GROUP_TIMEOUT = timedelta(minutes=30)


def add_arguments(p, positive) -> None:
    """The parallel flags; ``positive``: the argparse type of a positive integer."""
    p.add_argument("--tensor-parallel", type=positive, default=1, metavar="N",
                   help="ranks splitting each layer (the tp planner; with "
                        "--pipeline-parallel, each stage's); run under torchrun "
                        "--nproc-per-node N*M; rank 0 also times the model on one device")
    p.add_argument("--pipeline-parallel", type=positive, default=1, metavar="M",
                   help="pipeline stages (the pp planner, with tensor_parallel=N)")
    p.add_argument("--micro-batches", type=positive, default=None, metavar="K",
                   help="the pp planner's micro_batches option: a step's sequences in K "
                        "groups in flight across the stages (needs --pipeline-parallel > 1)")
    p.add_argument("--no-single", action="store_true",
                   help="with --tensor-parallel / --pipeline-parallel: skip the one-device "
                        "run beside it (a model one device cannot hold, e.g. llama2-70b)")


def ranks(args) -> int:
    return args.tensor_parallel * args.pipeline_parallel


def tag(args) -> str:
    """'tp2', 'pp4', 'tp2-pp2' (+ '-mb4'): the parallel rows' name."""
    return "-".join([f"tp{args.tensor_parallel}"] * (args.tensor_parallel > 1) +
                    [f"pp{args.pipeline_parallel}"] * (args.pipeline_parallel > 1) +
                    [f"mb{args.micro_batches}"] * (args.micro_batches is not None))


def resolve(args, refused=()) -> None:
    """PlanError, before anything is built, for parallel flags that do not go together or
    a launch that does not match them; ``refused``: (flag, given) the ranks do not run."""
    n = ranks(args)
    if args.micro_batches is not None and args.pipeline_parallel == 1:
        raise PlanError("--micro-batches is an option of the pp planner: give "
                        "--pipeline-parallel M > 1 with it")
    if n == 1 and args.no_single:
        raise PlanError("--no-single skips the one-device run beside a parallel one: "
                        "give --tensor-parallel or --pipeline-parallel with it")
    for flag, given in refused if n > 1 else ():
        if given:
            raise PlanError(f"{flag} is not run with --tensor-parallel / --pipeline-parallel "
                            "(our engine alone, on one device and on the ranks)")
    world = os.environ.get("WORLD_SIZE")
    if n > 1 and world != str(n):
        found = f"torchrun started {world}" if world else "not under torchrun: no WORLD_SIZE"
        raise PlanError(f"--tensor-parallel {args.tensor_parallel} x --pipeline-parallel "
                        f"{args.pipeline_parallel} runs {n} processes, one a rank: launch it "
                        f"as `torchrun --nproc-per-node {n} -m infergraft.core.cli bench "
                        f"...` ({found})")


def join_group(device: str):
    """(rank, this rank's device): the process group made here with GROUP_TIMEOUT (the
    engine's build finds it made), each rank on its own GPU (LOCAL_RANK)."""
    dist, cuda = torch.distributed, device.startswith("cuda")
    here = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(here)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", timeout=GROUP_TIMEOUT)
    return dist.get_rank(), here


def leave_group() -> None:
    torch.distributed.barrier()  # the others leave once rank 0 has written
    failure.leave_group()


def first_on_rank0(rank: int, fn):
    """``fn()`` on rank 0 while the others wait; its (picklable) result on every rank. A
    failure there is raised on rank 0 and, named, on the others."""
    out, error = [None], None
    if rank == 0:
        try:
            out = [("ok", fn())]
        except Exception as e:  # told to the others before rank 0 raises it
            error, out = e, [("error", f"{type(e).__name__}: {e}")]
    torch.distributed.broadcast_object_list(out, src=0)
    if error is not None:
        raise error
    if out[0][0] == "error":
        raise PlanError(f"rank 0's one-device run failed: {out[0][1]}")
    return out[0][1]


def random_weights(name: str, device, dtype):
    """An HF model of the random shape ``name`` on the meta device whose ``state_dict()``
    makes each tensor as the loader takes it, on ``device``, from a seed of its key (norms
    1, the rest N(0, 0.02) as HF initialises them): every rank and the one-device run
    make the same weights, and none holds more than its share and one tensor."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(shape_config(name), dtype=dtype).eval()
    shapes = {k: v.shape for k, v in hf.state_dict().items()}

    def tensors():
        for key, shape in shapes.items():
            if "norm" in key:
                yield key, torch.ones(shape, device=device, dtype=dtype)
                continue
            g = torch.Generator(device).manual_seed(zlib.crc32(key.encode()))
            yield key, torch.randn(shape, generator=g, device=device, dtype=dtype).mul_(0.02)
    hf.state_dict = lambda: SimpleNamespace(items=tensors)  # what core.build reads of it
    return hf


def planner_of(args) -> tuple[str, dict]:
    """The ranks' planner and its options: tp, or pp with tensor_parallel (micro_batches)."""
    options = {"tensor_parallel": args.tensor_parallel, "micro_batches": args.micro_batches}
    return ("tp", {}) if args.pipeline_parallel == 1 else \
        ("pp", {k: v for k, v in options.items() if v is not None})


def build_on(args, device, parallel: bool, max_batch_size: int, max_seq_len: int,
             budget=None, options=None):
    """Our engine of ``args.model`` on ``device``: alone (a plan that does not fit names
    --no-single), or this rank's share of the parallel plan."""
    from ..build import build

    model = random_weights(args.model, device, args.dtype) if args.model in SHAPES else args.model
    planner, extra = planner_of(args) if parallel else (None, {})
    try:
        engine = build(model, plugins=engine_plugins(device, args.plugins) + [planner] * (
            planner is not None), dtype=args.dtype, device=device, max_batch_size=max_batch_size,
            max_seq_len=max_seq_len, max_num_batched_tokens=budget, config=args.config_options,
            **{**(options or {}), **extra})
    except PlanError as e:  # alone: it may be too large for one device
        raise e if parallel else PlanError(f"the one-device run beside {tag(args)}: {e}; "
                                           "give --no-single to skip it") from None
    if torch.distributed.get_rank() == 0:
        print(f"{tag(args) if parallel else 'one device'}:\n{engine.plan}", file=sys.stderr)
    return engine


def measure(args) -> int:
    """``infergraft bench`` over the ranks, beside the one-device run (the module's steps)."""
    rank, device = join_group(args.device)
    log = (lambda m: print(m, file=sys.stderr)) if rank == 0 else (lambda m: None)
    timing = (args.batches, args.prompt_len, args.new_tokens, ("infergraft",))
    size = (max(args.batches), args.prompt_len + args.new_tokens, args.max_num_batched_tokens)
    single = []

    def alone():  # 1) rank 0: the bandwidth and the one-device run, the others waiting
        bw = copy_bandwidth(device, nbytes=(1 << 30) if device.type == "cuda" else 1 << 28)
        if not args.no_single:  # the engine dropped as the call returns, then freed
            single.extend(run_benchmark(None, build_on(args, device, False, *size), *timing,
                                        bandwidth=bw, log=log)[0])
            free_device()
        return bw
    bw = first_on_rank0(rank, alone)
    # 2) every rank: its share, the same timed loop in lockstep
    engine = build_on(args, device, True, *size)
    rows = run_benchmark(None, engine, *timing, bandwidth=bw, log=log)[0]
    plan, out = engine.plan, [None] * ranks(args)
    torch.distributed.all_gather_object(out, (plan.weight_bytes, plan.kv_bytes_per_token))
    per_rank = [{"rank": r, "stage": r // plan.parallel.tensor_parallel, "weight_bytes": w,
                 "kv_bytes_per_token": kv} for r, (w, kv) in enumerate(out)]
    del engine
    if rank == 0:
        report(args, single, rows, per_rank, bw)
    leave_group()
    return 0


def report(args, single, rows, per_rank, bw: float) -> None:
    """Rank 0: the parallel rows named and floored by the ranks' shares, the speed-ups;
    the table, results.json and tpot.png under ``--out``."""
    n, one = ranks(args), {r.batch: r for r in single}
    context = args.prompt_len + args.new_tokens // 2  # mean context over the timed steps
    speedup = []
    for r in rows:
        r.system, s = f"infergraft-{tag(args)}", one.get(r.batch)
        r.roofline_ms, in_turn = rank_floors(per_rank, r.batch, context, bw)
        speedup.append({"batch": r.batch, "stages_in_turn_roofline_ms": in_turn,
                        "tpot_speedup": s and s.tpot_ms / r.tpot_ms,
                        "ttft_speedup": s and s.ttft_ms / r.ttft_ms,
                        "scaling_efficiency": s and s.tpot_ms / r.tpot_ms / n})
    device, warning = describe_device(args.device), unsteady_warning(single + rows)
    title = f"{args.model} {str(args.dtype)[6:]}, {tag(args)} on {n} ranks ({device})"
    (out := Path(args.out)).mkdir(parents=True, exist_ok=True)
    keys = ("model", "tensor_parallel", "pipeline_parallel", "micro_batches", "prompt_len",
            "new_tokens", "plugins", "config")
    (out / "results.json").write_text(json.dumps({
        "benchmark": "parallel", **{k: getattr(args, k) for k in keys}, "ranks": n,
        "dtype": str(args.dtype), "device": device, "single": not args.no_single,
        "copy_bandwidth_Bps": bw, "torch": torch.__version__,
        "when": time.strftime("%Y-%m-%d %H:%M"), **provenance(), "rank_shares": per_rank,
        "results": [dict(attrs.asdict(r), tokens_per_s=r.tokens_per_s,
                         roofline_fraction=r.roofline_fraction) for r in single + rows],
        "speedup": speedup, "warnings": [warning] if warning else []}, indent=2))
    plotted = plot(single + rows, out / "tpot.png", title)
    print(f"## {title}, prompt {args.prompt_len}, {args.new_tokens} new tokens\n\n"
          f"{table(args, single, rows, speedup)}\n\ncopy bandwidth (roofline): "
          f"{bw / 1e9:.1f} GB/s; rank roofline: the largest rank's share"
          + (f"\n\n{warning}" if warning else ""))
    print(f"\nwrote {out / 'results.json'}" + (f" and {out / 'tpot.png'}" if plotted else ""))


def table(args, single, rows, speedup) -> str:
    """Per batch: TPOT and TTFT on one device and on the ranks, the speed-up, the scaling
    efficiency, each one's roofline and the fraction reached; a pipeline's stages in turn."""
    name, one, pp = tag(args), {r.batch: r for r in single}, args.pipeline_parallel > 1
    head = ["batch", "1 device TPOT ms", f"{name} TPOT ms", "speed-up", f"efficiency (/ "
            f"{ranks(args)})", "1 device TTFT ms", f"{name} TTFT ms", "1 device roofline ms",
            "rank roofline ms", f"{name} / roofline"] + ["stages in turn roofline ms"] * pp
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r, u in zip(rows, speedup):
        s = one.get(r.batch)
        cells = [s and f"{s.tpot_ms:.3f}", f"{r.tpot_ms:.3f}", s and f"{u['tpot_speedup']:.2f}x",
                 s and f"{u['scaling_efficiency']:.0%}", s and f"{s.ttft_ms:.1f}",
                 f"{r.ttft_ms:.1f}", s and f"{s.roofline_ms:.3f}", f"{r.roofline_ms:.3f}",
                 f"{r.roofline_fraction:.0%}"] + [f"{u['stages_in_turn_roofline_ms']:.3f}"] * pp
        lines.append("| " + " | ".join([str(r.batch)] + [c or "-" for c in cells]) + " |")
    return "\n".join(lines)


def measure_throughput(args, ours, variant, write, matmul_n: dict) -> int:
    """``infergraft bench throughput`` over the ranks: the same requests at once on one
    device (rank 0), then on the ranks, set against it as a variant (its out tok/s, TTFT
    and TPOT over the one device's); the floor at N*M times rank 0's matmul rate.
    ``ours``, ``variant``, ``write``: bench_throughput's run, variant run and writer."""
    from .throughput_report import compute_floor

    rank, device = join_group(args.device)
    size = (args.max_batch_size, args.max_seq_len, (args.max_num_batched_tokens or [None])[0],
            args.build_options)

    def alone():  # 1) rank 0: the matmul rate, the one-device run
        n = matmul_n.get(device.type, matmul_n["cpu"])
        rate, base = matmul_rate(device, args.dtype, n), None
        if not args.no_single:
            base = ours(args, build_on(args, device, False, *size))[0]
            free_device()
        return rate, f"{str(args.dtype)[6:]} {n}^3 torch.matmul on {device}, best of 5", base
    rate, measured, base = first_on_rank0(rank, alone)
    # 2) every rank: the same requests in lockstep, named as --compare-options spells it
    engine, (planner, options) = build_on(args, device, True, *size), planner_of(args)
    name = f"{BASE}-{tag(args)}"
    if base is None:
        rows, variants = {name: ours(args, engine, name)[0]}, []
    else:
        rows = {BASE: base}
        variants = [dict(variant(args, {"plugins": [planner], "options": options}, engine,
                                 base), name=name)]
    spec, ok = engine.spec, True
    del engine
    if rank == 0:  # 3) the table and throughput.json, as bench throughput writes them
        n = ranks(args)
        floor = compute_floor(spec, args.requests, rate * n, f"{measured}, x {n} ranks")
        for s in [*rows.values(), *variants]:
            s["over_floor"] = s["output_throughput"] / floor["output_throughput"]
            ok = ok and s["completed"] == len(args.requests) and s["full_length"]
        for v in variants:  # out tok/s over the one device's, per rank
            v["scaling_efficiency"] = v["output_throughput_vs_base"] / n
        write(args, None, rows, variants, None, floor)
        for v in variants:
            print(f"{name}: {v['output_throughput_vs_base']:.2f}x the one device's output "
                  f"tok/s on {n} ranks: scaling efficiency {v['scaling_efficiency']:.0%}")
    leave_group()
    return 0 if ok else 1
