"""``infergraft plan MODEL``: the memory plan (weights, K/V per token / sequence / batch,
the activations of the largest prefill step, the largest batch that fits) from the
model's config alone; no weight is loaded. Then the paged cache's pool as a build sizes it
(``core.budget.pool_blocks``): its blocks and tokens, and how many sequences of each
``--seq-len`` it holds.

Exit status: 0 the plan fits, 1 it does not (the plan is printed all the same), 2 an
error (one line on stderr: a config that cannot be read, an option refused, ...), so that
a script can tell "does not fit" from "cannot plan". "Fits" is said of the ``--cache``
build: the contiguous cache (build's default) reserves max_batch_size x max_seq_len
tokens, the paged one needs a pool that holds one max_seq_len sequence.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import attrs
import torch

from ..selection import DTYPES, choose_policy, resolve_dtype
from ..errors import PlanError
from ..loading.source import ModelSourceError, spec_of, stored_dtype
from ..budget import blocks_for, check_utilization, default_blocks, held_blocks, pool_blocks
from ..memory import (MAX_SEQ_LEN_DEFAULT, as_bytes, device_budget, element_bytes,
                      host_memory, plan_memory, positive_int)
from ..distributed.ranks import rank_spec
from ..plugin_manager import get_plugin_manager
from ..units import fmt_bytes, rows_table
from . import plan_offload
from .config_cli import REVISION_HELP, add_config_argument, plan_config
from .shapes import SHAPES, shape_config

KVDTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "fp8")
FITS, DOES_NOT_FIT = 0, 1  # and 2, from cli.main, for an InfergraftError
EPILOG = """exit status:
  0  the plan fits the budget (or no budget could be read), for the --cache build
  1  it does not fit (the plan is printed all the same)
  2  error: the model, its config.json or an option cannot be used (one line on stderr)"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    # the epilog's lines are a table: keep its line breaks
    p.epilog, p.formatter_class = EPILOG, argparse.RawDescriptionHelpFormatter
    p.add_argument("model", nargs="?", default=None,
                   help="local HF model directory (config.json is enough), hub id in the "
                        "Hugging Face cache (org/name), alias, or a random shape's name "
                        f"({', '.join(SHAPES)}; no file needed) (default: the --config's "
                        "model or checkpoint, else smollm2-135m)")
    p.add_argument("--revision", default=None, help=REVISION_HELP)
    p.add_argument("--dtype", default=None, help="weights dtype: float32, bfloat16, float16 "
                                                 "(default: the checkpoint's)")
    p.add_argument("--kv-dtype", default=None, choices=KVDTYPES,
                   help="K/V storage (auto: the weights dtype; int8 / fp8: the kv-int8 / "
                   "kv-fp8 quantizer)")
    p.add_argument("--weights", default=None, choices=("auto", "int8", "int4", "fp8"),
                   help="weight storage (auto: the weights dtype; int8 / int4 / fp8: the int8 "
                        "(W8A16) / int4 (W4A16, groups of --group-size) / fp8 (e4m3) "
                        "quantizer)")
    p.add_argument("--group-size", type=int, default=None, metavar="G",
                   help="with --weights int4: the columns sharing a scale and zero-point "
                        "(32, 64 or 128; default 128)")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help=f"context length: prompt + output tokens (default: {MAX_SEQ_LEN_DEFAULT})")
    p.add_argument("--max-batch-size", type=int, default=None, help="default 8")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens one prefill step feeds at most, as core.build takes it "
                        "(default: max(max_seq_len, 2048))")
    p.add_argument("--device-memory", default=None,
                   help="budget, e.g. 80GiB (default: free CUDA memory, else host RAM)")
    p.add_argument("--tensor-parallel", type=int, default=None, metavar="N",
                   help="ranks of the tp planner (plugins=['tp'] under torchrun): the plan "
                        "is one rank's, each device holding its share")
    p.add_argument("--pipeline-parallel", type=int, default=None, metavar="N",
                   help="stages of the pp planner (plugins=['pp'] under torchrun): the plan "
                        "is the largest stage's (the first: most layers and the embeddings); "
                        "with --tensor-parallel T, one of its T ranks (pp's tensor_parallel=T)")
    p.add_argument("--micro-batches", type=int, default=None, metavar="M",
                   help="with --pipeline-parallel: pp's micro_batches, a step's tokens cut "
                        "into up to M groups in flight across the stages at once (default 1)")
    p.add_argument("--cache", default=None, choices=("contiguous", "paged"),
                   help="the K/V cache whose build the exit status speaks for (default: "
                        "contiguous, as core.build; paged: the pool holds a max_seq_len "
                        "sequence)")
    p.add_argument("--seq-len", type=int, action="append", default=None, metavar="L",
                   help="how many sequences of L tokens the paged pool holds (repeatable, "
                        "e.g. a workload's mean and its longest; default max_seq_len)")
    p.add_argument("--block-size", type=int, default=None, help="the paged pool's (default 16)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="F",
                   help="the fraction of the budget weights, activations and the paged pool "
                        "may take, in (0, 1] (default 0.9)")
    plan_offload.add_arguments(p)
    add_config_argument(p)
    p.add_argument("--json", action="store_true", help="print the numbers as JSON")


def _registered_quantizer(applies_to: str, matches, missing: str):
    found = [q for q in get_plugin_manager().quantizers()
             if q.applies_to == applies_to and matches(q)]
    if not found:
        raise PlanError(f"no registered {missing}")
    return found[0]


def kv_quantizer_for(kv_dtype: str):
    """The registered K/V quantiser storing ``kv_dtype`` (PlanError if none does)."""
    return _registered_quantizer("kv", lambda q: getattr(q, "kv_dtype", None) == kv_dtype,
                                 f"K/V quantizer stores {kv_dtype!r}")


def weight_quantizer_for(name: str):
    """The registered weight quantiser ``name`` (PlanError if none is)."""
    return _registered_quantizer("weights", lambda q: q.name == name,
                                 f"weight quantizer named {name!r}")


def _weight_quantizer(weights: str, config, group_size: int | None = None):
    """The quantiser ``--weights`` names; a pre-quantised checkpoint's own (GPTQ / AWQ: int4
    in its groups; fp8) where its config says so (``--weights`` may say that or auto)."""
    from ..loading.gptq import prequant_format

    fmt = prequant_format(config)
    if fmt is None and weights == "int4" and group_size is not None:
        return weight_quantizer_for(weights).configured(group_size=group_size)
    if group_size is not None:
        raise PlanError(f"--group-size {group_size} sizes int4's groups: give --weights int4 "
                        "too" if fmt is None else f"--group-size {group_size}: the checkpoint "
                        f"is {fmt.label}, its groups are its own; leave it out")
    if fmt is None:
        return None if weights == "auto" else weight_quantizer_for(weights)
    if weights not in ("auto", fmt.quantizer):
        raise PlanError(f"--weights {weights}: the checkpoint is {fmt.label} (its "
                        f"quantization_config); give --weights {fmt.quantizer} or leave it out")
    q = weight_quantizer_for(fmt.quantizer)
    return q.configured(group_size=fmt.group_size) if fmt.quantizer == "int4" else q


def one_rank(name: str, spec, stages: int, tp: int, micro_batches: int = 1):
    """(label, spec, elements not held) of the largest rank's share: the first stage (the
    most layers, the embeddings), 1/tp of its layers. The planners refuse what does not
    divide."""
    from ..distributed.stages import PipelineStage

    planners = get_plugin_manager().planners()
    if stages == 1:
        planners.get("tp").plan(spec, tp)
        return (f"{name}, one of {tp} ranks", *rank_spec(spec, None, tp))
    plan = planners.get("pp").plan(spec, stages * tp, tensor_parallel=tp,
                                   micro_batches=micro_batches)
    stage = PipelineStage(0, stages, plan.stages[0])
    label = f"{name}, stage 1 of {stages} (layers {stage.layers[0]}-{stage.layers[1] - 1})"
    if tp > 1:
        label += f", one of its {tp} ranks"
    if plan.micro_batches > 1:
        label += f", {plan.micro_batches} micro-batches a step"
    return (label, *rank_spec(spec, stage, tp))


def model_spec(model: str, revision=None):
    """(name, ModelSpec, HF config) of ``model``: a shape of bench's SHAPES (its LlamaConfig
    alone), else a directory, cached hub id or alias (``spec_of``: its config.json)."""
    if model in SHAPES:
        config = shape_config(model)
        return model, choose_policy(get_plugin_manager(), config, None).describe(config), config
    try:
        return spec_of(model, revision=revision)
    except ModelSourceError as e:
        if Path(model).expanduser().is_dir():
            raise
        raise ModelSourceError(f"{e}, or a random shape: {', '.join(SHAPES)}") from None


def run(args) -> int:
    plan_config(args)  # --config under the flags given, then plan's defaults
    name, spec, config = model_spec(args.model, args.revision)
    # the policy config.json's architectures / model_type picked (model_spec's)
    policy = choose_policy(get_plugin_manager(), config, None).name
    not_held = 0  # elements of the embeddings / head a stage does not hold
    if args.micro_batches != 1 and args.pipeline_parallel == 1:
        raise PlanError(f"--micro-batches {args.micro_batches} pipelines the stages of "
                        "--pipeline-parallel N (N > 1); give it too")
    if args.tensor_parallel != 1 or args.pipeline_parallel != 1:
        name, spec, not_held = one_rank(name, spec, args.pipeline_parallel, args.tensor_parallel,
                                        args.micro_batches)
    stored = stored_dtype(config)  # never config.torch_dtype: it warns in transformers 5
    dtype = resolve_dtype(args.dtype, stored if stored in DTYPES.values() else torch.float32)
    kv_quant, kv_dtype = None, dtype
    if args.kv_dtype in ("int8", "fp8"):
        kv_quant = kv_quantizer_for(args.kv_dtype)
    elif args.kv_dtype != "auto":
        kv_dtype = resolve_dtype(args.kv_dtype, dtype)
    if args.device_memory is not None:
        budget, source = as_bytes(args.device_memory), "--device-memory"
    else:
        budget, source = device_budget("cuda" if torch.cuda.is_available() else "cpu")
        if budget is None:
            budget, source = host_memory(), "host RAM"
    weight_quant = _weight_quantizer(args.weights, config, args.group_size)
    # a GPU's plan where one is here or its memory is given, else this host's CPU (where
    # int4 and fp8 also keep their weights dequantised: Quantizer.dense_on)
    cuda = args.device_memory is not None or torch.cuda.is_available()
    device, kernels = ("cuda", "triton") if cuda else ("cpu", "torch")
    mem = plan_memory(spec, model=name, dtype=dtype, kv_quantizer=kv_quant,
                      weight_quantizer=weight_quant,
                      max_seq_len=args.max_seq_len, max_batch_size=args.max_batch_size,
                      max_num_batched_tokens=args.max_num_batched_tokens,
                      budget=budget, budget_source=source, device=device)
    mem = attrs.evolve(mem, weight_bytes=mem.weight_bytes - not_held * element_bytes(dtype))
    if mem.active_weight_bytes is not None:  # a mixture of experts: its active share too
        mem = attrs.evolve(mem, active_weight_bytes=mem.active_weight_bytes
                           - not_held * element_bytes(dtype))
    if kv_quant is None and kv_dtype != dtype:  # float K/V in another dtype than weights
        kv = plan_memory(spec, dtype=kv_dtype, max_seq_len=mem.max_seq_len)
        mem = attrs.evolve(mem, kv_dtype=kv.kv_dtype, kv_bytes_per_token=kv.kv_bytes_per_token)
    rows, extra = [], {}
    if args.offload_weights:  # the layers beyond the budget in host memory
        mem, rows, extra = plan_offload.offload_plan(mem, spec, args, weight_quant, budget)
    elif args.resident_layers is not None or args.ring_size != 2:
        raise PlanError("--resident-layers and --ring-size plan --offload-weights; give it too")
    if weight_quant is not None and weight_quant.dense_on(torch.device(device), kernels):
        rows.append((f"{weight_quant.name} on the CPU", "the packed weights and their "
                     f"dequantised {mem.dtype} copies (the GEMM reads those)"))
    pool, pool_json = pool_rows(mem, args, cuda)
    rows += pool
    # the contiguous cache reserves max_batch_size x max_seq_len; the paged one admits by
    # blocks and needs a pool that holds one max_seq_len sequence
    fits = {"contiguous": mem.fits, "paged": pool_json["holds_max_seq_len"]}
    rows.append(("fits (paged cache)", "yes" if fits["paged"] else "NO"))
    if args.json:
        print(json.dumps({**attrs.asdict(mem), "kv_bytes_per_sequence": mem.kv_bytes_per_sequence,
                          "kv_bytes_total": mem.kv_bytes_total, "total_bytes": mem.total_bytes,
                          "max_batch_that_fits": mem.max_batch_that_fits, "fits": mem.fits,
                          "cache": args.cache, "paged_fits": fits["paged"],
                          "max_batch_with_window": mem.max_batch_with_window,
                          "micro_batches": args.micro_batches, "policy": policy, **extra,
                          "pool": pool_json}, indent=2))
    else:
        table = mem.rows()
        table.insert(1, ("policy", f"{policy} (for {spec.architecture})"))
        print(rows_table(table + rows))
    return FITS if fits[args.cache] else DOES_NOT_FIT


def pool_rows(mem, args, cuda: bool) -> tuple[list[tuple[str, str]], dict]:
    """(rows, JSON) of the paged pool a build of ``mem`` makes when ``num_blocks`` is not
    given: what ``--gpu-memory-utilization`` of the budget leaves beside the weights and
    activations, at most max_batch_size sequences' blocks (``cuda``: a device's rule; the
    CPU keeps that most while it fits the whole budget). With --offload-weights the
    placement is made beside that most, which a build then keeps."""
    bs = positive_int("--block-size", 16 if args.block_size is None else args.block_size)
    util = check_utilization(0.9 if args.gpu_memory_utilization is None
                             else args.gpu_memory_utilization, "--gpu-memory-utilization")
    lens = args.seq_len or [mem.max_seq_len]
    for n in lens:
        if positive_int("--seq-len", n) > mem.max_seq_len:
            raise PlanError(f"--seq-len {n} is longer than max_seq_len={mem.max_seq_len}; "
                            f"accepted: 1 to {mem.max_seq_len}")
    why = f"what {util:g} of the budget leaves, at most"
    if args.offload_weights or mem.budget is None:
        blocks, why = default_blocks(mem, bs), "the default:"
    else:
        blocks = pool_blocks(mem, mem.budget, bs, util, cuda)
    # a decoding sequence with a window holds at most held_blocks, whatever its length
    fit = {n: blocks // min(blocks_for(n, bs), held_blocks(mem, bs)) for n in lens}
    tokens = blocks * bs
    rows = [("K/V pool (paged)", f"{blocks} blocks of {bs} tokens = {tokens} tokens, "
             f"{fmt_bytes(tokens * mem.kv_bytes_per_token)} ({why} {mem.max_batch_size} x "
             f"{mem.max_seq_len} tokens)")]
    holds = blocks >= blocks_for(mem.max_seq_len, bs)
    if not holds:
        rows.append(("pool holds a max_seq_len sequence", "NO: a paged build refuses it"))
    for n, k in fit.items():
        at_once = f" ({mem.max_batch_size} at once: max_batch_size)" \
            if k > mem.max_batch_size else ""
        rows.append((f"{n}-token sequences in the pool", f"{k}{at_once}"))
    return rows, {"block_size": bs, "gpu_memory_utilization": util, "blocks": blocks,
                  "holds_max_seq_len": holds,
                  "tokens": tokens, "bytes": tokens * mem.kv_bytes_per_token,
                  "sequences": {str(n): k for n, k in fit.items()}}
